"""The learning-rate schedule of head training: linear warmup, then cosine to a floor at a horizon H that a
callback (``TimeBudget``) may fix, and move, while training runs; ``Eagle3Module.lr_factor`` and
``set_lr_horizon`` are this module's functions over the module's ``optim``, ``lr_horizon`` and ``lr_anchor``.

A plan is (H, anchor): H the optimizer step at which the cosine reaches its floor, anchor = None (the first plan)
or (W warmup steps, a optimizer step, p_a cosine progress) left by the last re-plan (:func:`replan_anchor`).

Shapes: none (scalars).
"""

from __future__ import annotations

import math

RESUME_KEY = "draftkit_trainer_options"
"""Checkpoint key: the run's trainer options as plain values (written by ``draftkit.cli``, which reads them for
its resume checks; ``Eagle3Module`` reads the step limit an older checkpoint planned its schedule on)."""

__all__ = ["Anchor", "lr_factor", "lr_progress", "replan_anchor"]

Anchor = tuple[int, int, float]
"""(W warmup steps, a optimizer step, p_a cosine progress at a) of a re-plan."""


def lr_progress(
    step: int, total: int | None, warmup_steps: int, anchor: Anchor | None = None
) -> tuple[int, float | None]:
    """(W, p): the warmup length and the cosine progress after ``step`` optimizer steps for horizon ``total``
    (p None in the warmup or without a horizon); see :func:`lr_factor`."""
    if anchor is not None:
        warm, start, start_progress = anchor
    else:
        # warmup takes at most half the horizon, so that a short run still ends at the cosine floor
        warm = min(warmup_steps, total // 2) if total else warmup_steps
        start, start_progress = warm, 0.0
    if step < warm or total is None:
        return warm, None
    done = min(1.0, (step - start) / max(1, total - start))  # share of the plan's steps after a: 0 at a
    return warm, start_progress + (1 - start_progress) * done  # p_a at a, exactly 1 from H on


def lr_factor(step: int, total: int | None, warmup_steps: int, min_lr_ratio: float,
              anchor: Anchor | None = None) -> float:
    """The learning rate after ``step`` optimizer steps, as a fraction of the peak ``optim.lr``.

    1. warmup: (step + 1) / W for step < W, W = min(warmup_steps, H // 2) (kept by a re-plan);
    2. cosine: r + (1 - r) (1 + cos(pi p)) / 2, r = ``min_lr_ratio``, with the progress
       p = p_a + (1 - p_a) min(1, (step - a) / max(1, H - a)): linear from (a, p_a) to (H, 1), then 1
       (the floor, exactly lr * r). The first plan (``anchor`` None) has (a, p_a) = (W, 0), i.e.
       p = (step - W) / (H - W); a re-plan (:func:`replan_anchor`) moves (a, p_a) to the step where it took over,
       so that the LR there is unchanged and the floor comes exactly at the new H.

    Without a horizon (``total`` None: a time budget still measuring) the peak is held after the warmup.

    Args:
        step: optimizer steps done (not micro-batches).
        total: H in optimizer steps, or None.
        warmup_steps: ``optim.warmup_steps``.
        min_lr_ratio: r, the floor as a fraction of the peak.
        anchor: (W, a, p_a) of the last re-plan, or None.

    Returns:
        the multiplier of the peak LR: (step + 1) / W in the warmup, then in [``min_lr_ratio``, 1].
    """
    warm, progress = lr_progress(step, total, warmup_steps, anchor)
    if step < warm:
        return (step + 1) / max(1, warm)
    if progress is None:
        return 1.0
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def replan_anchor(horizon: int, step: int, current: int | None, warmup_steps: int,
                  anchor: Anchor | None) -> Anchor | None:
    """The anchor of a plan moving from horizon ``current`` to ``horizon`` after ``step`` optimizer steps.

    The first plan (``current`` None) and a re-plan to the same H keep ``anchor``. Otherwise the current plan's
    progress at a = max(step, W) is stored as (W, a, p_a), so that :func:`lr_factor` keeps the warmup and the LR
    at a (for a = ``step``, the LR already in use) bit for bit and reaches the floor exactly at the new H. Steps
    between W and a lie behind the scheduler and are not described any more.

    Raises:
        ValueError: if horizon < 1 or step < 0.
    """
    if horizon < 1 or step < 0:
        raise ValueError(f"set_lr_horizon needs horizon >= 1 and step >= 0, got {horizon}, {step}")
    if current is None or horizon == current:
        return anchor
    warm, _ = lr_progress(step, current, warmup_steps, anchor)
    at = max(step, warm)
    return warm, at, lr_progress(at, current, warmup_steps, anchor)[1]
