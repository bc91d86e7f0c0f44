"""`python -m tiercel`: the tiercel command line (see tiercel.cli)."""

import sys

from .cli import main

sys.exit(main())
