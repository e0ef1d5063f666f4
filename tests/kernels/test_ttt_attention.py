"""The O(T)-memory TTT attention against the dense reference: values, gradients, padding layouts, every step."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from draftkit.kernels import ttt_attention as ttt_kernels
from draftkit.kernels.ttt_attention import CAUSAL_KERNELS, ttt_attention, ttt_attention_eager

PADDINGS = ("none", "right", "left", "holes")


def _mask(b, t, padding):
    mask = torch.ones(b, t, dtype=torch.bool)
    n = max(1, (2 * t) // 3)  # real tokens of sequence 1
    if padding == "right":
        mask[1, n:] = False
    elif padding == "left":
        mask[1, : t - n] = False
    elif padding == "holes":
        mask[1, ::3] = False
        mask[1, 0] = True
    return mask


def _inputs(b, heads, kv_heads, t, d, steps, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, t, d, dtype=dtype, generator=g).requires_grad_()
    cache = [
        tuple(torch.randn(b, kv_heads, t, d, dtype=dtype, generator=g).requires_grad_() for _ in range(2))
        for _ in range(steps)
    ]
    return q, cache


def _value_and_grads(attend, q, cache, mask, weight, scale):
    """Real rows of the output and the gradients of a loss that pad rows do not carry."""
    o = attend(q, cache, mask, scale)
    leaves = [q] + [x for kv in cache for x in kv]
    real = mask[:, None, :, None]
    return [o * real] + list(torch.autograd.grad((o * weight * real).sum(), leaves))


@pytest.mark.parametrize("kernel", sorted(CAUSAL_KERNELS))
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("t", [1, 7, 64, 200])
def test_equals_dense_reference_in_value_and_gradient(kernel, padding, t, monkeypatch):
    """float32, B=2, 4 heads over 2 kv heads, every TTT step up to k = 3; 64-row query blocks (T=200: 4 blocks)."""
    monkeypatch.setattr(ttt_kernels, "CAUSAL_CHUNK", 64)
    b, heads, kv_heads, d = 2, 4, 2, 16
    mask = _mask(b, t, padding)
    if padding != "none" and t > 1:
        assert not mask.all() and mask.any(dim=1).all()
    for steps in (1, 2, 3, 4):
        q, cache = _inputs(b, heads, kv_heads, t, d, steps, torch.float32, seed=steps)
        weight = torch.randn(b, heads, t, d, generator=torch.Generator().manual_seed(9))
        ref = _value_and_grads(ttt_attention_eager, q, cache, mask, weight, d**-0.5)
        got = _value_and_grads(
            lambda *a: ttt_attention(*a, causal_kernel=kernel), q, cache, mask, weight, d**-0.5
        )
        for r, x in zip(ref, got):
            assert torch.isfinite(x).all()
            torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(CAUSAL_KERNELS))
def test_gradcheck_float64(kernel, monkeypatch):
    """Analytic gradients of the custom backward equal finite differences (float64, left padding, 3 blocks)."""
    monkeypatch.setattr(ttt_kernels, "CAUSAL_CHUNK", 2)
    b, heads, kv_heads, t, d = 2, 2, 1, 5, 3
    mask = _mask(b, t, "left")
    q, cache = _inputs(b, heads, kv_heads, t, d, 3, torch.float64)
    flat = [q] + [x for kv in cache for x in kv]

    def f(q, *kv):
        cache = [(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)]
        return ttt_attention(q, cache, mask, 0.7, causal_kernel=kernel) * mask[:, None, :, None]

    assert torch.autograd.gradcheck(f, flat, eps=1e-6, atol=1e-8)


def test_default_kernel_is_flash_cpu_on_cpu():
    """On CPU tensors the CPU flash kernel runs; the chunked kernel is what every other device runs."""
    calls = []
    forward, backward = CAUSAL_KERNELS["flash_cpu"]
    spy = {"flash_cpu": (lambda *a: calls.append("fwd") or forward(*a), lambda *a: calls.append("bwd") or backward(*a))}
    q, cache = _inputs(1, 2, 1, 4, 4, 2, torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CAUSAL_KERNELS, "flash_cpu", spy["flash_cpu"])
        ttt_attention(q, cache, torch.ones(1, 4, dtype=torch.bool), 0.5).sum().backward()
    assert calls == ["fwd", "bwd"]


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("kernel", sorted(CAUSAL_KERNELS))
def test_no_dense_scores_at_any_step(kernel):
    """Forward + backward of steps 0..3 at T = 1024 make no tensor of B*A*T*T/2 elements (the dense one makes T*(T+k))."""
    b, heads, kv_heads, t, d = 1, 2, 1, 1024, 8
    mask = _mask(b, t, "none")
    sizes = {}
    for name, attend in (("eager", ttt_attention_eager), (kernel, lambda *a: ttt_attention(*a, causal_kernel=kernel))):
        q, cache = _inputs(b, heads, kv_heads, t, d, 4, torch.float32)
        with _LargestTensor() as mode:
            loss = sum(attend(q, cache[: k + 1], mask, d**-0.5).sum() for k in range(4))
            loss.backward()
        sizes[name] = mode.largest
    assert sizes["eager"] >= b * heads * t * t
    assert sizes[kernel] <= b * heads * t * ttt_kernels.CAUSAL_CHUNK


@pytest.mark.parametrize("padding", PADDINGS)
def test_flex_candidate_equals_dense_reference_forward(padding):
    """The FlexAttention form (the CUDA candidate; forward only on the CPU): the real rows equal the dense
    reference at every step up to k = 3, T = 40 (blocks of 128 cover it partly), 4 heads over 2 kv heads."""
    import warnings

    from draftkit.kernels.ttt_attention import ttt_attention_flex

    b, heads, kv_heads, t, d = 2, 4, 2, 40, 16
    mask = _mask(b, t, padding)
    real = mask[:, None, :, None]
    for steps in (1, 2, 4):
        q, cache = _inputs(b, heads, kv_heads, t, d, steps, torch.float32, seed=steps)
        q, cache = q.detach(), [tuple(x.detach() for x in kv) for kv in cache]  # its CPU path has no backward
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile": expected on the CPU
            ref = ttt_attention_eager(q, cache, mask, d**-0.5)
            got = ttt_attention_flex(q, cache, mask, d**-0.5)
        assert got.shape == ref.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got * real, ref * real, rtol=1e-5, atol=1e-5)
