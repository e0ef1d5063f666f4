"""Fixtures for the decoding tests: a seeded tiny Llama target (built offline) and a tiny EAGLE3 head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pytest runs with --import-mode=importlib (no sys.path changes): make the helper module importable
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decoding_stubs import make_head


@pytest.fixture()
def tiny_head(tiny):
    return make_head(tiny[0])
