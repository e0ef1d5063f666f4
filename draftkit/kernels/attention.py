"""Grouped-query attention for a few query rows without copying keys and values: the decode-time attention
of the target (through transformers' attention interface, :mod:`draftkit.kernels.decode_attention`) and of the draft head.

Grouped-query attention (GQA) shares each key/value head among g = A / A_kv query heads. Transformers' SDPA
path either passes ``enable_gqa=True`` (no mask) or copies every key and value head g times (``repeat_kv``,
whenever there is a mask: every verify and tree forward). Both are slow for decoding's handful of rows on a
CPU: SmolLM2-135M (A = 9, A_kv = 3, d = 64), 2 threads of an AVX512-BF16 EPYC, one query row against 301
cached positions: ``enable_gqa`` took 125 us in bfloat16 against 27 us for the folded form below (6x at 1,201
positions: 511 vs 84 us), i.e. ~3 ms of a 17 ms decode step over 30 layers; float32 is level (21 vs 24 us). With
a mask the ``repeat_kv`` copies (and their bookkeeping) were ~2 ms of a 3-row float32 verify.

The folded form (what transformers' ``pack_gqa`` does for one row, and draftkit's TTT attention in training)
treats the g query heads of a key/value head as g x T rows of one head: queries (B, A, T, d) are viewed as
(B, A_kv, g*T, d), the mask's T rows are repeated g times, and one SDPA call reads each key/value head once.
Query head h = i*g + j belongs to key/value head i (transformers' ``repeat_kv`` order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_query_attention"]


def grouped_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of A query heads over A_kv shared key/value heads, query groups folded into rows.

    Equal (up to float rounding) to ``F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale,
    enable_gqa=True)``. There is no causal flag: pass the mask (None = every row sees every key, as a
    one-row decode step does).

    Args:
        q: (B, A, T, d) queries.
        k: (B, A_kv, S, d) keys, A divisible by A_kv.
        v: (B, A_kv, S, d_v) values.
        attn_mask: None, or broadcastable to (B, 1, T, S): a (T, S), (1, 1, T, S) or (B, 1, T, S) bool mask
            (True = may attend) or additive float mask of q's dtype, shared by all heads.
        scale: score scale (None: 1/sqrt(d)).

    Returns:
        (B, A, T, d_v) in q's dtype.

    Raises:
        ValueError: when A is not a multiple of A_kv, or (A > A_kv) the mask has a head axis other than 1 (with
            A = A_kv the call is plain SDPA, which takes per-head masks).
    """
    b, heads, t, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of key/value heads {kv_heads}")
    g = heads // kv_heads
    if g == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    qg = q.reshape(b, kv_heads, g * t, d)  # row j*T + t' = query head i*g + j, position t'
    mask = attn_mask
    if mask is not None:
        while mask.dim() < 4:
            mask = mask[None]
        if mask.shape[1] != 1:
            raise ValueError(f"attn_mask must be shared by all heads (head axis 1), got shape {tuple(attn_mask.shape)}")
        mb = mask.shape[0]
        mask = mask[:, :, None].expand(mb, 1, g, t, s).reshape(mb, 1, g * t, s)  # (B|1, 1, g*T, S)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # (B, A_kv, g*T, d_v)
    return out.reshape(b, heads, t, v.shape[-1])
