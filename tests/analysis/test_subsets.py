"""Subset screening, CKA blocks, constraints and the heuristic's rank (layer-analysis.md §8)."""

import itertools
import math

import pytest
import torch

from draftkit.analysis.entropy import h2_concat_closed_form
from draftkit.analysis.subsets import cka_blocks, enumerate_subsets, select_subsets


def _block_cka(sizes, within=0.9, across=0.2):
    p = sum(sizes)
    c = torch.full((p, p), across, dtype=torch.float64)
    start = 0
    for s in sizes:
        c[start:start + s, start:start + s] = within
        start += s
    c.fill_diagonal_(1.0)
    return c


def test_enumerate_subsets_counts():
    assert enumerate_subsets(29, 3).shape == (3654, 3)  # SmolLM2: C(29, 3)
    assert enumerate_subsets(27, 3).shape == (2925, 3)  # Qwen3-0.6B
    assert enumerate_subsets(4, 2).tolist() == [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]


def test_cka_blocks_recovers_a_block_diagonal_matrix():
    assert cka_blocks(_block_cka([3, 4, 2]), 3) == [(0, 3), (3, 7), (7, 9)]
    assert cka_blocks(_block_cka([5, 2]), 2) == [(0, 5), (5, 7)]
    assert cka_blocks(_block_cka([5, 2]), 1) == [(0, 7)]
    with pytest.raises(ValueError):
        cka_blocks(_block_cka([2]), 3)


def test_selection_prefers_entropy_and_diversity_and_ranks_the_heuristic():
    # N = 10 -> candidates 1..9, heuristic [2, 5, 7]
    n_layers, sizes = 10, [3, 3, 3]
    ids = list(range(1, n_layers))
    cka = _block_cka(sizes)
    h2 = torch.tensor([1.0, 1.2, 1.1, 1.0, 1.0, 1.3, 1.0, 2.0, 1.0], dtype=torch.float64)
    h1 = h2 + 0.5
    sel = select_subsets(ids, h1, h2, cka, n_layers, k=3, rerank_top=5)
    scores = h2_concat_closed_form(h2, cka, enumerate_subsets(9, 3))
    best = enumerate_subsets(9, 3)[int(scores.argmax())].tolist()
    assert sel.chosen == [ids[i] for i in best] == [2, 6, 8]  # one per block, the best entropy of each
    assert sel.blocks == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    heur = torch.tensor([ids.index(i) for i in (2, 5, 7)])
    h_score = float(h2_concat_closed_form(h2, cka, heur))
    assert sel.heuristic.ids == [2, 5, 7]
    assert sel.heuristic.h2_closed == pytest.approx(h_score)
    assert sel.heuristic_rank == 1 + int((scores > h_score + 1e-12).sum())
    assert sel.num_subsets == math.comb(9, 3) == sel.num_allowed
    assert sel.top[0].rank_h2 == 1 and sel.top[0].h1 is None


def test_exact_rerank_orders_by_h1_and_constraints_apply():
    n_layers = 10
    ids = list(range(1, n_layers))
    cka = _block_cka([3, 3, 3])
    h2 = torch.tensor([1.0, 1.2, 1.1, 1.0, 1.0, 1.3, 1.0, 2.0, 1.0], dtype=torch.float64)
    calls = []

    def exact(idx):
        calls.append(tuple(idx))
        return float(-sum(idx)), 0.0  # prefers the shallowest sets

    sel = select_subsets(ids, h2, h2, cka, n_layers, k=3, exact_entropy=exact, rerank_top=7)
    assert len(calls) == 7 + 1  # the re-ranked subsets plus the heuristic
    assert [s.h1 for s in sel.top] == sorted([s.h1 for s in sel.top], reverse=True)
    assert sel.chosen == sel.top[0].ids
    # constraints
    sel = select_subsets(ids, h2, h2, cka, n_layers, k=3, min_layer_id=3, rerank_top=50)
    assert all(min(s.ids) >= 3 for s in sel.top)
    sel = select_subsets(ids, h2, h2, cka, n_layers, k=2, require_late_layer=True, rerank_top=50)
    assert all(max(s.ids) >= n_layers - 4 for s in sel.top)
    sel = select_subsets(ids, h2, h2, cka, n_layers, k=3, one_per_block=True, rerank_top=100)
    assert sel.num_allowed == 27
    assert all(sorted((i - 1) // 3 for i in s.ids) == [0, 1, 2] for s in sel.top)
    assert sel.heuristic_rank_allowed is not None  # [2, 5, 7] has one per block


def test_bad_inputs():
    ids = list(range(1, 10))
    h = torch.ones(9, dtype=torch.float64)
    cka = torch.eye(9, dtype=torch.float64)
    with pytest.raises(ValueError, match="k=10 aux layers cannot be chosen from the 9 candidate"):
        select_subsets(ids, h, h, cka, 10, k=10)
    with pytest.raises(ValueError, match="repeats a layer"):
        select_subsets(ids, h, h, cka, 10, k=3, extra_sets=[[2, 2, 3]])
    with pytest.raises(ValueError, match="out of range"):
        select_subsets(ids, h, h, cka, 10, k=3, extra_sets=[[0, 2, 3]])
    with pytest.raises(ValueError, match="no 3-subset satisfies"):
        select_subsets(ids, h, h, cka, 10, k=3, min_layer_id=8)
    sel = select_subsets(ids, h, h, cka, 10, k=3, extra_sets=[[1, 2, 5], [1, 4]])
    assert [s.ids for s in sel.extra] == [[1, 2, 5], [1, 4]]
    assert sel.extra[1].rank_h2 is None


def test_heuristic_absent_when_the_rule_collapses():
    ids = list(range(1, 6))  # N = 6: [2, 3, 3] repeats a layer
    h = torch.ones(5, dtype=torch.float64)
    sel = select_subsets(ids, h, h, torch.eye(5, dtype=torch.float64), 6, k=3)
    assert sel.heuristic is None and sel.heuristic_rank is None
    assert len(sel.chosen) == 3


def test_identical_scores_share_rank():
    ids = list(range(1, 8))
    h = torch.ones(7, dtype=torch.float64)
    sel = select_subsets(ids, h, h, torch.eye(7, dtype=torch.float64), 8, k=3)
    assert sel.heuristic_rank == 1  # every subset scores log 3 + 1
    assert all(s.h2_closed == pytest.approx(1 + math.log(3)) for s in sel.top)
    assert len(list(itertools.combinations(ids, 3))) == sel.num_subsets


# cka_blocks against a brute force over every cut (issue 36): a block [i, j) gains its CKA sum over j - i.


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
