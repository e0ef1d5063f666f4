"""Dual-precision evaluation: calibrate the gates, replay, compare the methods live, and report.

Definitions: docs/dual-precision.md. Seed idea "precision on demand" (arXiv 2611.14418, claims
only); gates from CALM (arXiv 2207.07061) and BiLD (arXiv 2302.07863); verified speculation is
self-speculation with shared weights (QSpec arXiv 2410.11305, QuantSpec arXiv 2502.10424), greedy or by
rejection sampling (arXiv 2211.17192).

Notable:
- one target, two precisions: every quantized linear holds its int8 codes and their 4-bit slice and a step
  flips ``precision`` (``draftkit.quant``); nothing is reloaded
- gated step t: 4-bit pass -> gate on p_lo -> on escalation the cache is cropped by the step's tokens and
  the step re-run in 8 bits, which overwrites its K/V (steps that do not escalate leave 4-bit K/V: KV drift)
- the prompt forward is step 0 of every method and counts as one weight read, so all-high costs exactly A
  bytes per generated token
- gate scores: entropy H(p_lo) in nats, and -margin (p_(1) - p_(2)); a step escalates when score > tau
- thresholds come from a budget B on a calibration replay (prompts disjoint from evaluation)
- replay (§5): all-8-bit greedy trajectories, then teacher-forced 4-bit and 8-bit forwards on them; a flip is
  argmax p_lo != argmax p_hi; AUC, PR-AUC, catch at budgets, bootstrap CIs over prompts
- live comparison (§6): bytes per token (cost models i/ii/iii), KL(high || method) along the method's own
  trajectory, argmax agreement, exact match with all-high, McNemar exact test
- sampling (T > 0, top-p/top-k, ``draftkit.sampling``): every method draws from the warped
  distribution of the logits it ends a step with; gates score the untempered 4-bit softmax; verified
  speculation accepts by rejection sampling, so its output is distributed as all-high sampling; each prompt's
  methods share one seed (exact match with all-high is then a same-seed comparison, not a correctness test)
- the evaluation appends each finished prompt to a JSONL record and resumes from it; evaluation rows are keyed
  by index and prompt digest, so a rerun on a prefix of the prompts (a smaller ``--num_prompts``) reports on
  the prompts an interrupted run finished, and a larger one extends it

Modules: ``gates`` (scores, Gate), ``stats`` (thresholds, catch, AUROC / PR-AUC, bootstrap, McNemar), ``decode``
(the loops, over the target's ``draftkit.target.session.TargetSession`` with its precision switch), ``replay`` (flip labels, gate quality, calibration) and
this one (the orchestrator and its report). Acceptance, tau, chain acceptance and KL are
``draftkit.decoding.metrics``'s; entropy is ``draftkit.analysis.token_entropy``'s.

Shapes: P prompts, n generated tokens, V target vocab.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Sequence

import torch

from draftkit.decoding.metrics import AcceptanceStats, kl_from_logits
from draftkit.dual_precision.decode import Trajectory, greedy_decode, teacher_forced_logits, verified_decode
from draftkit.dual_precision.gates import GATES, Gate
from draftkit.dual_precision.replay import DEFAULT_BUDGETS, ReplaySteps, calibrate_thresholds
from draftkit.dual_precision.replay import replay_metrics, replay_steps
from draftkit.dual_precision.stats import bootstrap_ci, cat_groups, mcnemar_exact
from draftkit.jsonio import short_hash
from draftkit.quant import COST_MODELS, WeightBytes, expected_verified_ratio, gated_bytes_per_token
from draftkit.sampling import DecodeConfig, check_sampling
from draftkit.target.session import TargetSession

__all__ = ["METHODS", "DualPrecisionConfig", "evaluate_dual_precision"]

log = logging.getLogger(__name__)

METHODS = ("all_high", "all_low", "entropy_gate", "margin_gate", "verified")
"""Methods of the live comparison, in report order."""

@dataclass
class DualPrecisionConfig:
    """Knobs of one dual-precision evaluation.

    Attributes:
        budget: escalation budget B in (0, 1) for threshold calibration; None = 0.15 unless thresholds given.
        entropy_threshold: fixed entropy threshold tau_H in nats (no calibration); excludes ``budget``.
        margin_threshold: fixed margin threshold tau_m (escalate when p_(1) - p_(2) < tau_m); excludes ``budget``.
        max_new_tokens: generated tokens per prompt at most.
        k: draft tokens per round of verified speculation.
        budgets: budgets at which the replay reports catch rates.
        bootstrap_samples: prompt resamples for 95 % intervals (0 = none).
        seed: bootstrap seed.
        methods: methods of the live comparison, a subset of :data:`METHODS` (``all_high`` always runs).
        temperature: 0 = greedy (default); > 0 samples every method, verified speculation by rejection
            sampling. Each prompt's methods share one seed (``seed``, prompt index).
        top_p: nucleus cut when sampling (1 = off).
        top_k: top-k cut when sampling (0 = off).
    """

    budget: float | None = None
    entropy_threshold: float | None = None
    margin_threshold: float | None = None
    max_new_tokens: int = 128
    k: int = 3
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    bootstrap_samples: int = 1000
    seed: int = 0
    methods: tuple[str, ...] = METHODS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        fixed = self.entropy_threshold is not None or self.margin_threshold is not None
        if fixed and self.budget is not None:
            raise ValueError(
                "--budget and --entropy_threshold/--margin_threshold were both given: choose one (a budget "
                "calibrates the thresholds on the calibration prompts; a threshold is used as is)"
            )
        if self.budget is None and not fixed:
            self.budget = 0.15
        if self.budget is not None and not 0.0 < self.budget < 1.0:
            raise ValueError(f"--budget must be in (0, 1) (a fraction of steps), got {self.budget}")
        if any(not 0.0 < b < 1.0 for b in self.budgets):
            raise ValueError(f"budgets must all be in (0, 1), got {list(self.budgets)}")
        if self.margin_threshold is not None and not 0.0 <= self.margin_threshold <= 1.0:
            raise ValueError(f"--margin_threshold is a probability gap in [0, 1], got {self.margin_threshold}")
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
        self.budgets = tuple(self.budgets)
        self.methods = tuple(m for m in METHODS if m in self.methods or m == "all_high")

    @property
    def calibrate(self) -> bool:
        """Whether thresholds come from a budget on calibration prompts."""
        return self.budget is not None

    def decoding(self, eos_ids: Sequence[int]) -> DecodeConfig:
        """What every decoding loop generates: ``max_new_tokens``, the stop ids and the sampling options."""
        return DecodeConfig(self.max_new_tokens, self.temperature, self.top_k, self.top_p, tuple(eos_ids))


def _traj_row(traj: Trajectory) -> dict:
    """A trajectory without its logits, as JSON (the per-prompt record)."""
    return {f.name: getattr(traj, f.name) for f in fields(Trajectory) if f.name != "logits"}


def _eval_key(i: int, prompt: Sequence[int]) -> str:
    """Record key of evaluation prompt ``i``: its index (the prompt's seed) and a digest of its token ids."""
    return f"evaluation/{i}/{short_hash(list(prompt))}"


def _steps_row(steps: ReplaySteps) -> dict:
    return {"flip": steps.flip.tolist(), **{kind: v.tolist() for kind, v in steps.scores.items()}}


def _steps_from_row(row: dict) -> ReplaySteps:
    return ReplaySteps(torch.tensor(row["flip"], dtype=torch.bool), {kind: torch.tensor(row[kind]) for kind in GATES})


def _progress(what: str, done: int, total: int, started: float, resumed: int) -> None:
    """Log one finished prompt with the elapsed time and an estimate of what is left (resumed ones excluded)."""
    elapsed = time.perf_counter() - started
    fresh = done - resumed
    eta = elapsed / fresh * (total - done) if fresh else float("nan")
    log.info("%s %d/%d done (%.0f s elapsed, ~%.0f s left)", what, done, total, elapsed, eta)


def _method_entry(trajs: list[Trajectory], kls: list[torch.Tensor], agree: list[torch.Tensor],
                  exact: list[bool], wb: WeightBytes, seed: int, samples: int) -> dict:
    n_tokens = sum(len(t.tokens) for t in trajs)
    read = sum(t.weight_bytes_read(wb) for t in trajs)
    bytes_per_token = read / n_tokens
    kl_all = torch.cat(kls)
    kl_prompt = [float(k.mean()) for k in kls]
    entry = {
        "bytes_per_token": bytes_per_token,
        "bytes_ratio_vs_high": bytes_per_token / wb.high,
        "kl_mean": float(kl_all.double().mean()),
        "kl_mean_ci": bootstrap_ci(
            len(kls), lambda idx: float(cat_groups(kls, idx).double().mean()), samples, seed
        ),
        "kl_per_prompt": kl_prompt,
        "argmax_agreement": float(torch.cat(agree).double().mean()),
        "exact_match": sum(exact) / len(exact),
        "exact_match_per_prompt": [bool(e) for e in exact],
        "tokens": n_tokens,
        "low_forwards": sum(t.low_forwards for t in trajs),
        "high_forwards": sum(t.high_forwards for t in trajs),
    }
    return entry


def evaluate_dual_precision(
    lm: TargetSession,
    eval_prompts: Sequence[Sequence[int]],
    calib_prompts: Sequence[Sequence[int]],
    config: DualPrecisionConfig | None = None,
    eos_ids: Sequence[int] = (),
    is_correct: Callable[[int, list[int]], bool] | None = None,
    record: str | None = None,
    record_header: dict | None = None,
) -> dict:
    """Calibrate gates, replay all-8-bit trajectories and compare the methods live (dual-precision.md §4-7).

    Steps:
    1. calibration (when ``config.budget`` is set): all-high decode of each calibration prompt, replay,
       thresholds = (1 - B) quantiles of the pooled scores;
    2. per evaluation prompt: all-high decode -> replay (flip labels, scores) and the teacher-forced 8-bit
       logits; then all-low, entropy gate, margin gate and verified speculation decodes; for each, a
       teacher-forced 8-bit forward over its own trajectory gives KL(high || method) and argmax agreement;
    3. aggregate: replay metrics with prompt-bootstrap intervals, the method table (bytes under cost
       models i/ii/iii for gates), exact McNemar tests on per-prompt labels.

    Decoding is greedy, or sampled at ``config.temperature`` > 0 (each prompt's methods share one seed; the
    replay's flip label stays the argmax flip on the sampled all-high trajectory). Each finished calibration
    and evaluation prompt is appended to ``record`` (JSONL), so a rerun with the same config resumes where an
    interrupted one stopped. The record's header holds the config and the calibration prompts, not the
    evaluation prompts: evaluation rows are keyed by index and prompt digest (:func:`_eval_key`), so a rerun
    on the first N prompts reuses the finished rows (a report on what an interrupted run has) and a rerun on
    more prompts extends the record.

    Args:
        lm: the session of the two-precision target (``TargetSession.with_precision_switch``).
        eval_prompts: P prompts as token ids (template applied).
        calib_prompts: calibration prompts as token ids, disjoint from ``eval_prompts``; unused when the
            thresholds are given.
        config: :class:`DualPrecisionConfig`.
        eos_ids: ids that end generation.
        is_correct: optional per-prompt task label, (prompt index, generated ids) -> bool; adds
            ``accuracy`` per method and McNemar tests on it.
        record: per-prompt JSONL record path (``draftkit.jsonio.ResumableRecord``), or None.
        record_header: what else the results depend on (target, quantization), stored in the record header.

    Returns:
        The report dict: ``weight_bytes``, ``thresholds``, ``calibration``, ``replay``, ``methods``,
        ``mcnemar``, ``timing_s``, ``sizes``.

    Raises:
        ValueError: on a session without a precision switch, no evaluation prompts, too few calibration steps for a budget, or a ``record`` of a
            different run.
    """
    from draftkit.jsonio import ResumableRecord

    config = config or DualPrecisionConfig()
    if not eval_prompts:
        raise ValueError("no evaluation prompts")
    if lm.precision_bytes is None:
        raise ValueError("dual precision needs a session with a precision switch (TargetSession.with_precision_switch)")
    wb, n_max = lm.precision_bytes, config.max_new_tokens
    decoding = config.decoding(eos_ids)
    run = {k: v for k, v in asdict(config).items() if k not in ("budgets", "bootstrap_samples")}
    header = {"config": run, "weight_bytes": wb.to_dict(), "eos_ids": sorted(eos_ids), **(record_header or {}),
              "calib_prompts": [list(x) for x in calib_prompts]}
    rec = ResumableRecord(record, header)
    if rec.done:
        log.info("resuming from %s: %d prompts already done", record, len(rec.done))
    timing: dict[str, float] = {}
    t0 = time.perf_counter()

    # 1. thresholds (only when a gate runs)
    calibration: dict = {"num_prompts": 0, "num_steps": 0}
    run_gates = any(m.endswith("_gate") for m in config.methods)
    if config.calibrate and run_gates:
        if not calib_prompts:
            raise ValueError("a budget needs calibration prompts (disjoint from the evaluation prompts)")
        calib_steps, resumed = [], sum(rec.get(f"calibration/{i}") is not None for i in range(len(calib_prompts)))
        for i, prompt in enumerate(calib_prompts):
            row = rec.get(f"calibration/{i}")
            if row is None:
                g = torch.Generator().manual_seed(config.seed * 100_003 + 50_000 + i)
                traj = greedy_decode(lm, prompt, decoding, "high", keep_logits=False, generator=g)
                row = _steps_row(replay_steps(lm, prompt, traj.tokens)[0])
                rec.add(f"calibration/{i}", row)
                _progress("calibration prompt", i + 1, len(calib_prompts), t0, resumed)
            calib_steps.append(_steps_from_row(row))
        gates = calibrate_thresholds(calib_steps, config.budget)
        calibration = replay_metrics(calib_steps, config.budgets, 0, config.seed, list(gates.values()))
        calibration = {
            k: calibration[k] for k in ("num_prompts", "num_steps", "flip_rate", "auc_entropy", "auc_margin",
                                        "calibrated_gates")
        }
    else:
        gates = {}
        if config.entropy_threshold is not None and run_gates:
            gates["entropy"] = Gate.from_natural("entropy", config.entropy_threshold)
        if config.margin_threshold is not None and run_gates:
            gates["margin"] = Gate.from_natural("margin", config.margin_threshold)
    timing["calibration"] = time.perf_counter() - t0
    methods = [m for m in config.methods if not (m.endswith("_gate") and m[: -len("_gate")] not in gates)]

    # 2. evaluation prompts, one record row each: {"replay": steps, "methods": {m: trajectory + kl/agree/exact}}
    t_eval = time.perf_counter()
    keys = [_eval_key(i, prompt) for i, prompt in enumerate(eval_prompts)]
    resumed = sum(rec.get(key) is not None for key in keys)
    for i, prompt in enumerate(eval_prompts):
        if rec.get(keys[i]) is not None:
            continue
        row: dict = {"methods": {}, "timing_s": {}}
        seed = config.seed * 100_003 + i
        t = time.perf_counter()
        high = greedy_decode(lm, prompt, decoding, "high", generator=torch.Generator().manual_seed(seed))
        row["timing_s"]["all_high"] = time.perf_counter() - t
        t = time.perf_counter()
        steps, tf_high = replay_steps(lm, prompt, high.tokens)
        row["replay"] = _steps_row(steps)
        row["timing_s"]["replay"] = time.perf_counter() - t
        for m in methods:
            t = time.perf_counter()
            if m == "all_high":
                traj = high
            elif m == "all_low":
                traj = greedy_decode(lm, prompt, decoding, "low", generator=torch.Generator().manual_seed(seed))
            elif m == "verified":
                traj = verified_decode(lm, prompt, config.k, decoding, generator=torch.Generator().manual_seed(seed))
            else:
                traj = greedy_decode(lm, prompt, decoding, gate=gates[m[: -len("_gate")]],
                                     generator=torch.Generator().manual_seed(seed))
            exact = traj.tokens == high.tokens
            ref = tf_high if exact else teacher_forced_logits(lm, prompt, traj.tokens, "high")  # (n, V)
            row["methods"][m] = {
                **_traj_row(traj),
                "kl": kl_from_logits(ref, traj.logits).tolist(),
                "agree": (ref.argmax(-1) == traj.logits.argmax(-1)).tolist(),
                "exact": exact,
            }
            if m != "all_high":
                row["timing_s"][m] = time.perf_counter() - t
        rec.add(keys[i], row)
        log.info("evaluation prompt %d/%d: %d tokens, %d flips in replay", i + 1, len(eval_prompts),
                 len(high.tokens), int(steps.flip.sum()))
        _progress("evaluation prompt", i + 1, len(eval_prompts), t_eval, resumed)
    rows = [rec.get(key) for key in keys]
    replay = [_steps_from_row(r["replay"]) for r in rows]
    per: dict[str, dict[str, list]] = {m: {"trajs": [], "kl": [], "agree": [], "exact": []} for m in methods}
    for r in rows:
        for m in methods:
            got = r["methods"][m]
            per[m]["trajs"].append(Trajectory(**{f.name: got[f.name] for f in fields(Trajectory)
                                                 if f.name != "logits"}))
            per[m]["kl"].append(torch.tensor(got["kl"]))
            per[m]["agree"].append(torch.tensor(got["agree"], dtype=torch.bool))
            per[m]["exact"].append(got["exact"])
    timing["replay"] = sum(r["timing_s"]["replay"] for r in rows)
    timing.update({f"method/{m}": sum(r["timing_s"].get(m, 0.0) for r in rows) for m in methods})

    # 3. aggregate
    replay_report = replay_metrics(replay, config.budgets, config.bootstrap_samples, config.seed, list(gates.values()))
    table: dict[str, dict] = {}
    for m in methods:
        rec = per[m]
        entry = _method_entry(rec["trajs"], rec["kl"], rec["agree"], rec["exact"], wb, config.seed,
                              config.bootstrap_samples)
        n_tok = entry["tokens"]
        if m == "all_high":
            entry["escalation_rate"] = 1.0
        elif m == "all_low":
            entry["escalation_rate"] = 0.0
        elif m == "verified":
            acceptance = AcceptanceStats(config.k)
            for drafted, accepted in (r for t in rec["trajs"] for r in t.rounds):
                acceptance.update(accepted, drafted)
            entry["escalation_rate"] = None  # every round ends in an 8-bit verify pass
            entry["k"] = config.k
            entry["verify_passes_per_token"] = entry["high_forwards"] / n_tok
            entry["tau"] = acceptance.tau_drafted()  # a round without drafts is a plain 8-bit step
            entry["alpha"] = acceptance.chain_acceptance()
            if entry["alpha"][0] is not None:  # i.i.d. prediction from the measured alpha_1 (§7)
                entry["predicted_ratio_by_k"] = {
                    str(j): expected_verified_ratio(wb.rho, entry["alpha"][0], j) for j in (1, 2, 3, 4, 6)
                }
        else:
            gate = gates[m[: -len("_gate")]]
            esc = sum(sum(t.escalated) for t in rec["trajs"])
            e = esc / n_tok
            entry["escalation_rate"] = e
            entry["threshold"] = gate.natural_threshold
            entry["bytes_per_token_models"] = {c: gated_bytes_per_token(wb, e, c) for c in COST_MODELS}
            entry["bytes_ratio_models"] = {c: gated_bytes_per_token(wb, e, c) / wb.high for c in COST_MODELS}
        if is_correct is not None:
            labels = [bool(is_correct(j, t.tokens)) for j, t in enumerate(rec["trajs"])]
            entry["accuracy"] = sum(labels) / len(labels)
            entry["correct_per_prompt"] = labels
        table[m] = entry

    mcnemar = {}
    label_keys = ["exact_match_per_prompt"] + (["correct_per_prompt"] if is_correct is not None else [])
    for label in label_keys:
        tests = {}
        for a_i, a in enumerate(methods):
            for b in methods[a_i + 1:]:
                la, lb = table[a][label], table[b][label]
                b_n = sum(x and not z for x, z in zip(la, lb))
                c_n = sum(z and not x for x, z in zip(la, lb))
                tests[f"{a}|{b}"] = {"b": b_n, "c": c_n, "p": mcnemar_exact(b_n, c_n)}
        mcnemar[label.replace("_per_prompt", "")] = tests

    timing["total"] = time.perf_counter() - t0
    return {
        "sizes": {
            "calibration_prompts": calibration["num_prompts"],
            "evaluation_prompts": len(eval_prompts),
            "max_new_tokens": n_max,
            "k": config.k,
        },
        "sampling": {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k},
        "config": asdict(config),
        "weight_bytes": {**wb.to_dict(), "cost_models": list(COST_MODELS)},
        "thresholds": {
            "source": ("calibrated" if config.calibrate else "given") if gates else None,
            "budget": config.budget if gates else None,
            **{kind: g.natural_threshold for kind, g in gates.items()},
        },
        "calibration": calibration,
        "replay": replay_report,
        "methods": table,
        "mcnemar": mcnemar,
        "timing_s": timing,
    }
