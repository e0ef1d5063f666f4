"""Speculative-decoding metrics: acceptance length tau, per-position acceptance, acceptance rate, KL.

Definitions (eagle3-format.md §8):
- a round r drafts k_r tokens and accepts the longest matching prefix a_r in {0..k_r}; it emits a_r + 1
  tokens (accepted drafts plus the target's correction or bonus token);
- tau = mean over all rounds of (a_r + 1), the bonus token counted (SafeAILab/EAGLE #132, #195);
- unconditional per-position acceptance alpha_i = fraction of rounds with a_r >= i (i = 1..k), so that a
  chain has tau = 1 + sum_i alpha_i; conditional beta_i = alpha_i / alpha_{i-1};
- chain acceptance alpha_i given proposal (:func:`chain_acceptance`) = P(draft i accepted | drafts 1..i-1
  accepted and draft i proposed): unlike beta_i it leaves out of position i the rounds that drafted fewer
  than i tokens (near the token limit, or after a drafted EOS); equal to beta_i when every round drafts k;
- acceptance rate = accepted drafts / drafted tokens (prefixes only, never matches after the first
  rejection; vllm #9565);
- distribution metrics at draft position i (:func:`distribution_metrics`), all at temperature 1 (no top-k or
  top-p) in float32, with p = softmax(z) the target's distribution over the full vocab V and q the draft's,
  zero outside its V_d ids:
  - ``kl``: KL(P_d || Q) in nats, *renormalised on the draft vocab*: P_d = softmax(z[t2d]) (the target's
    mass on the V_d draft ids, rescaled to sum to 1) against Q = softmax(draft logits). It does not see
    the target mass outside the draft vocab, so it is reported beside
  - ``outside_mass``: 1 - sum_{v in draft vocab} p_v, the target's probability on ids the draft can never
    propose, and
  - ``expected_accept``: sum_v min(p_v, q_v) = 1 - TV(p, q) over the full vocab, the probability that
    speculative sampling accepts a draft token drawn from q at that context (arXiv 2211.17192, Thm 3.5).
    At T = 1 its mean over verified positions estimates the measured acceptance rate; at i > 1 it is
    averaged over every drafted position, including those after a rejection;
- drafter share (:meth:`AcceptanceStats.share`, hybrid rounds of head and prompt lookup): a round is ``head``,
  ``lookup`` or ``both`` by which drafters proposed its verified drafts, an accepted draft token by which
  proposed it (``both``: the two proposed the same token at the same place); the report gives each kind's
  fraction of rounds, of accepted draft tokens, and its tau.

Shapes: k draft tokens per round, V target vocab, V_d draft vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "AcceptanceStats",
    "HEAD",
    "LOOKUP",
    "SOURCE_NAMES",
    "acceptance_length",
    "acceptance_per_position",
    "acceptance_rate",
    "accepted_prefix",
    "chain_acceptance",
    "conditional_acceptance",
    "distribution_metrics",
    "kl_from_logits",
    "kl_target_draft",
    "DISTRIBUTION_METRICS",
    "KL_DEFINITION",
]

DISTRIBUTION_METRICS = ("kl", "outside_mass", "expected_accept")
"""Names of the per-position metrics of :func:`distribution_metrics`, in report order; a report carries each as
``{name}_per_position`` and TensorBoard and the callbacks as ``{name}_pos{i}``."""
KL_DEFINITION = (
    "KL(P_d || Q) in nats at temperature 1 over the draft vocab only: P_d = the target's softmax restricted to the "
    "V_d draft ids and renormalised to sum to 1, Q = the draft's softmax; it ignores the target mass outside the "
    "draft vocab, which outside_mass_per_position reports"
)
"""What a report's ``kl_per_position`` is, stated in the report itself."""


HEAD, LOOKUP = 1, 2
"""Bit masks of the drafters of a hybrid round (``decoding.tree.DraftTree.sources``)."""
SOURCE_NAMES = {HEAD: "head", LOOKUP: "lookup", HEAD | LOOKUP: "both"}
"""Report names of the source masks."""


def accepted_prefix(matches: Sequence[int] | torch.Tensor) -> int:
    """Length of the leading run of matches in one round's match vector, e.g. [1, 1, 0, 1] -> 2."""
    n = 0
    for m in (matches.tolist() if isinstance(matches, torch.Tensor) else matches):
        if not m:
            break
        n += 1
    return n


def acceptance_length(accepted: Sequence[int]) -> float:
    """tau = mean over rounds of (a_r + 1).

    Args:
        accepted: a_r per round (accepted draft tokens, bonus excluded).

    Raises:
        ValueError: if there is no round.
    """
    if len(accepted) == 0:
        raise ValueError("acceptance length needs at least one verification round")
    return sum(a + 1 for a in accepted) / len(accepted)


