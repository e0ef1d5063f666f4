"""Fixtures of the layer-analysis tests: one torch thread (the CPU is shared) and a tiny random Llama target."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A seeded 8-layer Llama (vocab 320, hidden 64) with a byte-level ChatML tokenizer, saved once."""
    from draftkit.testing import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("layer_analysis") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """(model fp32 eval, tokenizer) of :func:`tiny_llama_dir`."""
    from draftkit.models.target import load_target

    return load_target(str(tiny_llama_dir), "float32")
