"""`python -m jmoe.convert`: see jmoe.cli.convert."""

import sys

from jmoe.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
