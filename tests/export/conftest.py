"""Fixtures for export tests (helpers live in export_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pytest runs with --import-mode=importlib (no sys.path changes): make the helper module importable
sys.path.insert(0, str(Path(__file__).resolve().parent))

from export_helpers import make_head, save_tiny_target, write_checkpoint


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_target_dir):
    """(checkpoint path, head) for the tiny target with the default aux ids [2, 4, 5]."""
    head, ids = make_head(tiny_target_dir)
    return write_checkpoint(tmp_path / "head.ckpt", head, tiny_target_dir, ids), head
