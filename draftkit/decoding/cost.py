"""A cost model that picks the draft topology (chain k, or tree depth, top-k, N) for this device.

Expected speed of a topology c (batch 1, one target forward per round):

    tokens/s(c) = tau(c) / (t_first + (D - 1) * t_step(K) + t_verify(N + 1)),   plain: 1 / t_verify(1)

A hybrid with prompt lookup (``TreeConfig.lookup``, ``decoding.tree``) varies from round to round: in ``lookup``
mode the verify runs the N + 1 rows plus the lookup branch's new nodes, in ``switch`` mode a round drafted by
prompt lookup costs only the verify of its chain (the head does not run). It is priced round by round over the
calibration: tokens/s = sum_r (a_r + 1) / sum_r seconds_r, which for a plain head shape is the formula above.

- t_verify(n): seconds of the cheapest target forward that verifies n rows. Each measured entry (one
  forward over m new rows on a prompt-length cache, linear between measured m) is the fastest of a few
  repeats. A forward over more rows can cost less than over fewer: on a CPU, float32 ``linear`` with 2-3
  rows takes a matrix-vector path per row while 4 or more take one GEMM (SmolLM2's 49152 x 576 LM head on
  one AVX512 core: 1 row 9.9 ms, 3 rows 36 ms, 4 rows 18 ms), so a verify of n rows is padded with dummy
  rows up to the measured m >= n that costs least (:meth:`CostTable.cover`; the session runs that padding,
  ``TargetSession.pad_rows``), as vLLM pads a batch up to a captured CUDA-graph size.
- t_first: the draft head's pass over its pending step-0 rows; t_step(K): one head pass over a frontier of
  K nodes (a chain has K = 1); the head is not padded, so its table is fitted with a nondecreasing step
  function (isotonic regression, :func:`monotone`) before use.
- tau(c): acceptance length of c measured by a short greedy calibration. Greedy decoding emits the same
  sequence whatever the topology, and the draft state at a round's root depends only on that sequence,
  so one plain greedy run per calibration prompt fixes every root; at each root the largest tree of each
  top-k is drafted once and the accepted length of every (depth, N) read off it (a (D, K, N) tree is the
  best N of the depth <= D nodes of the (D_max, K) tree, EAGLE-2's rank order). Replaying the rounds from
  the prompt end (L -> L + a_c(L) + 1) gives tau(c) without a target verify per topology. Prompt lookup's
  continuation at a root depends only on the sequence, so a hybrid's round is read off the same roots: the
  longer of the head's and the lookup's matches (``lookup``), or the lookup's alone where it has a continuation
  (``switch``).
- At T > 0 greedy tau only shortlists: a tree's drafts are fixed (the draft's top tokens, each accepted with the
  target's probability of it: ``tree.tree_rejection_accept``), as are prompt lookup's, while a chain samples its
  drafts from the head and accepts with min(1, p/q), so greedy calibration rates them unequally: where the target is
  flat a fixed draft is accepted far less often than greedily. The best few shapes by the greedy prediction and the
  best chain are decoded at the run's temperature (:func:`calibrate_sampled`) and the pick is made on those rounds.

The chosen topology is the one with the highest predicted tokens/s; plain decoding is chosen when no
topology is predicted faster than it.

The candidates (:func:`candidate_topologies`) are shaped for a CPU as well as a GPU: besides the chains, trees
of depth up to 8 with N + 1 verify rows of 4 to 32 (N = 3, 5, 7, 11, 15, 23, 31): a CPU's verify cost is flat
to about 8 rows and grows past it (SmolLM2 bf16 on 2 AVX512-BF16 cores: 16 rows 1.41x one row, 32 rows 1.83x),
so small deep trees (EAGLE-2's best N by path probability, ``tree.select_nodes``) are where a tree can pay,
and the measured verify cost (not a fixed N) decides how many nodes it keeps.

Shapes: n prompt tokens, T calibration tokens, D depth, K top-k, N verified draft nodes.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from typing import NamedTuple

from draftkit.decoding.metrics import HEAD, acceptance_length
from draftkit.decoding.verify import generate_plain, generate_speculative
from draftkit.precision import synchronize
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession
from draftkit.decoding.tree import LOOKUP_MODES, Eagle3TreeDrafter, TreeConfig, generate_tree, tree_greedy_accept

__all__ = [
    "CostTable",
    "Played",
    "Prediction",
    "calibrate_rounds",
    "calibrate_sampled",
    "calibrate_tau",
    "candidate_topologies",
    "choose",
    "fastest",
    "greedy_sequences",
    "measure_costs",
    "monotone",
    "predict",
    "round_seconds",
]


Naming = Callable[[int], AbstractContextManager]
"""``naming(i)`` wraps the work on calibration prompt i, so that an error there names the prompt: ``evaluate``
passes ``decoding.harness._naming_prompt``, which re-raises a ``NonFiniteLogitsError`` with the prompt's index
and id and the target's and head's dtypes, as its decoding does."""


def _named(naming: Naming | None, i: int) -> AbstractContextManager:
    return naming(i) if naming is not None else nullcontext()


PAD_MARGIN = 0.03
"""A verify is padded to more rows only when that forward measured at least 3 % faster."""


@dataclass
class CostTable:
    """Measured costs, in seconds.

    Attributes:
        verify: {m: one target forward over m new rows}, m >= 1, at least m = 1 (as measured; a verify of n
            rows costs :meth:`cover`).
        first: one draft head pass over the pending step-0 rows (typically a + 1 of them).
        step: {K: one draft head pass over K frontier nodes}, at least K = 1.
        measured: the raw timings {"verify": {...}, "step": {...}} when ``step`` is their :func:`monotone`
            fit (as :func:`measure_costs` returns it); None for a table given by hand.
    """

    verify: dict[int, float]
    first: float
    step: dict[int, float]
    measured: dict[str, dict[int, float]] | None = None

    @staticmethod
    def _interp(table: dict[int, float], n: int) -> float:
        xs = sorted(table)
        if n in table:
            return table[n]
        lo = max([x for x in xs if x < n], default=xs[0])
        hi = min([x for x in xs if x > n], default=xs[-1])
        if lo == hi:  # outside the measured range: extend the last (or first) segment, never downhill past it
            pair = xs[-2:] if n > xs[-1] else xs[:2]
            if len(pair) < 2:
                return table[xs[0]]
            lo, hi = pair
            slope = max(0.0, (table[hi] - table[lo]) / (hi - lo))
            end = hi if n > hi else lo
            return table[end] + slope * (n - end)
        return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)

    def cover(self, n: int) -> tuple[int, float]:
        """The cheapest target forward that verifies n rows: (rows m >= n to run, its seconds).

        m is n itself (linear between measured row counts, extended past them) or a measured m > n that costs
        at least ``PAD_MARGIN`` less (timing noise alone never decides); among those the cheapest. E.g. measured
        {1: 61, 2: 104, 3: 124, 4: 90, 8: 82} ms -> cover(1) = (1, 61), cover(2) = cover(3) = cover(5) = (8, 82).
        """
        own = max(self._interp(self.verify, n), 0.0)
        best = (n, own)
        for m in sorted(self.verify):
            if m > n and self.verify[m] < min(best[1], own * (1 - PAD_MARGIN)):
                best = (m, self.verify[m])
        return best

    def verify_seconds(self, n: int) -> float:
        """Seconds to verify n rows: the :meth:`cover` forward's."""
        return self.cover(n)[1]

    def padding(self) -> dict[int, int]:
        """{n: m} for every n below the largest measured row count whose :meth:`cover` pads it to m > n."""
        out = {}
        for n in range(1, max(self.verify)):
            m = self.cover(n)[0]
            if m > n:
                out[n] = m
        return out

    def round_seconds(self, tree: TreeConfig, nodes: int | None = None, head: bool = True) -> float:
        """One speculative round: step 0, D - 1 frontier passes of width K, one verify of N + 1 rows.

        Args:
            tree: the topology.
            nodes: draft nodes verified (default N; a hybrid round's N plus its lookup nodes, or its lookup chain).
            head: whether the head drafted the round (not in a ``switch`` round drafted by prompt lookup).
        """
        draft = self.first + (tree.depth - 1) * max(self._interp(self.step, tree.topk), 0.0) if head else 0.0
        return draft + self.verify_seconds((tree.num_nodes if nodes is None else nodes) + 1)


