"""`python -m jmoe.eval`: see jmoe.cli.eval."""

import sys

from jmoe.cli.eval import main

sys.exit(main())
