"""ProgressLog: plain progress lines for a ``fit`` whose output goes to a file.

Lightning's progress bar (Rich's when it is installed) draws nothing while its output is not a terminal: a fit run in
the background (``nohup``, a cluster job's log file) showed no sign of life between validations, 20 minutes apart in
the long recipes. ``DraftkitCLI`` adds this callback to every ``fit`` whose standard output is not a terminal; a
recipe may add it with another interval (``class_path: draftkit.fit_progress.ProgressLog``, ``init_args: {every_s: 300}``).
"""

from __future__ import annotations

import logging
import math
import time

from lightning.pytorch import Callback

__all__ = ["ProgressLog"]

log = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    """``"4 h 12 min"``, ``"7 min"``, ``"45 s"``."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    return f"{int(seconds // 60)} min" if seconds >= 60 else f"{int(seconds)} s"


class ProgressLog(Callback):
    """Log one line every ``every_s`` seconds of training (rank 0):
    ``step 512/3731 (13.7 %), train/loss 6.7200, 4.71 s/step, ETA 4 h 12 min``.

    The rate is measured over the optimizer steps since the previous line, less the time spent in validation
    between them; the ETA is the remaining steps at that rate (validation adds its own time). Without a step
    limit (``trainer.max_steps`` -1 and no finite estimate) the line has no total and no ETA.

    Args:
        every_s: seconds between lines (0 = a line at every optimizer step after the first).
    """

    def __init__(self, every_s: float = 60.0) -> None:
        if every_s < 0:
            raise ValueError(f"ProgressLog every_s must be >= 0 seconds, got {every_s}")
        self.every_s = every_s
        self._mark: tuple[float, int] | None = None  # (time, optimizer step) of the previous line
        self._val_s = 0.0  # validation seconds since the mark
        self._val_start: float | None = None

    @staticmethod
    def _total(trainer) -> int | None:
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        estimate = trainer.estimated_stepping_batches
        return int(estimate) if math.isfinite(estimate) else None

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_start is not None:
            self._val_s += time.monotonic() - self._val_start
            self._val_start = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        now, step = time.monotonic(), trainer.global_step
        if self._mark is None:  # the first step carries set-up costs: the rate starts after it
            self._mark, self._val_s = (now, step), 0.0
            return
        since, at = self._mark
        if step <= at or now - since < self.every_s:
            return
        rate = max(0.0, now - since - self._val_s) / (step - at)  # seconds per optimizer step
        total = self._total(trainer)
        parts = [f"step {step}/{total} ({100 * step / total:.1f} %)" if total else f"step {step}"]
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            parts.append(f"train/loss {float(loss):.4f}")
        parts.append(f"{rate:.2f} s/step")
        if total:
            parts.append(f"ETA {_duration(max(0, total - step) * rate)}")
        log.info(", ".join(parts))
        self._mark, self._val_s = (now, step), 0.0
