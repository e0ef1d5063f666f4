"""Dual precision: one 8-bit target run on its top 4 bits, escalating uncertain steps (dual-precision.md)."""

from draftkit.dual_precision.evaluate import *  # noqa: F401,F403
from draftkit.dual_precision.evaluate import __all__  # noqa: F401
