"""Speculative-decoding metrics: acceptance length tau, per-position acceptance, acceptance rate, KL.

Definitions (eagle3-format.md §8):
- a round r drafts k_r tokens and accepts the longest matching prefix a_r in {0..k_r}; it emits a_r + 1
  tokens (accepted drafts plus the target's correction or bonus token);
- tau = mean over all rounds of (a_r + 1), the bonus token counted (SafeAILab/EAGLE #132, #195);
- unconditional per-position acceptance alpha_i = fraction of rounds with a_r >= i (i = 1..k), so that a
  chain has tau = 1 + sum_i alpha_i; conditional beta_i = alpha_i / alpha_{i-1};
- acceptance rate = accepted drafts / drafted tokens (prefixes only, never matches after the first
  rejection; vllm #9565);
- KL(target || draft) at draft position i over the draft vocab: P = softmax(z[t2d]) of the target logits
  restricted to the V_d draft ids, Q = softmax(draft logits), both at temperature 1 in float32.

Shapes: k draft tokens per round, V target vocab, V_d draft vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "AcceptanceStats",
    "acceptance_length",
    "acceptance_per_position",
    "acceptance_rate",
    "accepted_prefix",
    "conditional_acceptance",
    "kl_target_draft",
]


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
    log_p = target_logits[:, t2d].float().log_softmax(-1)  # (k, V_d)
    log_q = draft_logits.float().log_softmax(-1)  # (k, V_d)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class AcceptanceStats:
    """Accumulates verification rounds and reports tau, alpha_i, acceptance rate and KL per position.

    Args:
        k: longest acceptance per round (a chain's k, a tree's depth); the per-position lists have k entries.
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.accepted: list[int] = []
        self.drafted: list[int] = []
        self._kl_sum = torch.zeros(k, dtype=torch.float64)
        self._kl_count = torch.zeros(k, dtype=torch.long)

    def update(self, accepted: int, drafted: int, kl: torch.Tensor | None = None) -> None:
        """Record one round.

        Args:
            accepted: a_r in [0, min(drafted, k)].
            drafted: draft tokens verified: k_r <= k for a chain (prompt lookup may draft fewer, or none);
                a tree verifies N nodes, more than its depth k.
            kl: (k_r,) KL per draft position of this round, or None.
        """
        if not 0 <= accepted <= min(drafted, self.k):
            raise ValueError(f"need 0 <= accepted <= drafted and accepted <= k={self.k}, got {accepted}, {drafted}")
        self.accepted.append(int(accepted))
        self.drafted.append(int(drafted))
        if kl is not None:
            n = kl.shape[0]
            self._kl_sum[:n] += kl.double().cpu()
            self._kl_count[:n] += 1

    def extend(self, other: AcceptanceStats) -> None:
        """Merge another accumulator (same k)."""
        if other.k != self.k:
            raise ValueError(f"cannot merge stats with k={other.k} into k={self.k}")
        self.accepted += other.accepted
        self.drafted += other.drafted
        self._kl_sum += other._kl_sum
        self._kl_count += other._kl_count

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

    def per_position(self) -> list[float] | None:
        return acceptance_per_position(self.accepted, self.k) if self.accepted else None

    def rate(self) -> float | None:
        return acceptance_rate(self.accepted, self.drafted) if self.accepted else None

    def kl_per_position(self) -> list[float] | None:
        """Mean KL(target || draft) at each draft position, None where no round reported one."""
        if not int(self._kl_count.sum()):
            return None
        return [float(s / c) if c else None for s, c in zip(self._kl_sum, self._kl_count)]
