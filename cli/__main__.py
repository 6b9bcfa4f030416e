"""`python -m telerag.cli`, the same as the `telerag` script."""

import sys

from telerag.cli.main import main

sys.exit(main())
