"""Statistics of a dual-precision evaluation: budget thresholds, catch rate, AUROC / PR-AUC, bootstrap, McNemar.

Definitions: docs/dual-precision.md §4 (tau from a budget) and §6 (metrics). Flip labels are rare,
so PR-AUC is reported beside AUROC; intervals resample prompts, not steps (steps of one prompt correlate).

Shapes: N steps, P prompts (groups).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["bootstrap_ci", "cat_groups", "catch_rate", "mcnemar_exact", "pr_auc", "roc_auc", "threshold_for_budget"]


def cat_groups(parts: list[torch.Tensor], idx: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate per-prompt tensors, all of them or the (resampled) prompts ``idx``; empty when none."""
    chosen = parts if idx is None else [parts[i] for i in idx.tolist()]
    return torch.cat(chosen) if chosen else torch.empty(0)


def threshold_for_budget(scores: torch.Tensor, budget: float) -> float:
    """tau such that a fraction round(B*N)/N of ``scores`` is strictly above it (the (1-B) quantile).

    tau is the mid-point between the m-th and (m+1)-th largest scores, m = round(B*N) clipped to [1, N-1],
    so exactly m steps escalate on these scores when no two of the bracketing scores tie.

    Args:
        scores: (N,) gate scores over every step of a replay, N >= 2.
        budget: B in (0, 1), the target escalation rate.

    Raises:
        ValueError: on a budget outside (0, 1) or fewer than 2 scores.
    """
    if not 0.0 < budget < 1.0:
        raise ValueError(f"budget must be in (0, 1), got {budget}")
    flat = scores.detach().double().flatten()
    if flat.numel() < 2:
        raise ValueError(f"need at least 2 scores to calibrate a threshold, got {flat.numel()}")
    desc = flat.sort(descending=True).values  # (N,)
    m = min(max(round(budget * flat.numel()), 1), flat.numel() - 1)
    return float((desc[m - 1] + desc[m]) / 2)

def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (torchmetrics ``binary_auroc``), nan when one class is
    empty. Equals P(s+ > s-) + 0.5 P(s+ = s-) (the Mann-Whitney form, ties counted half) to ~1e-7: torchmetrics
    builds its curve in float32.

    Args:
        scores: (N,) real scores, higher = more likely positive (any range: passed in float64, so torchmetrics'
            sigmoid for scores outside [0, 1] keeps their order).
        labels: (N,) 0/1 or bool.

    Returns:
        The AUC, or nan when one class is empty.
    """
    from torchmetrics.functional.classification import binary_auroc

    y = labels.detach().flatten().long()
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == y.numel():
        return float("nan")
    return float(binary_auroc(scores.detach().double().flatten(), y, validate_args=False))


def pr_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Average precision (PR-AUC) of ``scores`` for ``labels`` (torchmetrics), nan without positives."""
    from torchmetrics.functional.classification import binary_average_precision

    y = labels.detach().flatten().long()
    if int(y.sum()) == 0:
        return float("nan")
    return float(binary_average_precision(scores.detach().float().flatten(), y))


def catch_rate(scores: torch.Tensor, labels: torch.Tensor, budget: float) -> float:
    """Fraction of positives (flips) whose score is above the budget threshold of these scores (§6.2).

    tau_B = :func:`threshold_for_budget` (scores, B); catch(B) = sum_t y_t 1[s_t > tau_B] / sum_t y_t.
    A random gate catches B in expectation.

    Returns:
        catch(B), or nan without positives.
    """
    y = labels.detach().flatten().bool()
    if int(y.sum()) == 0:
        return float("nan")
    tau = threshold_for_budget(scores, budget)
    return float((scores.detach().double().flatten()[y] > tau).double().mean())


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar test on discordant pairs: p = min(1, 2 * BinomCDF(min(b, c); b + c, 1/2)).

    Dietterich 1998 (Neural Computation 10(7)) for comparing two classifiers on paired outcomes.

    Args:
        b: #(A right, B wrong).
        c: #(A wrong, B right).

    Returns:
        The p-value; 1.0 when b + c = 0.
    """
    n = b + c
    if n == 0:
        return 1.0
    cdf = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2.0 * cdf)


def bootstrap_ci(
    num_groups: int,
    statistic: Callable[[torch.Tensor], float],
    num_samples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> list[float] | None:
    """Percentile bootstrap interval, resampling groups (prompts) with replacement, not steps.

    Args:
        num_groups: P, number of prompts.
        statistic: maps a (P,) int64 tensor of resampled prompt indices to a float (nan is skipped).
        num_samples: bootstrap resamples.
        seed: generator seed.
        level: central coverage.

    Returns:
        [low, high], or None when no resample gives a finite value or ``num_samples`` is 0.
    """
    if num_samples <= 0 or num_groups == 0:
        return None
    gen = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(num_samples):
        v = statistic(torch.randint(0, num_groups, (num_groups,), generator=gen))
        if math.isfinite(v):
            values.append(v)
    if not values:
        return None
    v = torch.tensor(values, dtype=torch.float64)
    alpha = (1.0 - level) / 2
    return [float(v.quantile(alpha)), float(v.quantile(1.0 - alpha))]
