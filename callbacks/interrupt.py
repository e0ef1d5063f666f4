"""InterruptCheckpoint: the state of a stopped training run, written once, for ``fit --ckpt_path`` to resume.

Lightning's ``OnExceptionCheckpoint`` writes on any exception in any stage and deletes its file at every clean
teardown. Run beside a stopped training run's recipe, that loses the run: ``draftkit validate`` with the same
recipe deleted the file on success, and an error raised before the head exists (a bad ``data.*`` option) made
the write itself fail, hiding the real error under an ``AttributeError``. Its mere presence also makes Lightning
turn ``fit(ckpt_path=None)`` into ``"last"``: the same ``fit`` command run again *without* ``--ckpt_path``
silently restored the stopped state, past draftkit's resume-option check (changed options then trained on from
the restored step). So this callback is not an ``OnExceptionCheckpoint``: it acts only inside ``fit`` once
training has started (an error before that leaves nothing to resume), removes the file only when a ``fit`` ends
cleanly (its ``last.ckpt`` then supersedes it), and a ``fit`` resumes from it only through ``--ckpt_path``
(``draftkit.fit_run`` refuses a fresh ``fit`` while the file holds a stopped run's state, printing the command that
resumes it).
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from draftkit.models.guards import head_is_finite

__all__ = ["InterruptCheckpoint"]


class InterruptCheckpoint(Callback):
    """Writes ``<dirpath>/<filename>.ckpt`` when a ``fit`` that has started training stops on an exception
    (SIGTERM, Ctrl-C as fit turns it into SIGTERM, an error), and deletes it when a ``fit`` ends cleanly;
    ``validate``/``test``/``predict`` and errors raised during set-up leave an existing file alone. Nothing is
    written from NaN/inf weights, nor from a stop inside an optimizer update (a second Ctrl-C, which interrupts at
    once). Resume with ``fit ... --ckpt_path <dirpath>/<filename>.ckpt``.

    Args:
        dirpath: directory of the checkpoint (created on write); None (the default): ``interrupted/`` below the
            trainer's ``default_root_dir``, so that runs with their own root (an ablation's arms, two experiments)
            never share, overwrite or block each other's stopped state.
        filename: file name without ``.ckpt`` (default ``on_exception``).

    Raises:
        ValueError: ``filename`` is empty.
    """

    FILE_EXTENSION = ".ckpt"
    STOPPED_STATE = True
    """Marks a writer of a stopped run's state for ``draftkit.fit_run`` (which may not import ``draftkit.callbacks``):
    it reports :attr:`ckpt_path` when :attr:`written`, and refuses a fresh ``fit`` that would overwrite it."""

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError("InterruptCheckpoint: filename cannot be empty")
        self.dirpath = dirpath
        self._folder = dirpath
        """The folder of :attr:`ckpt_path`: ``dirpath``, or the bound trainer's ``<default_root_dir>/interrupted``."""
        self.filename = filename
        self.written = False
        """Whether this run wrote :attr:`ckpt_path` (read by ``draftkit.fit_run`` to report an interrupted fit)."""
        self._started = False
        self._updating: int | None = None
        """The weights' versions before the update of the step in flight (None between steps)."""

    def bind_trainer(self, trainer) -> None:
        """Resolve a ``dirpath`` of None to ``<trainer.default_root_dir>/interrupted`` (at ``setup``, and by
        ``draftkit.fit_run`` before a fit starts, to find a stopped run's state); each trainer the callback
        serves in turn gets its own root's folder (``dirpath`` itself is kept as given)."""
        self._folder = self.dirpath if self.dirpath is not None else os.path.join(trainer.default_root_dir,
                                                                                  "interrupted")

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.bind_trainer(trainer)

    @property
    def ckpt_path(self) -> str:
        """``<dirpath>/<filename>.ckpt``.

        Raises:
            RuntimeError: a ``dirpath`` of None before the callback knows its trainer (:meth:`bind_trainer`).
        """
        if self._folder is None:
            raise RuntimeError("InterruptCheckpoint(dirpath=None) resolves its folder from the trainer's "
                               "default_root_dir at setup: bind_trainer(trainer) first")
        return os.path.join(self._folder, self.filename + self.FILE_EXTENSION)

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = True

    @staticmethod
    def _versions(pl_module) -> int:
        """The sum of the trainable parameters' in-place version counters: it changes when an update writes them."""
        return sum(p._version for p in pl_module.parameters() if p.requires_grad)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._updating = self._versions(pl_module)  # from the update to the batch's end: ahead of the step counter

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._updating = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Write the checkpoint, unless the stop came before training, inside an optimizer update, or the weights
        hold NaN/inf. An exception raised inside the update (a second Ctrl-C, which interrupts at once, or an
        error in the optimizer) can leave the weights part-updated or one update ahead of ``global_step``, a state
        that resumes into another run than the one stopped; a checkpoint of non-finite weights would resume into
        garbage. Both are skipped with a warning and the original error is left to surface (the module's
        ``on_save_checkpoint`` would refuse non-finite weights anyway)."""
        if trainer.state.fn != TrainerFn.FITTING or not self._started:
            return
        ok = head_is_finite(pl_module.head) if hasattr(pl_module, "head") else all(
            bool(torch.isfinite(p).all()) for p in pl_module.parameters() if p.is_floating_point())
        if not ok:
            rank_zero_warn(f"InterruptCheckpoint: not writing {self.ckpt_path}: the weights hold NaN/inf")
            return
        if self._updating is not None and self._versions(pl_module) != self._updating:
            rank_zero_warn(
                f"InterruptCheckpoint: not writing {self.ckpt_path}: the stop ({type(exception).__name__}) came "
                f"inside the optimizer update of step {trainer.global_step + 1}, whose weights may be part-updated; "
                "resume from the latest periodic checkpoint (a single Ctrl-C stops at the next step boundary and "
                "writes this file)"
            )
            return
        trainer.save_checkpoint(self.ckpt_path)
        self.written = True

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self._started:  # Lightning calls teardown hooks only after a clean fit
            trainer.strategy.remove_checkpoint(self.ckpt_path)
