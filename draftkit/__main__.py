"""``python -m draftkit``: the verbs of ``draftkit.commands``."""

import sys

from draftkit.commands import main

sys.exit(main())
