"""``python -m draftkit``."""

import sys

from draftkit.cli import main

sys.exit(main())