def acceptance_per_position(accepted: Sequence[int], k: int) -> list[float]:
    """Unconditional alpha_i = fraction of rounds with a_r >= i, for i = 1..k.

    Raises:
        ValueError: if there is no round or k < 1.
    """
    if len(accepted) == 0 or k < 1:
        raise ValueError(f"per-position acceptance needs rounds and k >= 1, got {len(accepted)} rounds, k={k}")
    return [sum(a >= i for a in accepted) / len(accepted) for i in range(1, k + 1)]


def conditional_acceptance(alpha: Sequence[float]) -> list[float]:
    """Conditional beta_i = alpha_i / alpha_{i-1} (alpha_0 = 1); 0 where alpha_{i-1} = 0."""
    prev = [1.0, *alpha[:-1]]
    return [a / p if p > 0 else 0.0 for a, p in zip(alpha, prev)]


def chain_acceptance(accepted: Sequence[int], drafted: Sequence[int], k: int) -> list[float | None]:
    """alpha_i = P(draft i accepted | drafts 1..i-1 accepted and draft i proposed), i = 1..k.

    Args:
        accepted: a_r per round.
        drafted: k_r per round (k_r <= k).
        k: positions reported.

    Returns:
        k rates; None at a position no round reached.
    """
    reached, hits = [0] * k, [0] * k
    for acc, n in zip(accepted, drafted):
        for i in range(min(n, acc + 1)):
            reached[i] += 1
            hits[i] += int(i < acc)
    return [hits[i] / reached[i] if reached[i] else None for i in range(k)]


def acceptance_rate(accepted: Sequence[int], drafted: int | Sequence[int]) -> float:
    """Accepted draft tokens / drafted tokens.

    Args:
        accepted: a_r per round.
        drafted: k (every round drafted k tokens) or k_r per round.

    Returns:
        The rate in [0, 1]; 0 when nothing was drafted.
    """
    total = drafted * len(accepted) if isinstance(drafted, int) else sum(drafted)
    return sum(accepted) / total if total else 0.0


