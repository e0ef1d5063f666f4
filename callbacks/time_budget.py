"""TimeBudget: fit the learning-rate schedule to a wall-time budget, set-up included, and re-plan it.

The budget is Lightning's own ``trainer.max_time``. Lightning's ``Timer`` counts it from the start of training
and stops wherever the run happens to be; this callback instead plans the run so that it ends *finished*
within the budget counted from process start (model load and tokenization count), on a slow machine and a
fast one alike:

1. Validation cost: the sanity-check validation is timed, giving seconds per validation batch.
2. Training cost: after ``skip_steps`` optimizer steps (lazy initialisation), ``measure_steps`` steps are
   timed, giving s/step (time spent in validations inside the window is left out).
3. Horizon: with g steps done, E seconds elapsed since process start, budget B, V seconds per validation
   (batch time x validation batches) every ``val_check_batch`` steps and ``margin_s`` for checkpoint writes
   and teardown, the run takes H = g + floor((B - E - V - margin_s) / (s + V / val_check_batch)) optimizer
   steps in all (capped by ``trainer.max_steps`` when that is set). H goes to the module's
   :meth:`set_lr_horizon`, so the cosine schedule reaches its floor exactly at step H.
4. Re-plan: at the end of every later validation (not the sanity check, not the final one), once
   ``measure_steps`` steps have run since the last plan, s is re-measured over those steps (validation time
   left out), V is the validation just timed, and step 3 runs again. Costs measured once drift (a machine that
   frees up or gets busier); re-planning keeps the schedule's end on the budget. The module keeps the LR
   continuous: the cosine progress p, linear in the step, is anchored at the re-plan step a,
   p(s) = p_a + (1 - p_a) (s - a) / (H - a), so the LR at step a is unchanged and reaches the floor at the
   new H (``Eagle3Module.lr_factor``). The plan (H and the anchor) is checkpointed with the module, so a
   resumed run reproduces the same LRs. A resumed run counts the earlier runs' training time (Lightning's
   ``Timer`` restores it from the checkpoint) as spent, E = that time + seconds since its own process start,
   and times its steps from its first one: it re-plans at its validations like the first run, so a machine
   faster or slower than the first one's still ends the schedule inside the budget (the last plan alone would
   leave the LR above its floor when ``Timer`` stops the run, or end it early).
5. At step H the callback sets ``trainer.should_stop``: Lightning then runs a final validation and
   ``ModelCheckpoint`` writes the best and last checkpoints. Should the steps turn out slower than measured,
   the run also stops once E + V + margin_s + the last step's seconds reaches B: the next step is not started
   when it could not finish inside the budget, however long one step takes (schedule not finished, the budget
   kept).

Keep ``measure_steps + skip_steps`` within the schedule's warmup: until H is known the schedule warms up
(or holds its peak).

Shapes: none (wall time only).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

__all__ = ["TimeBudget", "process_seconds"]

log = logging.getLogger(__name__)


def process_seconds() -> float:
    """Seconds since this process started (Linux ``/proc``; elsewhere 0.0, i.e. counted from the call).

    Raises:
        nothing: unreadable ``/proc`` gives 0.0.
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class TimeBudget(Callback):
    """Ends training within ``trainer.max_time`` counted from process start, with a finished schedule.

    Args:
        measure_steps: optimizer steps timed for s/step, and the fewest steps between a plan and a re-plan.
        skip_steps: first optimizer steps not timed (lazy initialisation, allocator warm-up).
        margin_s: seconds kept free for checkpoint writes and teardown.
        clock: monotonic seconds (injectable for tests).
        started_at: ``clock()`` value at process start; None = now minus :func:`process_seconds`.

    Raises:
        ValueError: if measure_steps < 1, skip_steps < 0 or margin_s < 0.
        RuntimeError: (at fit start) if the module has no ``lr_horizon`` attribute or ``set_lr_horizon`` method.
    """

    def __init__(
        self,
        measure_steps: int = 10,
        skip_steps: int = 2,
        margin_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        started_at: float | None = None,
    ) -> None:
        if measure_steps < 1 or skip_steps < 0 or margin_s < 0:
            raise ValueError(
                f"TimeBudget needs measure_steps >= 1, skip_steps >= 0, margin_s >= 0; got {measure_steps}, "
                f"{skip_steps}, {margin_s}"
            )
        self.measure_steps, self.skip_steps, self.margin_s = measure_steps, skip_steps, margin_s
        self.clock = clock
        self.started_at = clock() - process_seconds() if started_at is None else started_at
        self.budget_s: float | None = None
        self.spent_before = 0.0
        """Training seconds of the runs this one resumes (the restored ``Timer``'s count); 0.0 for a new run."""
        self.step_s: float | None = None
        """Last measured seconds per optimizer step, validation left out; None = no plan made in this run."""
        self.val_batch_s: float | None = None
        """Last measured seconds per validation batch."""
        self.horizon: int | None = None
        self.replans = 0
        """Re-plans that moved the horizon."""
        self._window: tuple[int, float] | None = None  # (step, clock) where the s/step window starts
        self._window_val_s = 0.0  # validation seconds inside the window
        self._val_started: float | None = None
        self._val_batches = 0
        self._val_total_s = 0.0  # validation seconds of this run, all validations
        self._last_end: tuple[float, float] | None = None  # (clock, _val_total_s) at the last step's end
        self.last_step_s = 0.0
        """Seconds the last optimizer step took (validation left out): the cost of the next one."""

    def elapsed(self) -> float:
        """Seconds of the budget spent: since process start on ``clock``, plus ``spent_before``."""
        return self.clock() - self.started_at + self.spent_before

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not hasattr(pl_module, "lr_horizon") or not hasattr(pl_module, "set_lr_horizon"):
            raise RuntimeError(
                f"TimeBudget needs a module with an lr_horizon attribute and a set_lr_horizon method, got "
                f"{type(pl_module).__name__}"
            )
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        remaining = timer.time_remaining() if timer is not None else None
        # training has not started: time_elapsed() is the checkpoint's count (Timer restores it before this hook)
        self.spent_before = timer.time_elapsed() if timer is not None else 0.0
        self.budget_s = None if remaining is None else remaining + self.spent_before
        if self.budget_s is None:
            log.info("TimeBudget: trainer.max_time is not set; the schedule follows trainer.max_steps")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # skip_steps = 0: time from the first step on; resumed with its plan: from here, re-plan at validations
        if trainer.global_step == self.skip_steps or pl_module.lr_horizon is not None:
            self._start_window(trainer.global_step)
        self._last_end = (self.clock(), self._val_total_s)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_started = self.clock()
        self._val_batches = 0

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._val_batches += 1

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        seconds = self.clock() - self._val_started
        self._val_total_s += seconds
        if self._val_batches and (self.val_batch_s is None or not trainer.sanity_checking):
            self.val_batch_s = seconds / self._val_batches  # the sanity check first, then every real validation
        if trainer.sanity_checking or trainer.state.fn != "fit" or self.budget_s is None:
            return
        self._window_val_s += seconds
        # re-plan a plan (made in this run or resumed with the checkpoint), not at the final validation
        # (should_stop), and over enough steps; every condition is the same on every rank, so all of them reach
        # the broadcast
        window = self._window
        step = trainer.global_step
        if pl_module.lr_horizon is None or trainer.should_stop or window is None or step - window[0] < self.measure_steps:
            return
        self.step_s = self._measure(step)
        previous = pl_module.lr_horizon
        self.horizon = self.plan(trainer, step, previous)
        pl_module.set_lr_horizon(self.horizon, step)
        self._start_window(step)
        self.replans += self.horizon != previous
        if step >= self.horizon:  # nothing left: stop now, after this validation, instead of one step late
            trainer.should_stop = True

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if self.budget_s is None:
            return
        now = self.clock()
        if self._last_end is not None:
            self.last_step_s = now - self._last_end[0] - (self._val_total_s - self._last_end[1])
        self._last_end = (now, self._val_total_s)
        step = trainer.global_step
        if pl_module.lr_horizon is None:  # not planned yet (a resumed run brings its plan along)
            if step == self.skip_steps and self._window is None:
                self._start_window(step)
            elif self._window is not None and step >= self._window[0] + self.measure_steps:
                self.step_s = self._measure(step)
                pl_module.set_lr_horizon(self.plan(trainer, step), step)
                self._start_window(step)
        self.horizon = pl_module.lr_horizon
        if self.horizon is not None and step >= self.horizon:
            trainer.should_stop = True
        elif trainer.strategy.broadcast(
            self.elapsed() + self.last_step_s + self._validation_s(trainer) + self.margin_s >= self.budget_s
        ):
            log.warning("TimeBudget: steps slower than measured; stopping at step %d before the budget ends", step)
            trainer.should_stop = True

    def _start_window(self, step: int) -> None:
        """Start timing optimizer steps from ``step`` now."""
        self._window, self._window_val_s = (step, self.clock()), 0.0

    def _measure(self, step: int) -> float:
        """Seconds per optimizer step since the window start, validation time left out."""
        start, started = self._window
        return (self.clock() - started - self._window_val_s) / (step - start)

    def _validation_s(self, trainer: Trainer) -> float:
        """Seconds of one validation run: measured batch time x validation batches."""
        batches = sum(trainer.num_val_batches) if trainer.num_val_batches else 0
        return (self.val_batch_s or 0.0) * batches

    def plan(self, trainer: Trainer, step: int, previous: int | None = None) -> int:
        """The horizon H (optimizer steps in all) for the measured costs; see the module docstring, step 3.

        Args:
            trainer: the running trainer (budget, validation interval, ``max_steps``, strategy).
            step: optimizer steps done.
            previous: the horizon being re-planned, for the log line; None = the first plan.

        Returns:
            H >= ``step``, rank 0's value on every rank.
        """
        val = self._validation_s(trainer)
        every = trainer.val_check_batch
        per_step = self.step_s + (val / every if every and math.isfinite(every) else 0.0)
        left = self.budget_s - self.elapsed() - val - self.margin_s
        horizon = step + max(0, math.floor(left / per_step))
        if trainer.max_steps > 0:
            horizon = min(horizon, trainer.max_steps)
        horizon = trainer.strategy.broadcast(horizon)  # rank 0's plan: every rank must stop at the same step
        was = ""
        if previous is not None:
            was = f" (re-plan; was {previous})" if horizon != previous else " (re-plan; unchanged)"
        rank_zero_info(
            f"TimeBudget: {self.elapsed():.0f} s of {self.budget_s:.0f} s used at step {step}; {self.step_s:.2f} s/step, "
            f"{val:.1f} s per validation -> schedule ends at step {horizon}{was}"
        )
        return horizon

    def summary(self) -> str:
        """One line for the end-of-fit summary."""
        if self.budget_s is None:
            return "no time budget (trainer.max_time unset)"
        if self.step_s is not None:
            step = f"{self.step_s:.2f} s/step last measured, {self.replans} re-plans"
        elif self.horizon is not None:
            step = "horizon from the checkpoint"
        else:
            step = "ended before s/step was measured (trainer.max_steps reached first, or set-up took the budget)"
        return f"{self.elapsed():.0f} s of the {self.budget_s:.0f} s budget since process start; {step}; " \
               f"schedule horizon {self.horizon}"
