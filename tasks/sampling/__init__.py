"""Collect's helpers (the stage itself: tasks/collect.py): one verified sampling pass and the `rollouts` rows
(rollouts.py), DAPO dynamic sampling (dynamic.py), few-shot demonstrations from the store (demonstrations.py)."""