@dataclass(frozen=True)
class Prediction:
    """The model's estimate for one topology.

    Attributes:
        tree: the topology (a chain k is ``TreeConfig(k, 1, k)``).
        tau: calibrated acceptance length (bonus token counted).
        round_seconds: predicted seconds per round.
        tokens_per_s: tau / round_seconds.
        speedup: tokens_per_s over plain decoding's 1 / t_verify(1).
    """

    tree: TreeConfig
    tau: float
    round_seconds: float
    tokens_per_s: float
    speedup: float

    def as_dict(self) -> dict:
        out = asdict(self)
        out["tree"] = str(self.tree)
        out["chain"] = self.tree.is_chain
        out["hybrid"] = self.tree.suffix or None
        return out


class Played(NamedTuple):
    """One calibration round a topology would play.

    Attributes:
        accepted: a_r, accepted drafts.
        nodes: draft nodes verified (N; a hybrid's N plus its lookup nodes, or a ``switch`` round's lookup chain).
        head: whether the head drafted the round.
    """

    accepted: int
    nodes: int
    head: bool


def round_seconds(tree: TreeConfig, played: list[Played], costs: CostTable) -> float:
    """Mean seconds per round of ``tree`` over its calibration rounds (:meth:`CostTable.round_seconds` each)."""
    return sum(costs.round_seconds(tree, p.nodes, p.head) for p in played) / len(played)


