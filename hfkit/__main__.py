"""`python -m hfkit ...`: the same command line as the `hfkit` console script (see hfkit.cli)."""

import sys

from hfkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
