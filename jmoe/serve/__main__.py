"""`python -m jmoe.serve`: see jmoe.cli.serve."""

import sys

from jmoe.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
