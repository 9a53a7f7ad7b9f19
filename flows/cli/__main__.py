"""`python -m flows.cli ...`: the `refinery` command without its console script."""

import sys

from flows.cli.parser import main

if __name__ == "__main__":
    sys.exit(main())
