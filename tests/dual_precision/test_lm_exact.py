"""draftkit.dual_precision.lm.DualPrecisionLM.forward: the default keeps the last position's logits, and a
cache is extended and read (issue 36)."""

import pytest
import torch

from draftkit.dual_precision.lm import DualPrecisionLM


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from draftkit.target.frozen import load_target
    from draftkit.testing import build_tiny_target

    model, _ = load_target(str(build_tiny_target(tmp_path_factory.mktemp("lm") / "tiny-llama", seed=0)), "float64")
    return DualPrecisionLM(model)


def test_forward_default_returns_last_position_only(lm):
    ids = [5, 9, 3, 7]
    out = lm.forward(ids, None, "high")
    full = lm.forward(ids, None, "high", logits_to_keep=len(ids))
    assert out.shape == (1, full.shape[1]) and out.dtype == torch.float32
    assert torch.equal(out[0], full[-1])


def test_cached_forward_equals_cache_free(lm):
    """Prefix then one token through the cache == the whole sequence without one: the cache was filled and used."""
    ids = [5, 9, 3, 7]
    cache = lm.new_cache()
    lm.forward(ids[:3], cache, "low")
    assert cache.get_seq_length() == 3
    step = lm.forward(ids[3:], cache, "low")
    assert cache.get_seq_length() == 4
    torch.testing.assert_close(step, lm.forward(ids, None, "low"), rtol=1e-9, atol=1e-9)
