"""Choosing k aux layers: exhaustive screening by closed-form H2(S), exact re-rank by H1(S) (layer-analysis.md §8).

1. Enumerate every k-subset of the P = N-1 candidates (C(29, 3) = 3,654 for SmolLM2) and score it by the
   closed-form H2(S) of the equally weighted concatenation (§5.1): high per-layer entropy and low cross-layer
   CKA both raise it ("maximum information, minimum redundancy" in one number).
2. Apply the constraints: ids >= ``min_layer_id`` (SGLang's conditional +1 rule forbids id 1,
   eagle3-format.md §6), optionally one layer in [N-4, N-1], optionally one layer per CKA depth block.
3. Re-rank the best ``rerank_top`` by the exact H1(S) (§5.2) and choose the first.
4. Report where the fixed rule [2, N//2, N-3] ranks among *all* subsets by the screening score.

CKA depth blocks: the contiguous partition of the layers into k blocks that maximises
Σ_B (1/|B|) Σ_{i,j∈B} CKA(i, j), the size-weighted mean within-block CKA. Because linear CKA is the cosine
between centered, normalised Gram matrices, this is exactly k-means on those Gram matrices restricted to
contiguous segments, solved by dynamic programming over change points (Nguyen, Raghu & Kornblith,
arXiv 2010.15327, describe the block structure).

Shapes: P candidate layers, M subsets, k layers per subset. Ids are HF ``hidden_states`` indices.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftkit.analysis.entropy import h2_concat_closed_form
from draftkit.selection.layers import default_aux_layer_ids, validate_aux_layer_ids

__all__ = ["Selection", "SubsetScore", "cka_blocks", "enumerate_subsets", "select_subsets"]


def enumerate_subsets(num: int, k: int) -> torch.Tensor:
    """(C(num, k), k) int64, every ascending k-subset of range(num) in lexicographic order."""
    return torch.tensor(list(itertools.combinations(range(num), k)), dtype=torch.long).view(-1, k)


def cka_blocks(cka: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """Contiguous partition of P layers into k blocks maximising Σ_B (1/|B|) Σ_{i,j∈B} CKA(i, j).

    Args:
        cka: (P, P) CKA matrix.
        k: number of blocks, 1 <= k <= P.

    Returns:
        k half-open ranges [start, end) of candidate positions, in order.

    Raises:
        ValueError: if k is outside 1..P.
    """
    p = cka.shape[0]
    if not 1 <= k <= p:
        raise ValueError(f"cannot cut {p} layers into {k} blocks")
    c = cka.to(torch.float64)
    cum = torch.zeros(p + 1, p + 1, dtype=torch.float64)
    cum[1:, 1:] = c.cumsum(0).cumsum(1)

    def gain(i: int, j: int) -> float:  # block [i, j)
        s = cum[j, j] - cum[i, j] - cum[j, i] + cum[i, i]
        return float(s) / (j - i)

    neg = float("-inf")
    best = [[neg] * (p + 1) for _ in range(k + 1)]  # best[b][j]: first j layers in b blocks
    back = [[0] * (p + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for b in range(1, k + 1):
        for j in range(b, p + 1):
            for i in range(b - 1, j):
                if best[b - 1][i] == neg:
                    continue
                v = best[b - 1][i] + gain(i, j)
                if v > best[b][j]:
                    best[b][j], back[b][j] = v, i
    cuts, j = [], p
    for b in range(k, 0, -1):
        i = back[b][j]
        cuts.append((i, j))
        j = i
    return cuts[::-1]


@dataclass
class SubsetScore:
    """Scores of one layer set.

    Attributes:
        ids: HF ``hidden_states`` indices, ascending.
        h2_closed: closed-form H2(S) (nats), the screening score.
        rank_h2: 1-based rank of ``h2_closed`` among all C(P, k) subsets (ties share the better rank); None for
            a set of another size.
        h1: exact H1(S) (nats), the re-ranking score (None if not computed).
        h2: exact H2(S) (nats) on the same route as ``h1``.
        mean_cka: mean pairwise CKA within the set.
        mean_h1: mean per-layer H1.
    """

    ids: list[int]
    h2_closed: float
    rank_h2: int | None
    h1: float | None = None
    h2: float | None = None
    mean_cka: float = 0.0
    mean_h1: float = 0.0

    def as_dict(self) -> dict:
        return {
            "ids": self.ids, "h1": self.h1, "h2": self.h2, "h2_closed": self.h2_closed, "rank_h2": self.rank_h2,
            "mean_cka": self.mean_cka, "mean_h1": self.mean_h1,
        }


@dataclass
class Selection:
    """Result of :func:`select_subsets`.

    Attributes:
        chosen: the chosen ids (the best exact H1(S) among the re-ranked subsets).
        top: the re-ranked subsets, best first.
        heuristic: scores of [2, N//2, N-3] (None when the rule repeats a layer, N < 7).
        heuristic_rank: its 1-based rank by H2(S) among all C(P, k) subsets (None unless k = 3).
        heuristic_rank_allowed: its rank among the subsets that satisfy the constraints (None if it violates them).
        blocks: CKA depth blocks as lists of ids (k blocks).
        num_subsets: C(P, k).
        num_allowed: subsets left by the constraints.
        extra: scores of user-given sets.
    """

    chosen: list[int]
    top: list[SubsetScore]
    heuristic: SubsetScore | None
    heuristic_rank: int | None
    heuristic_rank_allowed: int | None
    blocks: list[list[int]]
    num_subsets: int
    num_allowed: int
    extra: list[SubsetScore] = field(default_factory=list)


def select_subsets(
    layer_ids: list[int],
    h1: torch.Tensor,
    h2: torch.Tensor,
    cka: torch.Tensor,
    num_layers: int,
    k: int = 3,
    exact_entropy: Callable[[list[int]], tuple[float, float]] | None = None,
    rerank_top: int = 20,
    one_per_block: bool = False,
    require_late_layer: bool = False,
    min_layer_id: int = 1,
    extra_sets: list[list[int]] | None = None,
) -> Selection:
    """Score every k-subset, apply the constraints, re-rank the best and choose (§8 steps 3-6).

    Args:
        layer_ids: the P candidate ids (rows of ``h1``, ``h2``, ``cka``), ascending.
        h1: (P,) per-layer H1 (nats).
        h2: (P,) per-layer H2 (nats).
        cka: (P, P) linear CKA.
        num_layers: N, the target's decoder layers.
        k: aux layers to choose.
        exact_entropy: maps candidate positions (not ids) to the exact (H1(S), H2(S)); None re-ranks by the
            closed form only (h1 stays None).
        rerank_top: subsets re-ranked exactly.
        one_per_block: require one layer in each of the k CKA depth blocks.
        require_late_layer: require one id >= N - 4 (late layers carry next-token information).
        min_layer_id: smallest allowed id (2 for SGLang's conditional +1 rule).
        extra_sets: more sets to score and report (e.g. a low-ranked control set).

    Returns:
        :class:`Selection`.

    Raises:
        ValueError: if k is not in 1..P, no subset satisfies the constraints, or an extra set is invalid
            (repeats a layer, or holds an id outside 1..N-1 or not among the candidates).
    """
    p = len(layer_ids)
    if not 1 <= k <= p:
        raise ValueError(
            f"k={k} aux layers cannot be chosen from the {p} candidate layers (HF hidden_states indices "
            f"{layer_ids[0]}..{layer_ids[-1]} of a {num_layers}-layer target); use 1 <= k <= {p}"
        )
    pos = {lid: i for i, lid in enumerate(layer_ids)}
    h1 = h1.to(torch.float64).cpu()
    h2 = h2.to(torch.float64).cpu()
    cka = cka.to(torch.float64).cpu()
    ids_t = torch.tensor(layer_ids, dtype=torch.long)

    subsets = enumerate_subsets(p, k)  # (M, k)
    scores = h2_concat_closed_form(h2, cka, subsets)  # (M,)
    sorted_scores = torch.sort(scores, descending=True).values

    def rank_of(score: float) -> int:
        return 1 + int((sorted_scores > score + 1e-12).sum())

    block_ranges = cka_blocks(cka, k)
    blocks = [layer_ids[a:b] for a, b in block_ranges]
    sub_ids = ids_t[subsets]  # (M, k)
    allowed = (sub_ids >= min_layer_id).all(1)
    if require_late_layer:
        allowed &= (sub_ids >= num_layers - 4).any(1)
    if one_per_block:
        block_of = torch.empty(p, dtype=torch.long)
        for b, (a, e) in enumerate(block_ranges):
            block_of[a:e] = b
        allowed &= (block_of[subsets].sort(1).values == torch.arange(k)).all(1)
    num_allowed = int(allowed.sum())
    if num_allowed == 0:
        raise ValueError(
            f"no {k}-subset satisfies the constraints (min_layer_id={min_layer_id}, "
            f"require_late_layer={require_late_layer}, one_per_block={one_per_block}); relax one of them"
        )

    def describe(idx: list[int], exact: bool) -> SubsetScore:
        it = torch.tensor(idx, dtype=torch.long)
        s = float(h2_concat_closed_form(h2, cka, it))
        pairs = [float(cka[a, b]) for a, b in itertools.combinations(idx, 2)]
        out = SubsetScore(
            ids=[layer_ids[i] for i in idx], h2_closed=s, rank_h2=rank_of(s) if len(idx) == k else None,
            mean_cka=sum(pairs) / len(pairs) if pairs else 1.0, mean_h1=float(h1[it].mean()),
        )
        if exact and exact_entropy is not None:
            out.h1, out.h2 = exact_entropy(idx)
        return out

    allowed_idx = torch.nonzero(allowed).flatten()
    order = allowed_idx[torch.argsort(scores[allowed_idx], descending=True)]
    top = [describe(subsets[i].tolist(), exact=True) for i in order[: max(1, rerank_top)]]
    if exact_entropy is not None:
        top.sort(key=lambda s: -s.h1)
    chosen = validate_aux_layer_ids(top[0].ids, num_layers, option="chosen aux layers")

    heuristic, heuristic_rank, heuristic_rank_allowed = None, None, None
    heur_ids = default_aux_layer_ids(num_layers)
    if len(set(heur_ids)) == len(heur_ids) and all(i in pos for i in heur_ids):  # the rule collapses for N < 7
        heuristic = describe([pos[i] for i in heur_ids], exact=True)
        if k == len(heur_ids):
            heuristic_rank = heuristic.rank_h2
            match = (subsets == torch.tensor([pos[i] for i in heur_ids])).all(1)
            heur_row = int(torch.nonzero(match).flatten()[0])
            if bool(allowed[heur_row]):
                heuristic_rank_allowed = 1 + int((scores[allowed_idx] > scores[heur_row] + 1e-12).sum())

    extra = []
    for ids in extra_sets or []:
        ids = validate_aux_layer_ids(ids, num_layers, option="extra layer set")
        bad = [i for i in ids if i not in pos]
        if bad:
            raise ValueError(f"extra layer set {ids}: ids {bad} are not among the analysed candidates")
        extra.append(describe([pos[i] for i in ids], exact=True))

    return Selection(
        chosen=chosen, top=top, heuristic=heuristic, heuristic_rank=heuristic_rank,
        heuristic_rank_allowed=heuristic_rank_allowed, blocks=blocks, num_subsets=int(subsets.shape[0]),
        num_allowed=num_allowed, extra=extra,
    )
