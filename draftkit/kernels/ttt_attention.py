"""Attention of the draft head's training-time test (TTT, eagle3-format.md §4.2): step 0 is causal attention
over the step-0 keys; step k >= 1 adds each row's own keys of steps 1..k to the same softmax (SpecForge's
``cache_hidden`` scheme, ``llama3_eagle.py``).

:func:`ttt_attention_eager` is the plain definition (O(T^2) memory); :func:`ttt_attention` is what training runs
(O(T) memory per step on every device): a causal kernel with its log-sum-exp (:data:`CAUSAL_KERNELS`: the CPU
flash kernel, or a device-agnostic chunked one with a hand-written backward) merged with the diagonal keys
through the log-sum-exp (:class:`_LseMerge`), tested against the eager form for values and gradients.

Shapes: B batch, T tokens, A heads, A_kv kv heads, d head dim, k TTT steps after step 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CAUSAL_KERNELS", "ttt_attention", "ttt_attention_eager", "ttt_attention_flex"]


def ttt_attention_eager(q, ttt_cache, key_padding_mask, scale):
    """Reference TTT attention: dense (B, A, T, T) step-0 scores plus one diagonal column per later step.

    The plain definition that :func:`ttt_attention` (what training runs) is tested against; O(T^2) memory.

    Args:
        q: (B, A, T, d) this step's queries.
        ttt_cache: [(K_0, V_0), ..., (K_k, V_k)], each (B, A_kv, T, d), this step's last.
        key_padding_mask: (B, T) bool, True for real tokens (any padding layout).
        scale: 1/sqrt(d).

    Returns:
        (B, A, T, d) attention output before ``o_proj``.
    """
    b, heads, t, d = q.shape
    k0, v0 = ttt_cache[0]
    kv_heads = k0.shape[1]
    groups = heads // kv_heads
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & key_padding_mask[:, None, None, :]  # (B, 1, T, T)
    if len(ttt_cache) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, attn_mask=allowed, scale=scale, enable_gqa=groups > 1)
    # fold the query groups into the row axis so K_0/V_0 are shared without repeat_interleave copies
    qg = q.reshape(b, kv_heads, groups * t, d)  # (B, A_kv, g*T, d)
    dense = torch.matmul(qg, k0.transpose(-1, -2)).view(b, heads, t, t) * scale  # (B, A, T, T)
    dense = dense.masked_fill(~allowed, torch.finfo(dense.dtype).min)
    diag = torch.stack(
        [(q * kj.repeat_interleave(groups, dim=1)).sum(-1) * scale for kj, _ in ttt_cache[1:]], dim=-1
    )  # (B, A, T, k)
    scores = torch.cat([dense, diag.to(dense.dtype)], dim=-1)  # (B, A, T, T+k)
    probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    pd = probs[..., :t].reshape(b, kv_heads, groups * t, t)  # (B, A_kv, g*T, T)
    o = torch.matmul(pd, v0).view(b, heads, t, d)  # (B, A, T, d)
    for j, (_, vj) in enumerate(ttt_cache[1:]):
        o = o + probs[..., t + j, None] * vj.repeat_interleave(groups, dim=1)  # (B, A, T, d)
    return o


def _right_padding_order(key_padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) bool -> (order, inverse), each (B, T) int64: ``order`` lists each sequence's real positions first
    (in their order), then its pads; ``inverse`` undoes it. Causal attention over the reordered rows never lets a
    real row see a pad, whatever the padding layout (left, right, or holes)."""
    order = torch.argsort((~key_padding_mask).to(torch.int8), dim=1, stable=True)  # (B, T)
    return order, torch.argsort(order, dim=1)


