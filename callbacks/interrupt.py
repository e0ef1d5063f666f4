"""InterruptCheckpoint: the state of a stopped training run, written once, for ``fit --ckpt_path`` to resume.

Lightning's ``OnExceptionCheckpoint`` writes on any exception in any stage and deletes its file at every clean
teardown. Run beside a stopped training run's recipe, that loses the run: ``draftkit validate`` with the same
recipe deleted the file on success, and an error raised before the head exists (a bad ``data.*`` option) made
the write itself fail, hiding the real error under an ``AttributeError``. This subclass acts only inside
``fit`` once training has started (an error before that leaves nothing to resume) and removes the file only
when a ``fit`` ends cleanly (its ``last.ckpt`` then supersedes it).
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.trainer.states import TrainerFn

__all__ = ["InterruptCheckpoint"]


class InterruptCheckpoint(OnExceptionCheckpoint):
    """``OnExceptionCheckpoint`` for training only: writes ``<dirpath>/<filename>.ckpt`` when a ``fit`` that has
    started training stops on an exception (SIGTERM, Ctrl-C as fit turns it into SIGTERM, an error), and
    deletes it when a ``fit`` ends cleanly; ``validate``/``test``/``predict`` and errors raised during set-up
    leave an existing file alone. Nothing is written from NaN/inf weights.

    Args:
        dirpath: directory of the checkpoint (created on write).
        filename: file name without ``.ckpt`` (default ``on_exception``).

    Raises:
        ValueError: ``filename`` is empty (Lightning's check).
    """

    _started = False

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = True

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Write the checkpoint, unless the stop came before training or the weights hold NaN/inf: a checkpoint
        of non-finite weights would resume into garbage, so it is skipped with a warning and the original
        error is left to surface (the module's ``on_save_checkpoint`` would refuse it anyway)."""
        if trainer.state.fn != TrainerFn.FITTING or not self._started:
            return
        finite = getattr(pl_module, "head_is_finite", None)
        ok = finite() if finite is not None else all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()
                                                      if p.is_floating_point())
        if not ok:
            rank_zero_warn(f"InterruptCheckpoint: not writing {self.ckpt_path}: the weights hold NaN/inf")
            return
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self._started:
            super().teardown(trainer, pl_module, stage)