def predict(taus: dict[TreeConfig, float], costs: CostTable, seconds: dict[TreeConfig, float] | None = None
            ) -> list[Prediction]:
    """Predicted tokens/s and speedup of every calibrated topology, best first.

    Args:
        taus: {topology: tau}.
        costs: the measured :class:`CostTable`.
        seconds: {topology: mean seconds per round} from the calibration (:func:`round_seconds`; a hybrid's
            rounds differ); a topology left out costs :meth:`CostTable.round_seconds` of its full shape.

    Returns:
        Predictions sorted by tokens/s, descending.
    """
    plain = 1.0 / costs.verify_seconds(1)
    out = []
    for tree, tau in taus.items():
        sec = (seconds or {}).get(tree) or costs.round_seconds(tree)
        out.append(Prediction(tree, tau, sec, tau / sec, tau / sec / plain))
    return sorted(out, key=lambda p: -p.tokens_per_s)


def choose(predictions: list[Prediction]) -> Prediction | None:
    """The fastest topology, or None (plain decoding) when none is predicted faster than plain."""
    best = max(predictions, key=lambda p: p.tokens_per_s, default=None)
    return best if best is not None and best.speedup > 1.0 else None


def candidate_topologies(
    tree: bool, max_depth: int = 8, topks: tuple[int, ...] = (2, 3, 4),
    nodes: tuple[int, ...] = (3, 5, 7, 11, 15, 23, 31), lookups: tuple[int, ...] = (),
) -> list[TreeConfig]:
    """Chains k = 1..max_depth, plus (with ``tree``) every (depth, top-k, N) with N <= the candidates; then each
    of them again as a hybrid with a prompt-lookup continuation of every length in ``lookups``, in each mode
    (``tree.LOOKUP_MODES``)."""
    out = [TreeConfig.chain(k) for k in range(1, max_depth + 1)]
    if tree:
        for d in range(2, max_depth + 1):
            for k in topks:
                out += [TreeConfig(d, k, n) for n in nodes if d <= n <= TreeConfig(d, k, 1).max_nodes]
    return out + [TreeConfig(t.depth, t.topk, t.num_nodes, n, mode)
                  for n in lookups for mode in LOOKUP_MODES for t in out]


