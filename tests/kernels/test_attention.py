"""draftkit.kernels.attention: grouped-query attention with the query groups folded into rows, against a plain
reference (keys and values repeated per query head, softmax written out)."""

from __future__ import annotations

import math

import pytest
import torch

from draftkit.kernels.attention import grouped_query_attention


def _reference(q, k, v, allowed=None, additive=None, scale=None):
    """Plain GQA: repeat each key/value head g times, scores, mask, softmax, weighted values (float64)."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if additive is not None:
        scores = scores + additive.double()
    return scores.softmax(-1) @ v


def _qkv(b, heads, kv_heads, t, s, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, t, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g),
            torch.randn(b, kv_heads, s, d, generator=g))


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (9, 3)])
def test_one_row_without_a_mask_matches_the_reference(heads, kv_heads):
    q, k, v = _qkv(2, heads, kv_heads, 1, 7)
    out = grouped_query_attention(q, k, v)
    assert out.shape == (2, heads, 1, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(q, k, v), rtol=1e-5, atol=1e-6)


def test_verify_rows_with_bool_and_additive_masks_match_the_reference():
    q, k, v = _qkv(1, 6, 2, 3, 10)
    causal = torch.ones(3, 10, dtype=torch.bool).tril(diagonal=7)  # 7 cached positions, then 3 new rows
    want = _reference(q, k, v, allowed=causal)
    torch.testing.assert_close(grouped_query_attention(q, k, v, causal).double(), want, rtol=1e-5, atol=1e-6)
    additive = torch.zeros(1, 1, 3, 10).masked_fill(~causal, torch.finfo(torch.float32).min)
    torch.testing.assert_close(grouped_query_attention(q, k, v, additive).double(), want, rtol=1e-5, atol=1e-6)
    # the row that sees only the cache ignores the new keys: changing them leaves row 0 as it was
    k2 = k.clone()
    k2[..., 8:, :] += 5
    row0 = grouped_query_attention(q, k, v, causal)[:, :, 0]
    assert torch.equal(grouped_query_attention(q, k2, v, causal)[:, :, 0], row0)


def test_a_per_sequence_mask_and_a_scale():
    q, k, v = _qkv(2, 4, 2, 2, 5, seed=3)
    allowed = torch.ones(2, 1, 2, 5, dtype=torch.bool)
    allowed[1, :, :, :2] = False  # sequence 1: two padded keys
    got = grouped_query_attention(q, k, v, allowed, scale=0.3)
    torch.testing.assert_close(got.double(), _reference(q, k, v, allowed=allowed, scale=0.3), rtol=1e-5, atol=1e-6)


def test_equals_torch_sdpa_with_enable_gqa_in_bfloat16():
    q, k, v = (x.bfloat16() for x in _qkv(1, 9, 3, 1, 301, d=64, seed=5))
    got = grouped_query_attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_bad_head_counts_and_per_head_masks_are_refused():
    q, k, v = _qkv(1, 5, 2, 1, 4)
    with pytest.raises(ValueError, match="query heads 5 are not a multiple of key/value heads 2"):
        grouped_query_attention(q, k, v)
    q, k, v = _qkv(1, 4, 2, 2, 4)
    with pytest.raises(ValueError, match=r"shared by all heads \(head axis 1\), got shape \(1, 4, 2, 4\)"):
        grouped_query_attention(q, k, v, torch.ones(1, 4, 2, 4, dtype=torch.bool))
