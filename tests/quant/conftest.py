"""Fixtures of the quantization tests: weights already on a 4-bit grid, as a dequantized GGUF holds them."""

from __future__ import annotations

import pytest
import torch


def _q4_1_blocks(rows: int, groups: int, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose every group of ``size`` inputs is m + k*d, k in 0..15 with both ends used: the
    dequantized form of a llama.cpp Q4_1 block (m and d fp16 values, the product in fp32 as gguf computes it).

    Returns:
        (w (rows, groups*size) float32, k (rows, groups*size) int64 4-bit levels).
    """
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 16, (rows, groups, size), generator=gen)
    k[..., 0], k[..., 1] = 0, 15  # both ends of the 16-level grid occur in every block
    k = k[..., torch.randperm(size, generator=gen)]  # (rows, groups, size)
    d = (torch.rand(rows, groups, 1, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-d * 7.5 + torch.randn(rows, groups, 1, generator=gen) * 0.01).half().float()
    w = (m + k * d).reshape(rows, groups * size)  # (O, I)
    return w, k.reshape(rows, groups * size)  # (O, I), (O, I)


@pytest.fixture
def q4_1_blocks():
    """The builder ``(rows, groups, size=32, seed=0) -> (w, k)`` of :func:`_q4_1_blocks`."""
    return _q4_1_blocks
