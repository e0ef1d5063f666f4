"""Fixtures of the layer-analysis tests: the shared tiny random Llama target."""

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_target_dir):
    """(model fp32 eval, tokenizer) of :func:`tiny_target_dir`."""
    from draftkit.target.frozen import load_target

    return load_target(str(tiny_target_dir), "float32")
