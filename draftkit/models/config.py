"""The training module's config groups: one dataclass per component of ``Eagle3Module``'s signature
(``model.ttt``, ``model.optim``, ``model.entropy_filter``), each field's docstring its ``--help``, each checked in
``__post_init__``.

Shapes: none (configuration).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EntropyFilterConfig", "OptimConfig", "TTTConfig"]


@dataclass
class TTTConfig:
    """Training-time test."""

    steps: int = 7
    """K, draft steps unrolled per training step."""
    decay: float = 0.8
    """Weight of step k is decay**k."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"model.ttt.steps must be >= 1, got {self.steps}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"model.ttt.decay must be in (0, 1], got {self.decay}")


@dataclass
class OptimConfig:
    """AdamW (or Muon on the hidden matrices) with linear warmup and cosine decay (per optimizer step)."""

    lr: float = 1e-4
    """Peak learning rate."""
    optimizer: str = "adamw"
    """``adamw``, or ``muon``: Muon on ``fc`` and the decoder layer's matrices, AdamW on norms and ``lm_head``,
    one lr (``draftkit.models.muon``)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    """Optimizer steps of linear warmup from 0 (at most half the schedule's horizon)."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"bad model.optim {self}: need lr > 0, warmup_steps >= 0, 0 <= min_lr_ratio <= 1")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"model.optim.optimizer must be adamw or muon, got {self.optimizer!r}")

    def build(self, head: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer of ``head``'s trainable parameters (a frozen ``lm_head`` left out): AdamW, or Muon on the
        hidden matrices with AdamW on the rest (``draftkit.models.muon``)."""
        if self.optimizer == "muon":
            from draftkit.models.muon import MuonWithAdamW, split_muon_params

            return MuonWithAdamW(*split_muon_params(head), lr=self.lr, weight_decay=self.weight_decay,
                                 betas=tuple(self.betas))
        params = [p for p in head.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, betas=tuple(self.betas))


@dataclass
class EntropyFilterConfig:
    """Token prediction-entropy filter on the loss (first source document: "filter low-entropy tokens").

    Positions whose target next-token entropy (nats) is below the threshold are dropped or down-weighted,
    after the assistant mask. Off by default (see the recipe for the ablation).
    """

    mode: str = "off"
    """``off``, ``drop`` or ``downweight``."""
    threshold: float | None = None
    """Absolute entropy threshold in nats."""
    quantile: float | None = None
    """Or: drop the lowest quantile of supervised positions in each batch."""
    downweight: float = 0.1
    """Weight given to low-entropy positions in ``downweight`` mode."""

    def __post_init__(self) -> None:
        if self.mode not in ("off", "drop", "downweight"):
            raise ValueError(f"model.entropy_filter.mode must be off, drop or downweight, got {self.mode!r}")
        if self.mode != "off" and (self.threshold is None) == (self.quantile is None):
            raise ValueError("model.entropy_filter: give exactly one of threshold or quantile")
