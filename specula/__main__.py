"""`python -m specula` runs the command line."""

import sys

from specula.cli import main

sys.exit(main())
