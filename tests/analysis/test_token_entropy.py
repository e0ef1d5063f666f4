"""Token prediction entropy and the loss-weight filter (layer-analysis.md §7)."""

import math

import pytest
import torch

from draftkit.analysis.token_entropy import (
    _check_filter_args,
    entropy_filter_weights,
    quantile_threshold,
    shift_keys,
    token_entropy,
)

H = torch.tensor([[0.1, 2.0, 0.3, 1.5, 0.05, 3.0]])
MASK = torch.tensor([[0, 1, 1, 1, 1, 1]])


def test_token_entropy_values_and_chunking():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    ref = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(token_entropy(logits), ref, atol=1e-6)
    assert torch.allclose(token_entropy(logits, chunk_size=2), ref, atol=1e-6)
    assert float(token_entropy(torch.zeros(7))) == pytest.approx(math.log(7), abs=1e-6)
    assert float(token_entropy(torch.tensor([100.0, 0.0, 0.0]))) == pytest.approx(0.0, abs=1e-6)
    assert token_entropy(logits.bfloat16()).dtype == torch.float32


def test_filter_on_predicted_token_positions_is_exact():
    # key_offset=-1: token t is weighted by H[t-1]
    w, kept = entropy_filter_weights(H, MASK, "drop", threshold=1.0)
    assert w.tolist() == [[0.0, 0.0, 1.0, 0.0, 1.0, 0.0]]
    assert float(kept) == pytest.approx(2 / 5)
    w, kept = entropy_filter_weights(H, MASK, "downweight", threshold=1.0, downweight=0.25)
    assert w.tolist() == [[0.0, 0.25, 1.0, 0.25, 1.0, 0.25]]
    assert float(kept) == pytest.approx(2 / 5)


def test_filter_on_draft_rows_is_exact():
    # key_offset=+1: row t is weighted by H[t+1]; the last row has no key
    w, kept = entropy_filter_weights(H, MASK, "drop", threshold=1.0, key_offset=1)
    assert w.tolist() == [[0.0, 0.0, 1.0, 0.0, 1.0, 0.0]]
    assert float(kept) == pytest.approx(2 / 5)
    w, _ = entropy_filter_weights(H, torch.ones_like(MASK), "downweight", threshold=1.0, key_offset=1, downweight=0.5)
    assert w.tolist() == [[1.0, 0.5, 1.0, 0.5, 1.0, 0.0]]


def test_filter_quantile_and_logits_input():
    # keys of masked tokens with offset -1: [0.1, 2.0, 0.3, 1.5, 0.05]; the 0.4 quantile (linear) is 0.1 + 0.6 * 0.2 = 0.22
    assert quantile_threshold(torch.tensor([0.1, 2.0, 0.3, 1.5, 0.05]), 0.4) == pytest.approx(0.22, abs=1e-6)
    w, kept = entropy_filter_weights(H, MASK, "drop", quantile=0.4)
    assert w.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]]
    assert float(kept) == pytest.approx(3 / 5)
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 9) * 2
    mask = torch.tensor([[0, 1, 1, 1, 0, 1], [1, 1, 0, 1, 1, 1]])
    ent = token_entropy(logits)
    for off in (-1, 1):
        a = entropy_filter_weights(logits, mask, "drop", quantile=0.5, key_offset=off)
        b = entropy_filter_weights(ent, mask, "drop", quantile=0.5, key_offset=off)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_filter_off_and_empty_mask():
    w, kept = entropy_filter_weights(H, MASK, "off")
    assert torch.equal(w, MASK.float()) and float(kept) == 1.0
    w, kept = entropy_filter_weights(H, torch.zeros_like(MASK), "drop", quantile=0.5)
    assert float(w.sum()) == 0.0 and float(kept) == 1.0


def test_shift_keys():
    keys, has = shift_keys(H, 1, valid=torch.tensor([[1, 1, 1, 1, 1, 0]]))
    assert keys.tolist()[0][:4] == pytest.approx([2.0, 0.3, 1.5, 0.05])
    assert has.tolist() == [[True, True, True, True, False, False]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="drop"), "exactly one of threshold"),
        (dict(mode="drop", threshold=1.0, quantile=0.5), "exactly one of threshold"),
        (dict(mode="sometimes", threshold=1.0), "mode must be one of"),
        (dict(mode="drop", quantile=1.0), r"quantile must be in \[0, 1\)"),
        (dict(mode="downweight", threshold=1.0, downweight=2.0), "downweight must be in"),
    ],
)
def test_filter_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        entropy_filter_weights(H, MASK, **kwargs)


def test_filter_shape_mismatch():
    with pytest.raises(ValueError, match="matching mask"):
        entropy_filter_weights(torch.zeros(1, 5), MASK, "drop", threshold=1.0)


# The quantile's closed lower bound (issue 36).


def test_quantile_zero_is_allowed_and_one_is_not():
    _check_filter_args("drop", None, 0.0)  # [0, 1): 0 keeps every position
    with pytest.raises(ValueError, match=r"quantile must be in \[0, 1\)"):
        _check_filter_args("drop", None, 1.0)
    with pytest.raises(ValueError, match=r"quantile must be in \[0, 1\)"):
        _check_filter_args("drop", None, -0.1)


def test_a_key_equal_to_the_threshold_is_kept():
    """rows with key >= threshold keep weight 1: a key exactly at the threshold is high, a hair below is low."""
    h = torch.tensor([[0.5, 1.0, 0.75, 2.0]])
    mask = torch.tensor([[1, 1, 1, 1]])
    w, kept = entropy_filter_weights(h, mask, "drop", threshold=1.0, key_offset=0)
    assert w.tolist() == [[0.0, 1.0, 0.0, 1.0]] and float(kept) == 0.5
    w, _ = entropy_filter_weights(h, mask, "drop", threshold=0.75, key_offset=0)
    assert w.tolist() == [[0.0, 1.0, 1.0, 1.0]]


def test_quantile_threshold_equals_a_sorted_reference_and_keeps_the_quantile_row():
    keys = torch.tensor([0.3, 0.1, 0.4, 0.2, 0.5])
    for q, want in ((0.0, 0.1), (0.25, 0.2), (0.5, 0.3), (0.75, 0.4)):  # (n-1) q lands on a sorted key exactly
        assert quantile_threshold(keys, q) == pytest.approx(want)
    # quantile 0.5 over masked rows: the median row itself is kept (key == tau)
    w, kept = entropy_filter_weights(keys[None], torch.ones(1, 5), "drop", quantile=0.5, key_offset=0)
    assert w.tolist() == [[1.0, 0.0, 1.0, 0.0, 1.0]] and float(kept) == pytest.approx(3 / 5)
    # unmasked rows neither set the quantile nor get a weight
    w, _ = entropy_filter_weights(torch.tensor([[9.0, 0.1, 0.2, 0.3]]), torch.tensor([[0, 1, 1, 1]]), "drop",
                                  quantile=0.5, key_offset=0)
    assert w.tolist() == [[0.0, 0.0, 1.0, 1.0]]