@torch.no_grad()
def calibrate_rounds(
    drafter: Eagle3TreeDrafter,
    target: TargetSession,
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    topologies: list[TreeConfig],
    naming: Naming | None = None,
) -> dict[TreeConfig, list[Played]]:
    """The rounds that greedy decoding with each topology would play, from plain greedy outputs (see the module
    docstring); :func:`calibrate_tau` turns them into tau, :func:`round_seconds` into seconds per round.

    Args:
        drafter: the tree drafter of the head (its ``lookup`` drafter drafts the hybrids' continuations).
        target: the target session (used for one forward over each whole sequence).
        sequences: (prompt (n,), greedy continuation (T,)) int64 pairs.
        topologies: the topologies to rate.
        naming: wraps the work on sequence i (:data:`Naming`), e.g. to name its prompt in an error.

    Returns:
        {topology: [:class:`Played` over the rounds of all sequences]}; a round whose bonus token would fall past
        a continuation's end is cut to the tokens that exist.

    Raises:
        ValueError: if no sequence has a continuation of at least 2 tokens.
        NonFiniteLogitsError: (a ValueError) on NaN/inf draft logits, through ``naming`` when given.
    """
    max_depth = max(t.depth for t in topologies)
    by_topk = sorted({t.topk for t in topologies})
    lookups = sorted({t.lookup for t in topologies if t.lookup})
    played: dict[TreeConfig, list[Played]] = {t: [] for t in topologies}
    for index, (prompt, cont) in enumerate(sequences):
        n, T = prompt.shape[0], cont.shape[0]
        if T < 2:
            continue
        with _named(naming, index):
            full = torch.cat([prompt, cont])
            target.reset()
            _, aux = target.forward(full, logits_to_keep=1)  # aux (n+T, A*H_t)
            drafter.reset(prompt, aux[:n])
            per_root: dict[TreeConfig, list[Played]] = {t: [] for t in topologies}
            for L in range(n, n + T - 1):  # root x_L, continuation full[L+1:]
                z, h = drafter.feed_pending(full[:L + 1])
                chains = {m: drafter.lookup.continuation(full[:L + 1], m).tolist() for m in lookups}
                for k in by_topk:
                    big = TreeConfig(max_depth, k, TreeConfig(max_depth, k, 1).max_nodes)
                    tree = drafter.expand(z, h, L, big)  # every candidate, in EAGLE-2 rank order
                    want = torch.cat([tree.depths.new_zeros(1), tree.depths]) + L + 1  # (N+1,) position each row predicts
                    best = torch.where(want < full.shape[0], full[want.clamp_max(full.shape[0] - 1)], -1)
                    path, _ = tree_greedy_accept(tree, best)
                    kids, tokens = tree.children(), tree.tokens.tolist()
                    for t in topologies:
                        if t.topk != k:
                            continue
                        rank = torch.cumsum((tree.depths <= t.depth).long(), 0) - 1  # rank among depth <= D nodes
                        kept = ((tree.depths <= t.depth) & (rank < t.num_nodes)).tolist()
                        a = 0
                        for node in path:
                            if not kept[node]:
                                break
                            a += 1
                        per_root[t].append(_hybrid_round(t, a, chains.get(t.lookup, []), full[L + 1:].tolist(),
                                                         kids, tokens, kept))
                drafter.commit(aux[L:L + 1])
        for t in topologies:  # replay the rounds this topology would play
            i = 0
            while i < T - 1:
                p = per_root[t][i]
                p = p._replace(accepted=min(p.accepted, T - 2 - i))
                played[t].append(p)
                i += p.accepted + 1
    if not any(played.values()):
        raise ValueError("calibration needs at least one greedy continuation of 2 or more tokens")
    return played


