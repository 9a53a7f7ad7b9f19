"""The Lorem-Ipsum vocabulary: LoPE's prefixes (tasks/core/lope.py) are drawn from it, and the scripted policy
(models/scripted.py) recognises a Lorem system prompt by it. It lives in models/ because models/ must not
import tasks/."""

LOREM = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et "
         "dolore magna aliqua ut enim ad minim veniam quis nostrud exercitation ullamco laboris nisi ut aliquip "
         "ex ea commodo consequat duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu "
         "fugiat nulla pariatur excepteur sint occaecat cupidatat non proident sunt in culpa qui officia deserunt "
         "mollit anim id est laborum").split()
