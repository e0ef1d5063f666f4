"""Fixtures of the layer-analysis tests: the shared tiny random Llama target."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_target_dir):
    """The shared seeded tiny Llama of tests/conftest.py."""
    return tiny_target_dir


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """(model fp32 eval, tokenizer) of :func:`tiny_llama_dir`."""
    from draftkit.target.frozen import load_target

    return load_target(str(tiny_llama_dir), "float32")
