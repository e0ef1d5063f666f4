"""The frozen target wrapper captures exactly HF hidden_states[i]."""

import pytest
import torch

from draftkit.models.target import FrozenTarget


def test_captured_aux_states_equal_hf_hidden_states(tiny_target):
    target = FrozenTarget(tiny_target, [3, 1, 7])
    x = torch.randint(0, 320, (2, 9))
    out = target(x)
    ref = tiny_target(x, output_hidden_states=True)
    assert target.aux_layer_ids == [1, 3, 7]
    assert out.aux_hidden_states.shape == (2, 9, 3 * 64)
    assert torch.equal(out.aux_hidden_states, torch.cat([ref.hidden_states[i] for i in (1, 3, 7)], -1))
    assert torch.equal(out.last_hidden_state, ref.hidden_states[8])
    assert torch.equal(out.logits, ref.logits)
    assert not any(p.requires_grad for p in target.parameters())


def test_default_ids_and_bad_ids(tiny_target):
    assert FrozenTarget(tiny_target).aux_layer_ids == [2, 4, 5]
    with pytest.raises(ValueError, match="out of range"):
        FrozenTarget(tiny_target, [2, 8])


def test_cached_target_forward_equals_full(tiny_target):
    target = FrozenTarget(tiny_target)
    x = torch.randint(0, 320, (1, 10))
    full = target(x)
    first = target(x[:, :6], use_cache=True)
    rest = target(x[:, 6:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(rest.logits, full.logits[:, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest.aux_hidden_states, full.aux_hidden_states[:, 6:], rtol=1e-5, atol=1e-5)
