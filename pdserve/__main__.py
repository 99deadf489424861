import sys

from pdserve.cli import main

if __name__ == "__main__":  # spawned children re-import this module; only the real entry runs
    sys.exit(main())
