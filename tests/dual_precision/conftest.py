"""Fixtures of the dual-precision tests: the decoding tests' helper module (``chi2_pvalue``) made importable."""

from __future__ import annotations

import sys
from pathlib import Path

# pytest runs with --import-mode=importlib (no sys.path changes): share tests/decoding/decoding_stubs.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
