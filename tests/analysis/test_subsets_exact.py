"""draftkit.analysis.subsets.cka_blocks against a brute force over every cut (issue 36): the gain of a block
[i, j) is its CKA sum divided by its size j - i, and the blocks maximise the total gain."""

import itertools

import torch

from draftkit.analysis.subsets import cka_blocks


def _brute(c: torch.Tensor, k: int) -> list[tuple[int, int]]:
    p = c.shape[0]

    def gain(i, j):
        return float(c[i:j, i:j].double().sum()) / (j - i)

    best = max(itertools.combinations(range(1, p), k - 1),
               key=lambda cuts: sum(gain(i, j) for i, j in zip((0, *cuts), (*cuts, p))))
    return list(zip((0, *best), (*best, p)))


def test_cka_blocks_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    for p, k in ((5, 2), (6, 3), (7, 3)):
        for _ in range(4):
            a = torch.rand(p, p, generator=g, dtype=torch.float64)
            c = (a + a.T) / 2
            c.fill_diagonal_(1.0)
            assert cka_blocks(c, k) == _brute(c, k), (p, k, c)


def test_cka_blocks_hand_made():
    """Layers 0-2 alike (CKA 0.9), layer 3 apart (0.1): per-size gains make [0, 3) + [3, 4) the best split."""
    c = torch.full((4, 4), 0.1, dtype=torch.float64)
    c[:3, :3] = 0.9
    c.fill_diagonal_(1.0)
    assert cka_blocks(c, 2) == [(0, 3), (3, 4)]
