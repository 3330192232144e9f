"""python -m datamem: the command line (the _cli package)."""
import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
