"""Escalation gates: scores of the 4-bit softmax and the :class:`Gate` that compares them to a threshold.

Definitions: docs/dual-precision.md §4. Both scores belong to the softmax-confidence family of
CALM (arXiv 2207.07061) and BiLD (arXiv 2302.07863); higher = more uncertain = escalate.

- entropy: H(p_lo) in nats, fp32 over the full vocabulary (``draftkit.analysis.token_entropy``)
- margin: -(p_(1) - p_(2)), the negated gap between the two largest probabilities

Shapes: V target vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftkit.analysis.token_entropy import token_entropy

__all__ = ["GATES", "Gate", "gate_scores", "top2_margin"]

GATES = ("entropy", "margin")
"""Gate kinds; their scores are H(p_lo) and -margin(p_lo), higher = more uncertain."""


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...,) p_(1) - p_(2), the gap between the two largest softmax probabilities (fp32)."""
    top2 = F.softmax(logits.float(), dim=-1).topk(2, dim=-1).values  # (..., 2)
    return top2[..., 0] - top2[..., 1]


def gate_scores(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """(..., V) low-precision logits -> {"entropy": H, "margin": -margin}, each (...,); higher = escalate."""
    return {"entropy": token_entropy(logits), "margin": -top2_margin(logits)}


@dataclass(frozen=True)
class Gate:
    """An escalation gate: escalate a step when its score exceeds ``threshold``.

    Attributes:
        kind: ``entropy`` (score H(p_lo), nats) or ``margin`` (score -(p_(1) - p_(2))).
        threshold: tau on the score scale. For the margin gate this is -tau_m: the step escalates when the
            margin is below tau_m = -threshold.
    """

    kind: str
    threshold: float

    def __post_init__(self) -> None:
        if self.kind not in GATES:
            raise ValueError(f"unknown gate {self.kind!r}; choose one of {GATES}")

    @classmethod
    def from_natural(cls, kind: str, value: float) -> "Gate":
        """Gate from a threshold in natural units: entropy tau_H in nats, or margin tau_m in [0, 1]."""
        return cls(kind, float(value) if kind == "entropy" else -float(value))

    @property
    def natural_threshold(self) -> float:
        """tau_H (nats) for entropy, tau_m (probability gap) for margin."""
        return self.threshold if self.kind == "entropy" else -self.threshold

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) low-precision logits -> (...,) score."""
        return token_entropy(logits) if self.kind == "entropy" else -top2_margin(logits)
