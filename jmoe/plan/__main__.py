"""`python -m jmoe.plan`: see jmoe.cli.plan."""

import sys

from jmoe.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