def kl_from_logits(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """(n, V), (n, V) -> (n,) KL(P || Q) = sum_v p (log p - log q) per row in nats, fp32 log_softmax over the
    given vocab (the full target vocab for dual precision's KL(high || method); the draft vocab in
    :func:`kl_target_draft`)."""
    log_p = p_logits.float().log_softmax(-1)  # (n, V)
    log_q = q_logits.float().log_softmax(-1)  # (n, V)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def kl_target_draft(target_logits: torch.Tensor, draft_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row over the draft vocab, in nats.

    Args:
        target_logits: (k, V) target logits at the rows whose next token the draft predicted.
        draft_logits: (k, V_d) draft logits at the same rows.
        t2d: (V,) bool, True for the V_d target ids in the draft vocab (sorted, so boolean indexing yields
            draft order).

    Returns:
        (k,) float32 KL per draft position.
    """
    return kl_from_logits(target_logits[:, t2d], draft_logits)  # (k,), target renormalised on V_d


def distribution_metrics(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, t2d: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per draft position: KL on the draft vocab, target mass outside it, and expected acceptance (module
    docstring), all at temperature 1.

    Args:
        target_logits: (k, V) target logits at the rows whose next token the draft predicted.
        draft_logits: (k, V_d) draft logits at the same rows.
        t2d: (V,) bool, True for the V_d target ids in the draft vocab (draft order = ascending target id).

    Returns:
        ``{"kl", "outside_mass", "expected_accept"}``: (k,) float32 each; KL in nats, the others in [0, 1].
    """
    p_draft_ids = target_logits.float().softmax(-1)[:, t2d]  # (k, V_d), target probs, not renormalised
    q = draft_logits.float().softmax(-1)  # (k, V_d); q is zero on the other V - V_d ids
    return {
        "kl": kl_target_draft(target_logits, draft_logits, t2d),
        "outside_mass": (1 - p_draft_ids.sum(-1)).clamp_min(0),
        "expected_accept": torch.minimum(p_draft_ids, q).sum(-1),
    }


class AcceptanceStats:
    """Accumulates verification rounds and reports tau, alpha_i, acceptance rate and the
    :data:`DISTRIBUTION_METRICS` per position.

    Args:
        k: longest acceptance per round (a chain's k, a tree's depth); the per-position lists have k entries.
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.accepted: list[int] = []
        self.drafted: list[int] = []
        # host-side report accumulators (whatever device decodes): one small copy per round in update()
        self._dist_sum = torch.zeros(len(DISTRIBUTION_METRICS), k, dtype=torch.float64, device="cpu")
        self._dist_count = torch.zeros(k, dtype=torch.long, device="cpu")
        self.round_sources: list[int] = []  # per round: HEAD | LOOKUP mask of its drafters, 0 = not recorded
        self.accepted_sources = [0] * 4  # accepted draft tokens per source mask

    def update(self, accepted: int, drafted: int, dist: dict[str, torch.Tensor] | None = None,
               sources: tuple[int, list[int]] | None = None) -> None:
        """Record one round.

        Args:
            accepted: a_r in [0, min(drafted, k)].
            drafted: draft tokens verified: k_r <= k for a chain (prompt lookup may draft fewer, or none);
                a tree verifies N nodes, more than its depth k.
            dist: :func:`distribution_metrics` of this round ((k_r,) each), or None.
            sources: (mask of the drafters that proposed the round's drafts, mask per accepted draft (at least
                a_r of them; the first a_r count)), masks of :data:`HEAD` and :data:`LOOKUP`; None = not recorded.
        """
        if not 0 <= accepted <= min(drafted, self.k):
            raise ValueError(f"need 0 <= accepted <= drafted and accepted <= k={self.k}, got {accepted}, {drafted}")
        self.accepted.append(int(accepted))
        self.drafted.append(int(drafted))
        self.round_sources.append(0 if sources is None else int(sources[0]))
        if sources is not None:
            for mask in sources[1][:accepted]:
                self.accepted_sources[mask] += 1
        if dist is not None:
            n = dist["kl"].shape[0]
            self._dist_sum[:, :n] += torch.stack([dist[name].double().cpu() for name in DISTRIBUTION_METRICS])
            self._dist_count[:n] += 1

    def extend(self, other: AcceptanceStats) -> None:
        """Merge another accumulator (same k)."""
        if other.k != self.k:
            raise ValueError(f"cannot merge stats with k={other.k} into k={self.k}")
        self.accepted += other.accepted
        self.drafted += other.drafted
        self._dist_sum += other._dist_sum
        self._dist_count += other._dist_count
        self.round_sources += other.round_sources
        self.accepted_sources = [a + b for a, b in zip(self.accepted_sources, other.accepted_sources)]

    def share(self) -> dict | None:
        """Each drafter's share (module docstring) over the rounds that recorded their sources; None when none did.

        Returns:
            ``{"rounds": {name: fraction}, "accepted_tokens": {name: fraction or None}, "tau": {name: tau or
            None}, "round_counts": {name: int}, "accepted_counts": {name: int}}`` over the names ``head``,
            ``lookup`` and ``both`` (:data:`SOURCE_NAMES`); a fraction of accepted tokens is None when no draft
            was accepted.
        """
        recorded = [(s, a) for s, a in zip(self.round_sources, self.accepted) if s]
        if not recorded:
            return None
        rounds = {name: [a for s, a in recorded if s == mask] for mask, name in SOURCE_NAMES.items()}
        tokens = {name: self.accepted_sources[mask] for mask, name in SOURCE_NAMES.items()}
        total = sum(tokens.values())
        return {
            "rounds": {name: len(acc) / len(recorded) for name, acc in rounds.items()},
            "accepted_tokens": {name: n / total if total else None for name, n in tokens.items()},
            "tau": {name: acceptance_length(acc) if acc else None for name, acc in rounds.items()},
            "round_counts": {name: len(acc) for name, acc in rounds.items()},
            "accepted_counts": tokens,
        }

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    def tau(self) -> float | None:
        """Mean tokens per round (bonus counted); None before the first round."""
        return acceptance_length(self.accepted) if self.accepted else None

    def tau_drafted(self) -> float | None:
        """tau over the rounds that drafted at least one token (how vLLM quotes n-gram acceptance)."""
        acc = [a for a, d in zip(self.accepted, self.drafted) if d > 0]
        return acceptance_length(acc) if acc else None

    def chain_acceptance(self) -> list[float | None]:
        """:func:`chain_acceptance` of the recorded rounds (None at positions no round reached)."""
        return chain_acceptance(self.accepted, self.drafted, self.k)

    def per_position(self) -> list[float] | None:
        return acceptance_per_position(self.accepted, self.k) if self.accepted else None

    def rate(self) -> float | None:
        return acceptance_rate(self.accepted, self.drafted) if self.accepted else None

    def per_position_mean(self, name: str) -> list[float | None] | None:
        """Mean of one of :data:`DISTRIBUTION_METRICS` at each draft position; None where no round reported one,
        and None overall before the first report."""
        if not int(self._dist_count.sum()):
            return None
        row = self._dist_sum[DISTRIBUTION_METRICS.index(name)]
        return [float(s / c) if c else None for s, c in zip(row, self._dist_count)]

    def kl_per_position(self) -> list[float | None] | None:
        """Mean KL(P_d || Q) on the draft vocab (target renormalised over it) at each draft position."""
        return self.per_position_mean("kl")
