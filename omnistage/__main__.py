"""``python -m omnistage``: the ``omnistage`` command line."""

import sys

from omnistage.cli import main

sys.exit(main())