@torch.no_grad()
def calibrate_sampled(
    drafter: Eagle3TreeDrafter,
    target: TargetSession,
    prompts: list[torch.Tensor],
    cfg: DecodeConfig,
    generators: Callable[[int], torch.Generator],
    topologies: list[TreeConfig],
    naming: Naming | None = None,
) -> dict[TreeConfig, list[Played]]:
    """The rounds each topology plays when it decodes the prompts at ``cfg``'s temperature (> 0): a chain without
    prompt lookup as the chain runs (``verify.generate_speculative``: sampled drafts, min(1, p/q)), anything else
    as a tree (``tree.generate_tree``: fixed drafts), each prompt with ``generators(i)``.

    Args:
        drafter: the head's tree drafter.
        target: the target session.
        prompts: (n_i,) int64 templated calibration prompts.
        cfg: the run's sampling options, ``max_new_tokens`` the calibration's length in tokens.
        generators: ``generators(i)`` is prompt i's RNG (the evaluation's own seeding).
        topologies: the shapes to decode.
        naming: wraps the work on prompt i (:data:`Naming`).

    Returns:
        {topology: [:class:`Played` per round of all prompts]}.

    Raises:
        ValueError: if ``cfg`` is greedy (greedy rounds are read off one plain run: :func:`calibrate_rounds`) or a
            topology played no round.
    """
    if cfg.greedy:
        raise ValueError("calibrate_sampled is for temperature > 0; greedy calibration is calibrate_rounds")
    played: dict[TreeConfig, list[Played]] = {t: [] for t in topologies}
    for t in topologies:
        for i, ids in enumerate(prompts):
            with _named(naming, i):
                if t.is_chain and not t.lookup:
                    stats = generate_speculative(target, drafter, ids, t.depth, cfg, generators(i)).stats
                    played[t] += [Played(a, d, True) for a, d in zip(stats.accepted, stats.drafted)]
                else:
                    stats = generate_tree(target, drafter, ids, t, cfg, generators(i)).stats
                    played[t] += [Played(a, d, bool(src & HEAD)) for a, d, src
                                  in zip(stats.accepted, stats.drafted, stats.round_sources)]
        if not played[t]:
            raise ValueError("calibration played no speculative round: raise --calibration_tokens")
    return played


def _hybrid_round(t: TreeConfig, a: int, chain: list[int], truth: list[int], kids: list[list[int]],
                  tokens: list[int], kept: list[bool]) -> Played:
    """The round ``t`` plays at one root: the head's ``a`` accepted among its kept nodes, and for a hybrid the
    lookup continuation ``chain`` checked against the greedy continuation ``truth`` (``tree.add_branch``'s merge
    over the kept nodes, ``kids``/``tokens`` of the big tree)."""
    if not chain:
        return Played(a, t.num_nodes, True)
    matched = 0
    while matched < min(len(chain), len(truth)) and chain[matched] == truth[matched]:
        matched += 1
    if t.lookup_mode == "switch":
        return Played(matched, len(chain), False)
    row, shared = 0, 0
    for token in chain:
        nxt = next((c for c in kids[row] if kept[c] and tokens[c] == token), None)
        if nxt is None:
            break
        row, shared = nxt + 1, shared + 1
    return Played(max(a, matched), t.num_nodes + len(chain) - shared, True)


def calibrate_tau(
    drafter: Eagle3TreeDrafter,
    target: TargetSession,
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    topologies: list[TreeConfig],
    naming: Naming | None = None,
) -> dict[TreeConfig, float]:
    """{topology: tau} from :func:`calibrate_rounds` (same arguments and errors)."""
    rounds = calibrate_rounds(drafter, target, sequences, topologies, naming)
    return {t: acceptance_length([p.accepted for p in acc]) for t, acc in rounds.items()}


