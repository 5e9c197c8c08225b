"""`python -m jmoe.generate`: see jmoe.cli.generate."""

import sys

from jmoe.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
