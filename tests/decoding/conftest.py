"""Fixtures for the decoding tests: a seeded tiny Llama target (built offline) and a tiny EAGLE3 head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# pytest runs with --import-mode=importlib (no sys.path changes): make the helper module importable
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decoding_stubs import make_head


@pytest.fixture(scope="session")
def tiny_dir(tiny_target_dir):
    """The shared seeded tiny Llama of tests/conftest.py."""
    return tiny_target_dir


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(FrozenTarget in float32, tokenizer) of the tiny Llama: V=320, H_t=64, 8 layers, aux ids [2, 4, 5]."""
    from draftkit.target.frozen import FrozenTarget, load_target

    model, tokenizer = load_target(str(tiny_dir), "float32")
    return FrozenTarget(model, None), tokenizer


@pytest.fixture()
def tiny_head(tiny):
    return make_head(tiny[0])