def monotone(table: dict[int, float]) -> dict[int, float]:
    """The least-squares nondecreasing fit of a cost table (isotonic regression by pool-adjacent-violators).

    Adjacent entries (in key order) that decrease are pooled into their mean until the sequence is
    nondecreasing, e.g. {1: 61, 2: 109, 4: 101, 5: 91} -> {1: 61, 2: 100.33, 4: 100.33, 5: 100.33}.
    Source: Barlow et al., *Statistical Inference under Order Restrictions* (1972); the same fit as
    ``sklearn.isotonic.IsotonicRegression`` with equal weights.

    Args:
        table: {n: seconds}, any nonempty mapping with sortable keys.

    Returns:
        {n: seconds} with the same keys, nondecreasing in n.
    """
    blocks: list[list[float]] = []  # [sum, count] per pooled block
    for key in sorted(table):
        blocks.append([table[key], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [total / count for total, count in blocks for _ in range(count)]
    return dict(zip(sorted(table), values))


def fastest(fns: dict, repeats: int, device: torch.device | str | None = None) -> dict:
    """{key: the fastest of ``repeats`` timed calls of ``fns[key]()``, in seconds}, the calls interleaved.

    On a CUDA ``device`` each call is timed between two synchronisations (``precision.synchronize``): its kernels
    run asynchronously, so the clock alone would time their launch.

    Round r calls every function once, in order, before round r + 1, so a slow spell of the machine lands on
    all entries of a round alike instead of on whole entries. The minimum, not the median: interference (other
    processes, a kernel's first call at a new shape) only ever adds time, so the minimum is the estimate it
    disturbs least (as ``timeit`` advises). With the median of 5 timed back to back, one disturbed entry
    (2 verified rows at 84 ms against 52 ms in the real rounds, bf16, session 5) made the cost model choose
    plain decoding over a chain that measured 1.18x.
    """
    best = {key: float("inf") for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


@torch.no_grad()
def measure_costs(
    target: TargetSession,
    drafter: Eagle3TreeDrafter,
    prompt_ids: torch.Tensor,
    rows: list[int],
    widths: list[int],
    repeats: int = 5,
) -> CostTable:
    """Time the target verify for each row count and the head passes for each frontier width.

    Args:
        target: the target session (reset and left with the prompt cached).
        drafter: the tree drafter of the head.
        prompt_ids: (n,) int64, n >= 3; the context the forwards extend.
        rows: target rows per forward to time (1 is always added).
        widths: frontier widths to time (1 is always added).
        repeats: timings per entry, interleaved across entries (the fastest is kept, :func:`fastest`); one
            untimed warm-up each.

    Returns:
        :class:`CostTable` with the verify timings as measured and ``step`` their :func:`monotone` fit; the raw
        timings of both also in ``measured``.

    Raises:
        ValueError: if the prompt has fewer than 3 tokens or repeats < 1.
    """
    n = prompt_ids.shape[0]
    if n < 3 or repeats < 1:
        raise ValueError(f"measure_costs needs a prompt of >= 3 tokens and repeats >= 1, got {n}, {repeats}")
    target.reset()
    target.pad_rows = {}  # time each row count as itself
    _, aux = target.forward(prompt_ids, logits_to_keep=1)

    def verify_run(r: int):
        ids = prompt_ids.repeat(r // n + 1)[:r]

        def run():
            target.forward(ids)
            target.crop(n)

        run()  # warm-up
        return run

    dev = prompt_ids.device
    verify = fastest({r: verify_run(r) for r in sorted({1, *rows})}, repeats, dev)
    seq = torch.cat([prompt_ids, prompt_ids[-1:]])
    drafter.reset(prompt_ids[:-2], aux[:-2])
    drafter.feed_pending(seq[:-2])  # n - 2 step-0 rows cached

    def first():
        drafter.cache.crop(n - 2)
        drafter.pending = aux[-2:]  # two pending rows: a round that accepted one draft
        return drafter.feed_pending(seq)

    first()
    t_first = fastest({"first": first}, repeats, dev)["first"]
    _, h = first()

    def step_run(w: int):
        ids = prompt_ids[:1].repeat(w)
        mask = torch.ones(w, n + w, dtype=torch.bool, device=prompt_ids.device)
        pos = torch.full((1, w), n, device=prompt_ids.device)

        def run():
            drafter.head(ids[None], h.expand(1, w, h.shape[-1]), pos, drafter.cache, attn_mask=mask)
            drafter.cache.crop(n)

        run()  # warm-up
        return run

    step = fastest({w: step_run(w) for w in sorted({1, *widths})}, repeats, dev)
    target.reset()
    return CostTable(verify, t_first, monotone(step), measured={"verify": verify, "step": step})


def greedy_sequences(
    target: TargetSession, prompts: list[torch.Tensor], tokens: int, eos_token_ids: tuple[int, ...] = (),
    naming: Naming | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt (n,), plain greedy continuation of up to ``tokens`` tokens) per prompt, for :func:`calibrate_tau`.

    Raises:
        NonFiniteLogitsError: (a ValueError) on NaN/inf target logits, through ``naming`` (:data:`Naming`)
            when given.
    """
    cfg = DecodeConfig(max_new_tokens=tokens, eos_token_ids=eos_token_ids)
    out = []
    for i, p in enumerate(prompts):
        with _named(naming, i):
            cont = generate_plain(target, p, cfg).tokens
        out.append((p, torch.tensor(cont, dtype=torch.long, device=p.device)))
    return out
