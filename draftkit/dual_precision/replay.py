"""Replay (dual-precision.md §5): flip labels and gate scores on all-8-bit trajectories, gate quality, calibration.

1. decode greedily at 8 bits; 2. teacher-force the trajectory at 4 and at 8 bits (same prefix);
3. flip y_t = argmax p_lo != argmax p_hi, scores s_t of p_lo. Thresholds are the (1 - B) quantiles of the
scores of a calibration replay on prompts disjoint from evaluation (§4).

Shapes: n generated tokens, V target vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from draftkit.dual_precision.decode import teacher_forced_logits
from draftkit.dual_precision.gates import GATES, Gate, gate_scores
from draftkit.dual_precision.stats import bootstrap_ci, cat_groups, catch_rate, pr_auc, roc_auc, threshold_for_budget
from draftkit.target.session import TargetSession

__all__ = ["DEFAULT_BUDGETS", "ReplaySteps", "calibrate_thresholds", "replay_metrics", "replay_steps"]

DEFAULT_BUDGETS = (0.05, 0.10, 0.15, 0.20, 0.30)
"""Escalation budgets at which the replay reports catch rates."""

@dataclass
class ReplaySteps:
    """Per-step replay data of one prompt (dual-precision.md §5).

    Attributes:
        flip: (n,) bool, argmax p_lo != argmax p_hi on the same 8-bit-decoded prefix.
        scores: {"entropy": (n,), "margin": (n,)} gate scores of p_lo (higher = escalate).
    """

    flip: torch.Tensor
    scores: dict[str, torch.Tensor]


def replay_steps(
    lm: TargetSession, prompt_ids: Sequence[int], tokens: Sequence[int], logits_high: torch.Tensor | None = None
) -> tuple[ReplaySteps, torch.Tensor]:
    """Teacher-forced 4-bit and 8-bit forwards over an all-8-bit trajectory; flip labels and gate scores.

    Args:
        lm: the session of the two-precision target (reset before and after each forward).
        prompt_ids: prompt ids.
        tokens: the all-high greedy trajectory (n ids).
        logits_high: (n, V) teacher-forced 8-bit logits if already computed.

    Returns:
        (:class:`ReplaySteps`, (n, V) teacher-forced 8-bit logits).
    """
    low = teacher_forced_logits(lm, prompt_ids, tokens, "low")  # (n, V)
    high = teacher_forced_logits(lm, prompt_ids, tokens, "high") if logits_high is None else logits_high
    flip = low.argmax(dim=-1) != high.argmax(dim=-1)  # (n,)
    return ReplaySteps(flip.cpu(), {kind: v.cpu() for kind, v in gate_scores(low).items()}), high

def _lagged(steps: list[ReplaySteps], kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Score at t-1 against the flip at t, within each prompt (the lagged gate of cost model iii)."""
    return [s.scores[kind][:-1] for s in steps], [s.flip[1:] for s in steps]


def replay_metrics(
    steps: list[ReplaySteps],
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    bootstrap_samples: int = 1000,
    seed: int = 0,
    gates: Sequence[Gate] = (),
) -> dict:
    """Gate quality on replay data (dual-precision.md §6.1-6.2), intervals by bootstrapping prompts.

    Args:
        steps: one :class:`ReplaySteps` per prompt.
        budgets: escalation budgets B for the catch rates (tau_B set on these same steps, §6.2).
        bootstrap_samples: resamples of prompts for the 95 % intervals (0 = none).
        seed: bootstrap seed.
        gates: calibrated gates to evaluate out of sample (realised escalation rate and catch).

    Returns:
        {num_prompts, num_steps, num_flips, flip_rate, auc_entropy, auc_margin, auc_*_ci, pr_auc_*,
        catch_at_budget {entropy|margin|random|oracle: {B: catch}} (oracle = min(1, B / flip_rate), the most
        any gate can catch), catch_at_budget_ci, catch_at_budget_lagged,
        catch_curve {budgets, entropy, margin}, calibrated_gates}.
    """
    flips = [s.flip for s in steps]
    y = cat_groups(flips)
    n_steps = int(y.numel())
    out: dict = {
        "num_prompts": len(steps),
        "num_steps": n_steps,
        "num_flips": int(y.sum()) if n_steps else 0,
        "flip_rate": float(y.double().mean()) if n_steps else float("nan"),
    }

    def key(b: float) -> str:
        return f"{b:.2f}"

    catch: dict = {"random": {key(b): float(b) for b in budgets}}
    if n_steps and int(y.sum()):  # no gate can catch more than B / flip_rate of the flips
        catch["oracle"] = {key(b): min(1.0, b / out["flip_rate"]) for b in budgets}
    catch_ci: dict = {}
    lagged: dict = {}
    curve_budgets = [round(0.01 * i, 2) for i in range(1, 51)]
    curve: dict = {"budgets": curve_budgets}
    for kind in GATES:
        parts = [s.scores[kind] for s in steps]
        s = cat_groups(parts)
        out[f"auc_{kind}"] = roc_auc(s, y)
        out[f"pr_auc_{kind}"] = pr_auc(s, y)
        out[f"auc_{kind}_ci"] = bootstrap_ci(
            len(steps), lambda idx: roc_auc(cat_groups(parts, idx), cat_groups(flips, idx)), bootstrap_samples, seed
        )
        catch[kind] = {key(b): catch_rate(s, y, b) for b in budgets}
        catch_ci[kind] = {
            key(b): bootstrap_ci(
                len(steps), lambda idx, b=b: catch_rate(cat_groups(parts, idx), cat_groups(flips, idx), b), bootstrap_samples, seed
            )
            for b in budgets
        }
        lag_s, lag_y = _lagged(steps, kind)
        ls, ly = cat_groups(lag_s), cat_groups(lag_y)
        lagged[kind] = {key(b): catch_rate(ls, ly, b) if ls.numel() >= 2 else float("nan") for b in budgets}
        curve[kind] = [catch_rate(s, y, b) for b in curve_budgets]
    out["catch_at_budget"] = catch
    out["catch_at_budget_ci"] = catch_ci
    out["catch_at_budget_lagged"] = lagged
    out["catch_curve"] = curve
    calibrated = {}
    for gate in gates:
        s = cat_groups([st.scores[gate.kind] for st in steps])
        fired = s > gate.threshold
        calibrated[gate.kind] = {
            "threshold": gate.natural_threshold,
            "escalation_rate": float(fired.double().mean()) if n_steps else float("nan"),
            "catch": float(fired[y].double().mean()) if int(y.sum()) else float("nan"),
        }
    out["calibrated_gates"] = calibrated
    return out


def calibrate_thresholds(steps: list[ReplaySteps], budget: float) -> dict[str, Gate]:
    """Gates whose thresholds are the (1 - B) quantiles of the calibration replay scores (§4).

    Args:
        steps: calibration replay, one :class:`ReplaySteps` per prompt (disjoint from evaluation).
        budget: B in (0, 1).

    Returns:
        {"entropy": Gate, "margin": Gate}.

    Raises:
        ValueError: on a budget outside (0, 1) or fewer than 2 calibration steps.
    """
    pooled = {kind: cat_groups([s.scores[kind] for s in steps]) for kind in GATES}
    return {kind: Gate(kind, threshold_for_budget(scores, budget)) for kind, scores in pooled.items()}
