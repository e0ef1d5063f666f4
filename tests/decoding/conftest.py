"""Fixtures for the decoding tests: a seeded tiny Llama target (built offline) and a tiny EAGLE3 head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# pytest runs with --import-mode=importlib (no sys.path changes): make the helper module importable
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decoding_stubs import make_head


@pytest.fixture(autouse=True)
def one_thread():
    """Keep unit tests to one core (other jobs share the machine) and restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from draftkit.testing import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("decoding") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(FrozenTarget in float32, tokenizer) of the tiny Llama: V=320, H_t=64, 8 layers, aux ids [2, 4, 5]."""
    from draftkit.models.target import FrozenTarget, load_target

    model, tokenizer = load_target(str(tiny_dir), "float32")
    return FrozenTarget(model, None), tokenizer


@pytest.fixture()
def tiny_head(tiny):
    return make_head(tiny[0])