def _take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of (B, heads, T, ...) picked along T by (B, T) int64 ``index`` (differentiable); None keeps x."""
    if index is None:
        return x
    b, t = index.shape
    return torch.gather(x, 2, index.view(b, 1, t, *([1] * (x.dim() - 3))).expand(*x.shape[:2], t, *x.shape[3:]))


CAUSAL_CHUNK = 256
"""Query rows per block of the device-agnostic causal kernel: its scores take (B, A, 256, T) at a time."""


def _causal_chunked(q, k, v, scale):
    """Device-agnostic causal attention with its log-sum-exp, query block by query block (O(T * 256) memory).

    Args: q, k, v (B, A, T, d) (k and v already repeated to A heads); scale.
    Returns: o (B, A, T, d) in q's dtype and lse (B, A, T) in float32 (float64 for float64 inputs).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    t = q.shape[2]
    o = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=acc)
    for s in range(0, t, CAUSAL_CHUNK):
        e = min(t, s + CAUSAL_CHUNK)
        scores = _chunk_scores(q, k, s, e, scale)  # (B, A, c, e)
        lse[:, :, s:e] = torch.logsumexp(scores, dim=-1)
        o[:, :, s:e] = torch.matmul(torch.exp(scores - lse[:, :, s:e, None]), v[:, :, :e].to(acc)).to(q.dtype)
    return o, lse


def _chunk_scores(q, k, s, e, scale):
    """Causal scores of query rows s..e-1 over keys 0..e-1: (B, A, e-s, e) in float32/64, -inf above the diagonal."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q[:, :, s:e].to(acc), k[:, :, :e].to(acc).transpose(-1, -2)) * scale
    above = torch.arange(e, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]  # (c, e)
    return scores.masked_fill(above, float("-inf"))


def _causal_chunked_backward(grad, q, k, v, out, lse, scale):
    """Gradients of :func:`_causal_chunked` for output gradient ``grad`` (B, A, T, d), FlashAttention-2's backward
    (arXiv 2307.08691, Alg. 2) block by block: P = exp(S - lse), D = rowsum(grad ∘ out), dS = P ∘ (grad v^T - D).

    ``out`` is the output whose D is used: the merged TTT output with ``grad`` = α dO gives the exact gradients of
    the context keys' part of the one softmax (see :class:`_LseMerge`). Returns dq, dk, dv in the inputs' dtypes.
    """
    acc = lse.dtype
    t = q.shape[2]
    dsum = (grad.to(acc) * out.to(acc)).sum(-1)  # (B, A, T)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for s in range(0, t, CAUSAL_CHUNK):
        e = min(t, s + CAUSAL_CHUNK)
        p = torch.exp(_chunk_scores(q, k, s, e, scale) - lse[:, :, s:e, None])  # (B, A, c, e)
        g = grad[:, :, s:e].to(acc)  # (B, A, c, d)
        dv[:, :, :e] += torch.matmul(p.transpose(-1, -2), g)
        ds = p * (torch.matmul(g, v[:, :, :e].to(acc).transpose(-1, -2)) - dsum[:, :, s:e, None])  # (B, A, c, e)
        dq[:, :, s:e] = (torch.matmul(ds, k[:, :, :e].to(acc)) * scale).to(q.dtype)
        dk[:, :, :e] += torch.matmul(ds.transpose(-1, -2), q[:, :, s:e].to(acc)) * scale
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _causal_flash_cpu(q, k, v, scale):
    """The CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``): as :func:`_causal_chunked`."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)


