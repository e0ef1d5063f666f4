"""A callback for the 2-process tests: records each optimizer step's local loss and the head's (all-reduced)
gradients, the target's resident bytes on this rank and the acceptance monitor's (step, tau) history, into ``<out>/rank<r>.pt`` at the end of ``fit``."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Callback

from draftkit.target.sharding import resident_bytes


class StepRecorder(Callback):
    """Args:
        out: directory the per-rank records go to (created).
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.target_bytes = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.target_bytes = resident_bytes(pl_module.target)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({k: p.grad.detach().clone() for k, p in pl_module.head.named_parameters()
                           if p.grad is not None})

    def on_train_end(self, trainer, pl_module) -> None:
        Path(self.out).mkdir(parents=True, exist_ok=True)
        monitors = [cb for cb in trainer.callbacks if hasattr(cb, "history") and hasattr(cb, "last_report")]
        torch.save({"losses": self.losses, "grads": self.grads, "target_bytes": self.target_bytes,
                    "accept_len": list(monitors[0].history) if monitors else None},
                   Path(self.out) / f"rank{trainer.global_rank}.pt")
