"""Dual precision: one 8-bit target run on its top 4 bits, escalating uncertain steps (dual-precision.md).

- ``gates``: entropy / margin scores of the 4-bit softmax, :class:`Gate`.
- ``stats``: threshold for a budget, catch rate, AUROC / PR-AUC, prompt bootstrap, exact McNemar.
- ``decode``: :class:`Trajectory`, single-precision / gated / verified decoding, teacher-forced logits, over the
  target's ``draftkit.target.session.TargetSession`` with a precision switch (``with_precision_switch``).
- ``replay``: flip labels and gate scores on all-8-bit trajectories, gate quality, threshold calibration.
- ``evaluate``: :class:`DualPrecisionConfig` and :func:`evaluate_dual_precision`, the orchestrator behind
  ``draftkit evaluate-dual-precision``.
- ``harness``: ``evaluate_target``, that evaluation of a target reference (loaded, quantized, prompts encoded).
- ``report``: the report's answer check, quantization record, text summary, TensorBoard figures, strict JSON.
"""

from draftkit.dual_precision.decode import Trajectory, greedy_decode, teacher_forced_logits, verified_decode
from draftkit.dual_precision.evaluate import METHODS, DualPrecisionConfig, evaluate_dual_precision
from draftkit.dual_precision.gates import GATES, Gate, gate_scores, top2_margin
from draftkit.dual_precision.replay import (
    DEFAULT_BUDGETS,
    ReplaySteps,
    calibrate_thresholds,
    replay_metrics,
    replay_steps,
)
from draftkit.dual_precision.stats import (
    bootstrap_ci,
    catch_rate,
    mcnemar_exact,
    pr_auc,
    roc_auc,
    threshold_for_budget,
)

__all__ = [
    "DEFAULT_BUDGETS",
    "GATES",
    "METHODS",
    "DualPrecisionConfig",
    "Gate",
    "ReplaySteps",
    "Trajectory",
    "bootstrap_ci",
    "calibrate_thresholds",
    "catch_rate",
    "evaluate_dual_precision",
    "gate_scores",
    "greedy_decode",
    "mcnemar_exact",
    "pr_auc",
    "replay_metrics",
    "replay_steps",
    "roc_auc",
    "teacher_forced_logits",
    "threshold_for_budget",
    "top2_margin",
    "verified_decode",
]