def _causal_flash_cpu_backward(grad, q, k, v, out, lse, scale):
    """The CPU flash kernel's backward: as :func:`_causal_chunked_backward`."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True, scale=scale
    )


CAUSAL_KERNELS = {
    "flash_cpu": (_causal_flash_cpu, _causal_flash_cpu_backward),
    "chunked": (_causal_chunked, _causal_chunked_backward),
}
"""Causal attention with log-sum-exp, (forward, backward) by name: ``flash_cpu`` (CPU tensors only) and
``chunked`` (any device); :func:`ttt_attention` takes ``flash_cpu`` on the CPU and ``chunked`` elsewhere."""


class _LseMerge(torch.autograd.Function):
    """softmax over [causal keys K_0 ; each row's own keys of steps 1..k] without a (B, A, T, T) tensor.

    Forward: 1. causal attention over K_0/V_0 gives o_c and the log-sum-exp ℓ of each row's context
    scores; 2. the diagonal scores s_j = scale q·k_j; 3. L = logsumexp(ℓ, s_1..s_k), α = exp(ℓ - L),
    β_j = exp(s_j - L); 4. o = α o_c + Σ_j β_j v_j (the one softmax, merged as in FlashAttention's
    split-K, arXiv 2205.14135).

    Backward: with D = rowsum(dO ∘ o), every score's gradient is P (dO·v - D). For the context keys
    P = α P_c, so the causal backward run with grad α dO, output o and log-sum-exp ℓ (it recomputes P_c
    from ℓ and takes its D from grad ∘ output = α D) returns their exact gradients; the diagonal terms
    are elementwise.

    Inputs: q, k0, v0 (B, A, T, d) (K_0/V_0 repeated to A heads); kd, vd (B, A_kv, T, k, d); scale; the
    name of a :data:`CAUSAL_KERNELS` entry. Output: (B, A, T, d) in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, scale, kernel):
        causal, _ = CAUSAL_KERNELS[kernel]
        acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
        with torch.autocast(q.device.type, enabled=False):
            b, heads, t, d = q.shape
            kv_heads = kd.shape[1]
            o_c, lse = causal(q, k0, v0, scale)
            qg = q.to(acc).view(b, kv_heads, heads // kv_heads, t, d)  # (B, A_kv, g, T, d)
            s = torch.einsum("bkgtd,bktjd->bkgtj", qg, kd.to(acc)).reshape(b, heads, t, -1) * scale  # (B, A, T, k)
            ell = lse.to(acc)  # (B, A, T)
            top = torch.maximum(ell, s.amax(-1))  # (B, A, T)
            total = top + torch.log(torch.exp(ell - top) + torch.exp(s - top[..., None]).sum(-1))  # (B, A, T)
            alpha = torch.exp(ell - total)  # (B, A, T)
            beta = torch.exp(s - total[..., None])  # (B, A, T, k)
            betag = beta.view(b, kv_heads, heads // kv_heads, t, -1)  # (B, A_kv, g, T, k)
            o = alpha[..., None] * o_c.to(acc) + torch.einsum(
                "bkgtj,bktjd->bkgtd", betag, vd.to(acc)
            ).reshape(b, heads, t, d)  # (B, A, T, d)
            o = o.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, o, lse, alpha, beta)
        ctx.scale, ctx.kernel = scale, kernel
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, kd, vd, o, lse, alpha, beta = ctx.saved_tensors
        scale, acc = ctx.scale, alpha.dtype
        _, causal_backward = CAUSAL_KERNELS[ctx.kernel]
        with torch.autocast(q.device.type, enabled=False):
            b, heads, t, d = q.shape
            kv_heads, g = kd.shape[1], heads // kd.shape[1]
            ga = grad.to(acc)
            dq, dk0, dv0 = causal_backward((alpha[..., None] * ga).to(q.dtype), q, k0, v0, o, lse, scale)
            dsum = (ga * o.to(acc)).sum(-1)  # (B, A, T): D
            gg = ga.view(b, kv_heads, g, t, d)  # (B, A_kv, g, T, d)
            ds = beta * (torch.einsum("bkgtd,bktjd->bkgtj", gg, vd.to(acc)).reshape(b, heads, t, -1) - dsum[..., None])
            dsg = ds.view(b, kv_heads, g, t, -1)  # (B, A_kv, g, T, k)
            dq = dq.to(acc) + scale * torch.einsum("bkgtj,bktjd->bkgtd", dsg, kd.to(acc)).reshape(b, heads, t, d)
            dkd = scale * torch.einsum("bkgtj,bkgtd->bktjd", dsg, q.to(acc).view(b, kv_heads, g, t, d))  # (B, A_kv, T, k, d)
            dvd = torch.einsum("bkgtj,bkgtd->bktjd", beta.view(b, kv_heads, g, t, -1), gg)  # (B, A_kv, T, k, d)
        return dq.to(q.dtype), dk0, dv0, dkd.to(kd.dtype), dvd.to(vd.dtype), None, None


def ttt_attention(q, ttt_cache, key_padding_mask, scale, causal_kernel=None):
    """TTT attention with O(T) memory per step on every device (eagle3-format.md §4.2): the same function as
    :func:`ttt_attention_eager` on every row that is not padding, in value and gradient, for any padding layout.

    Step 0 is ``F.scaled_dot_product_attention(is_causal=True)`` (flash / memory-efficient kernels on CPU and
    CUDA). Steps k >= 1 are causal attention over the step-0 keys with its log-sum-exp, plus each row's own
    keys of steps 1..k, merged through the log-sum-exp (:class:`_LseMerge`): no (B, A, T, T) tensor. Rows are
    first reordered so that each sequence's real tokens come first (:func:`_right_padding_order`): causality
    alone then hides the pads from the real rows.

    Args:
        q, ttt_cache, key_padding_mask, scale: as :func:`ttt_attention_eager`.
        causal_kernel: a :data:`CAUSAL_KERNELS` name, or None: ``flash_cpu`` for CPU tensors, else ``chunked``.

    Returns:
        (B, A, T, d) attention output before ``o_proj``; pad rows hold finite values no real row reads.
    """
    heads = q.shape[1]
    k0, v0 = ttt_cache[0]
    groups = heads // k0.shape[1]
    # on the CPU a right-padded batch (the collator's) skips the reordering: the check costs no device sync there
    skip = q.device.type == "cpu" and bool((key_padding_mask[:, 1:] <= key_padding_mask[:, :-1]).all())
    order, inverse = (None, None) if skip else _right_padding_order(key_padding_mask)
    q = _take_rows(q, order)
    k0r, v0r = (_take_rows(x, order).repeat_interleave(groups, dim=1) if groups > 1 else _take_rows(x, order)
                for x in (k0, v0))  # (B, A, T, d)
    if len(ttt_cache) == 1:
        o = F.scaled_dot_product_attention(q, k0r, v0r, is_causal=True, scale=scale)
    else:
        kd = _take_rows(torch.stack([kj for kj, _ in ttt_cache[1:]], dim=3), order)  # (B, A_kv, T, k, d)
        vd = _take_rows(torch.stack([vj for _, vj in ttt_cache[1:]], dim=3), order)  # (B, A_kv, T, k, d)
        kernel = causal_kernel or ("flash_cpu" if q.device.type == "cpu" else "chunked")
        o = _LseMerge.apply(q, k0r, v0r, kd, vd, scale, kernel)
    return _take_rows(o, inverse)


_compiled_flex = None


def ttt_attention_flex(q, ttt_cache, key_padding_mask, scale):
    """TTT attention as one FlexAttention call (``torch.nn.attention.flex_attention``), the form SpecForge trains
    with on GPUs: the keys of every step side by side, (B, A_kv, (k+1) T, d), under a block mask that lets row i see
    the step-0 keys j <= i that are not padding and its own key i of each later step; blocks the mask leaves empty
    are skipped, and FlexAttention differentiates itself. A candidate for CUDA, not yet the default: it runs
    compiled on CUDA (``torch.compile(flex_attention)``); on the CPU torch runs it eagerly and forward only (tests
    check its values against :func:`ttt_attention_eager`), and ``benchmarks/gpu_check.py`` compares its values,
    gradients, time and memory with :func:`ttt_attention` on a GPU.

    Args: as :func:`ttt_attention_eager`.

    Returns:
        (B, A, T, d); pad rows hold finite values no real row reads (each row sees at least its own later-step keys,
        or at step 0 whatever real keys precede it, else zeros).
    """
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, heads, t, _ = q.shape
    keys = torch.cat([kj for kj, _ in ttt_cache], dim=2)  # (B, A_kv, (k+1) T, d)
    values = torch.cat([vj for _, vj in ttt_cache], dim=2)
    real = key_padding_mask

    def visible(bi, h, row, col):
        pos = col % t  # the position of the key within its step
        return torch.where(col < t, (col <= row) & real[bi, pos], pos == row)

    block_mask = create_block_mask(visible, b, None, t, keys.shape[2], device=q.device)
    attend = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        attend = _compiled_flex
    return attend(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=heads != keys.shape[1])
