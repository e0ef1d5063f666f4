"""Dual-precision decoding: 4-bit slices of 8-bit weights, escalation gates and verified speculation.

Definitions: shared/reference/dual-precision.md. Seed idea "precision on demand" (arXiv 2611.14418, claims
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
- sampling (T > 0, top-p/top-k, ``draftkit.decoding.sampling``): every method draws from the warped
  distribution of the logits it ends a step with; gates score the untempered 4-bit softmax; verified
  speculation accepts by rejection sampling, so its output is distributed as all-high sampling; each prompt's
  methods share one seed (exact match with all-high is then a same-seed comparison, not a correctness test)
- the evaluation appends each finished prompt to a JSONL record and resumes from it

Shapes: T tokens, n generated tokens, V target vocab, P prompts.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftkit.decoding.sampling import check_sampling, probs_from_logits, sample, sample_from_probs
from draftkit.decoding.speculative import greedy_verify, rejection_verify
from draftkit.quant import (
    COST_MODELS,
    QuantConfig,
    WeightBytes,
    expected_verified_ratio,
    gated_bytes_per_token,
    nested_linears,
    quantize_model,
    set_precision,
    weight_bytes,
)

__all__ = [
    "GATES",
    "METHODS",
    "DEFAULT_BUDGETS",
    "Gate",
    "Trajectory",
    "ReplaySteps",
    "DualPrecisionConfig",
    "DualPrecisionLM",
    "entropy_nats",
    "top2_margin",
    "gate_scores",
    "threshold_for_budget",
    "roc_auc",
    "pr_auc",
    "catch_rate",
    "mcnemar_exact",
    "bootstrap_ci",
    "kl_per_step",
    "greedy_decode",
    "verified_decode",
    "teacher_forced_logits",
    "replay_steps",
    "replay_metrics",
    "calibrate_thresholds",
    "evaluate_dual_precision",
]

log = logging.getLogger(__name__)

GATES = ("entropy", "margin")
"""Gate kinds; their scores are H(p_lo) and -margin(p_lo), higher = more uncertain."""

METHODS = ("all_high", "all_low", "entropy_gate", "margin_gate", "verified")
"""Methods of the live comparison, in report order."""

DEFAULT_BUDGETS = (0.05, 0.10, 0.15, 0.20, 0.30)
"""Escalation budgets at which the replay reports catch rates."""


# ----------------------------------------------------------------------------------------------------------
# gate scores and thresholds


def entropy_nats(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...,) entropy of the softmax in nats, computed in fp32 over the full vocabulary."""
    logp = F.log_softmax(logits.float(), dim=-1)  # (..., V)
    return -(logp.exp() * logp).sum(dim=-1)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...,) p_(1) - p_(2), the gap between the two largest softmax probabilities (fp32)."""
    top2 = F.softmax(logits.float(), dim=-1).topk(2, dim=-1).values  # (..., 2)
    return top2[..., 0] - top2[..., 1]


def gate_scores(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """(..., V) low-precision logits -> {"entropy": H, "margin": -margin}, each (...,); higher = escalate."""
    return {"entropy": entropy_nats(logits), "margin": -top2_margin(logits)}


@dataclass(frozen=True)
class Gate:
    """An escalation gate: escalate a step when its score exceeds ``threshold``.

    Attributes:
        kind: ``entropy`` (score H(p_lo), nats) or ``margin`` (score -(p_(1) - p_(2))).
        threshold: tau on the score scale. For the margin gate this is -tau_m: the step escalates when the
            margin is below tau_m = -threshold.
    """

    kind: str
    threshold: float

    def __post_init__(self) -> None:
        if self.kind not in GATES:
            raise ValueError(f"unknown gate {self.kind!r}; choose one of {GATES}")

    @classmethod
    def from_natural(cls, kind: str, value: float) -> "Gate":
        """Gate from a threshold in natural units: entropy tau_H in nats, or margin tau_m in [0, 1]."""
        return cls(kind, float(value) if kind == "entropy" else -float(value))

    @property
    def natural_threshold(self) -> float:
        """tau_H (nats) for entropy, tau_m (probability gap) for margin."""
        return self.threshold if self.kind == "entropy" else -self.threshold

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) low-precision logits -> (...,) score."""
        return entropy_nats(logits) if self.kind == "entropy" else -top2_margin(logits)


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


# ----------------------------------------------------------------------------------------------------------
# statistics


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """AUC = P(s+ > s-) + 0.5 P(s+ = s-) = U / (n+ n-), the Mann-Whitney form with tied ranks averaged.

    Args:
        scores: (N,) real scores, higher = more likely positive.
        labels: (N,) 0/1 or bool.

    Returns:
        The AUC, or nan when one class is empty.
    """
    s = scores.detach().double().flatten()
    y = labels.detach().flatten().bool()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_s, order = s.sort()
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # (U,) 1-based rank of the last member of each tie group
    avg_rank = ends - (counts.double() - 1) / 2  # (U,)
    ranks = torch.empty_like(s)
    ranks[order] = avg_rank[inverse]
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


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


def kl_per_step(logits_high: torch.Tensor, logits_method: torch.Tensor) -> torch.Tensor:
    """(n, V), (n, V) -> (n,) KL(p_hi || q) = sum_v p_hi (log p_hi - log q) in nats, fp32 log_softmax."""
    log_p = F.log_softmax(logits_high.float(), dim=-1)  # (n, V)
    log_q = F.log_softmax(logits_method.float(), dim=-1)  # (n, V)
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(dim=-1)


# ----------------------------------------------------------------------------------------------------------
# the two-precision target


class DualLM(Protocol):
    """What the decoding loops need; :class:`DualPrecisionLM` for HF targets, stubs in tests."""

    bytes: WeightBytes

    def new_cache(self): ...

    def forward(self, input_ids: Sequence[int], cache, precision: str, logits_to_keep: int = 1) -> torch.Tensor: ...

    def rollback(self, cache, num_tokens: int): ...


class DualPrecisionLM:
    """A Hugging Face causal LM (Llama-style, DynamicCache) with nested int8/int4 linears.

    Args:
        model: e.g. ``LlamaForCausalLM``; quantized IN PLACE unless it already holds ``NestedInt8Linear``
            (pass ``copy.deepcopy(model)`` when the float model is still needed, e.g. from a callback).
        quant_config: module selection and scheme (default: decoder linears, 16-bit LM head, mid-point).

    Raises:
        ValueError: if the target has no quantizable linears.
    """

    def __init__(self, model: nn.Module, quant_config: QuantConfig | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.quant_config = quant_config or QuantConfig()
        self.layers = nested_linears(model) or list(quantize_model(model, self.quant_config).values())
        self.bytes = weight_bytes(model, self.quant_config)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._device = model.get_input_embeddings().weight.device

    def new_cache(self):
        """An empty ``DynamicCache`` for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int], cache, precision: str, logits_to_keep: int = 1) -> torch.Tensor:
        """Run ``input_ids`` after the tokens in ``cache`` (appending their K/V) at one precision.

        Args:
            input_ids: T token ids.
            cache: a ``DynamicCache`` (extended in place), or None for a cache-free forward.
            precision: ``high`` (int8 codes) or ``low`` (4-bit slice).
            logits_to_keep: last positions whose logits are returned.

        Returns:
            (logits_to_keep, V) float32 logits.
        """
        set_precision(self.layers, precision)
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self._device)[None]  # (1, T)
        out = self.model(
            input_ids=ids, use_cache=cache is not None, logits_to_keep=logits_to_keep, **{self._cache_kw: cache}
        )
        return out.logits[0].float()  # (logits_to_keep, V)

    @staticmethod
    def rollback(cache, num_tokens: int):
        """Drop the last ``num_tokens`` positions of ``cache`` (``DynamicCache.crop(-n)``); returns the cache."""
        if num_tokens > 0:
            cache.crop(-num_tokens)
        return cache


# ----------------------------------------------------------------------------------------------------------
# decoding loops


@dataclass
class Trajectory:
    """One greedy decode.

    Attributes:
        tokens: n generated ids (EOS included when hit).
        logits: (n, V) float32 logits each token was chosen from (the 8-bit re-run on escalated steps; the
            verify pass for verified speculation), or None when not kept.
        escalated: n flags (gated decoding), empty otherwise.
        scores: n gate scores of the 4-bit pass (gated decoding), empty otherwise.
        low_forwards: 4-bit forwards run (each reads a bytes).
        high_forwards: 8-bit forwards run (each reads A bytes).
        rounds: verified speculation rounds as (drafted, accepted) pairs.
    """

    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    escalated: list[bool] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    low_forwards: int = 0
    high_forwards: int = 0
    rounds: list[tuple[int, int]] = field(default_factory=list)

    def weight_bytes_read(self, wb: WeightBytes) -> float:
        """Bytes counted from the forwards actually run: low_forwards*a + high_forwards*A."""
        return self.low_forwards * wb.low + self.high_forwards * wb.high


def _check_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.inference_mode()
def greedy_decode(
    lm: DualLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    precision: str = "high",
    gate: Gate | None = None,
    keep_logits: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Greedy (or sampled) decoding at one precision, or gated (dual-precision.md §3-4).

    Gated step (``gate`` given; ``precision`` ignored):
    1. run the step's tokens (the prompt at step 0, else the last token) at 4 bits; its K/V enter the cache;
    2. score p_lo with the gate (on the untempered softmax, the scale the thresholds are calibrated on);
    3. if score > tau: crop those tokens from the cache and re-run the step at 8 bits, which overwrites
       its K/V, and take the 8-bit logits;
    4. emit the argmax, or at ``temperature`` > 0 a draw from the warped distribution of the step's final
       logits (``draftkit.decoding.sampling``); stop at EOS or after ``max_new_tokens``.

    Args:
        lm: the two-precision target.
        prompt_ids: prompt token ids (chat template applied).
        max_new_tokens: n_max >= 1.
        eos_ids: ids that end generation.
        precision: ``high`` or ``low`` for single-precision decoding.
        gate: the escalation gate, or None.
        keep_logits: keep the (n, V) logits in the trajectory.
        temperature: 0 = greedy; > 0 samples (one draw per step from ``generator``).
        top_p: nucleus cut of the sampled distribution (1 = off).
        top_k: top-k cut of the sampled distribution (0 = off).
        generator: torch RNG of the draws (None = global RNG); unused when greedy.

    Returns:
        :class:`Trajectory`.

    Raises:
        ValueError: if ``max_new_tokens`` < 1 or a sampling option is out of range.
    """
    _check_new_tokens(max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    eos = set(eos_ids)
    first = "low" if gate is not None else precision
    cache = lm.new_cache()
    traj, kept, x = Trajectory(), [], list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = lm.forward(x, cache, first)[-1]  # (V,)
        if first == "low":
            traj.low_forwards += 1
        else:
            traj.high_forwards += 1
        if gate is not None:
            score = float(gate.score(logits))
            escalate = score > gate.threshold
            if escalate:
                cache = lm.rollback(cache, len(x))
                logits = lm.forward(x, cache, "high")[-1]  # (V,), K/V of this step now 8-bit
                traj.high_forwards += 1
            traj.scores.append(score)
            traj.escalated.append(escalate)
        token = int(sample(logits, temperature, top_k, top_p, generator))
        traj.tokens.append(token)
        if keep_logits:
            kept.append(logits)
        if token in eos:
            break
        x = [token]
    if keep_logits:
        traj.logits = torch.stack(kept)  # (n, V)
    return traj


@torch.inference_mode()
def verified_decode(
    lm: DualLM,
    prompt_ids: Sequence[int],
    k: int,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    keep_logits: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Verified speculation: 4-bit drafts, one 8-bit verify pass per round (dual-precision.md §7).

    Steps (Leviathan et al. arXiv 2211.17192; shared-weight drafter as in QSpec arXiv 2410.11305):
    0. prefill the prompt at 8 bits; emit its argmax, or a draw from its warped distribution p_hi (one A read,
       one token);
    1. draft: k 4-bit forwards from the last emitted token give d_1..d_k, each the argmax or a draw from the
       warped 4-bit distribution q_i (stop early at EOS), writing 4-bit K/V that step 2 discards;
    2. verify: crop the drafts' K/V and run [last token, d_1..d_k] at 8 bits -> k+1 distributions p_0..p_k;
    3. accept: greedy (``temperature`` 0) the longest prefix with d_i = argmax p_{i-1}, then the argmax at the
       first mismatch or the bonus token (``draftkit.decoding.speculative.greedy_verify``); sampled,
       rejection sampling: accept d_i with probability min(1, p(d_i) / q(d_i)), else draw from
       norm(max(0, p - q)) (``rejection_verify``). Crop the K/V of rejected drafts; the cache stays all
       8-bit, so greedy output is the all-high output and sampled output is distributed as all-high sampling.

    Args:
        lm: the two-precision target.
        prompt_ids: prompt token ids.
        k: draft tokens per round, >= 1 (fewer near ``max_new_tokens``).
        max_new_tokens: n_max >= 1.
        eos_ids: ids that end generation.
        keep_logits: keep the (n, V) verify logits each token was chosen from.
        temperature: 0 = greedy; > 0 samples drafts and verifies by rejection sampling.
        top_p: nucleus cut applied to both p and q (1 = off).
        top_k: top-k cut applied to both p and q (0 = off).
        generator: torch RNG of the draws (None = global RNG); unused when greedy.

    Returns:
        :class:`Trajectory` with ``rounds`` = [(drafted, accepted), ...] (the prefill is not a round).

    Raises:
        ValueError: if k < 1, ``max_new_tokens`` < 1 or a sampling option is out of range.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    _check_new_tokens(max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    eos, warp = set(eos_ids), (temperature, top_k, top_p)
    cache = lm.new_cache()
    logits = lm.forward(list(prompt_ids), cache, "high")[-1]  # (V,)
    traj = Trajectory(tokens=[int(sample(logits, *warp, generator))], high_forwards=1)
    kept = [logits]
    while len(traj.tokens) < max_new_tokens and traj.tokens[-1] not in eos:
        k_round = min(k, max_new_tokens - len(traj.tokens) - 1)  # drafts + 1 correction/bonus fit the limit
        drafts, q_rows, x = [], [], traj.tokens[-1]
        for _ in range(k_round):
            z = lm.forward([x], cache, "low")[-1]  # (V,)
            if temperature == 0:
                x = int(z.argmax())
            else:
                q_rows.append(probs_from_logits(z, *warp))  # (V,)
                x = int(sample_from_probs(q_rows[-1], generator))
            drafts.append(x)
            traj.low_forwards += 1
            if x in eos:
                break
        cache = lm.rollback(cache, len(drafts))
        verify = lm.forward([traj.tokens[-1], *drafts], cache, "high", logits_to_keep=len(drafts) + 1)  # (m+1, V)
        traj.high_forwards += 1
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=verify.device)  # (m,)
        if temperature == 0:
            accepted, last = greedy_verify(draft_ids, verify)
        else:
            q = torch.stack(q_rows) if q_rows else verify.new_zeros(0, verify.shape[-1])  # (m, V)
            accepted, last = rejection_verify(draft_ids, q, probs_from_logits(verify, *warp), generator)
        cache = lm.rollback(cache, len(drafts) - accepted)
        traj.rounds.append((len(drafts), accepted))
        for j, token in enumerate([*drafts[:accepted], last]):
            traj.tokens.append(token)
            kept.append(verify[j])
            if token in eos:
                break
    if keep_logits:
        traj.logits = torch.stack(kept)  # (n, V)
    return traj


@torch.inference_mode()
def teacher_forced_logits(lm: DualLM, prompt_ids: Sequence[int], tokens: Sequence[int], precision: str) -> torch.Tensor:
    """Logits of every generated position of a fixed trajectory, one cache-free forward at one precision.

    Args:
        prompt_ids: prompt ids.
        tokens: n >= 1 generated ids.
        precision: ``high`` or ``low``.

    Returns:
        (n, V) float32: row t is the distribution that chose ``tokens[t]``, on the exact same prefix.
    """
    seq = [*prompt_ids, *tokens[:-1]]
    return lm.forward(seq, None, precision, logits_to_keep=len(tokens))  # (n, V)


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
    lm: DualLM, prompt_ids: Sequence[int], tokens: Sequence[int], logits_high: torch.Tensor | None = None
) -> tuple[ReplaySteps, torch.Tensor]:
    """Teacher-forced 4-bit and 8-bit forwards over an all-8-bit trajectory; flip labels and gate scores.

    Args:
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


# ----------------------------------------------------------------------------------------------------------
# replay metrics and calibration


def _cat(parts: list[torch.Tensor], idx: torch.Tensor | None = None) -> torch.Tensor:
    chosen = parts if idx is None else [parts[i] for i in idx.tolist()]
    return torch.cat(chosen) if chosen else torch.empty(0)


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
    y = _cat(flips)
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
        s = _cat(parts)
        out[f"auc_{kind}"] = roc_auc(s, y)
        out[f"pr_auc_{kind}"] = pr_auc(s, y)
        out[f"auc_{kind}_ci"] = bootstrap_ci(
            len(steps), lambda idx: roc_auc(_cat(parts, idx), _cat(flips, idx)), bootstrap_samples, seed
        )
        catch[kind] = {key(b): catch_rate(s, y, b) for b in budgets}
        catch_ci[kind] = {
            key(b): bootstrap_ci(
                len(steps), lambda idx, b=b: catch_rate(_cat(parts, idx), _cat(flips, idx), b), bootstrap_samples, seed
            )
            for b in budgets
        }
        lag_s, lag_y = _lagged(steps, kind)
        ls, ly = _cat(lag_s), _cat(lag_y)
        lagged[kind] = {key(b): catch_rate(ls, ly, b) if ls.numel() >= 2 else float("nan") for b in budgets}
        curve[kind] = [catch_rate(s, y, b) for b in curve_budgets]
    out["catch_at_budget"] = catch
    out["catch_at_budget_ci"] = catch_ci
    out["catch_at_budget_lagged"] = lagged
    out["catch_curve"] = curve
    calibrated = {}
    for gate in gates:
        s = _cat([st.scores[gate.kind] for st in steps])
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
    return {kind: Gate(kind, threshold_for_budget(_cat([s.scores[kind] for s in steps]), budget)) for kind in GATES}


# ----------------------------------------------------------------------------------------------------------
# the evaluation


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

    def sampling(self, seed: int) -> dict:
        """Keyword arguments of the decoding loops for one prompt: the warping and a generator at ``seed``."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "generator": torch.Generator().manual_seed(seed)}


def _traj_row(traj: Trajectory) -> dict:
    """A trajectory without its logits, as JSON (the per-prompt record)."""
    return {f.name: getattr(traj, f.name) for f in fields(Trajectory) if f.name != "logits"}


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
            len(kls), lambda idx: float(_cat(kls, idx).double().mean()), samples, seed
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
    lm: DualLM,
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
    and evaluation prompt is appended to ``record`` (JSONL), so a rerun with the same config and prompts
    resumes where an interrupted one stopped.

    Args:
        lm: the two-precision target.
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
        ValueError: on no evaluation prompts, too few calibration steps for a budget, or a ``record`` of a
            different run.
    """
    from draftkit.jsonio import ResumableRecord

    config = config or DualPrecisionConfig()
    if not eval_prompts:
        raise ValueError("no evaluation prompts")
    wb, n_max = lm.bytes, config.max_new_tokens
    run = {k: v for k, v in asdict(config).items() if k not in ("budgets", "bootstrap_samples")}
    header = {"config": run, "weight_bytes": wb.to_dict(), "eos_ids": sorted(eos_ids), **(record_header or {}),
              "eval_prompts": [list(x) for x in eval_prompts], "calib_prompts": [list(x) for x in calib_prompts]}
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
                sampling = config.sampling(config.seed * 100_003 + 50_000 + i)
                traj = greedy_decode(lm, prompt, n_max, eos_ids, "high", keep_logits=False, **sampling)
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
    resumed = sum(rec.get(f"evaluation/{i}") is not None for i in range(len(eval_prompts)))
    for i, prompt in enumerate(eval_prompts):
        if rec.get(f"evaluation/{i}") is not None:
            continue
        row: dict = {"methods": {}, "timing_s": {}}
        seed = config.seed * 100_003 + i
        t = time.perf_counter()
        high = greedy_decode(lm, prompt, n_max, eos_ids, "high", **config.sampling(seed))
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
                traj = greedy_decode(lm, prompt, n_max, eos_ids, "low", **config.sampling(seed))
            elif m == "verified":
                traj = verified_decode(lm, prompt, config.k, n_max, eos_ids, **config.sampling(seed))
            else:
                traj = greedy_decode(lm, prompt, n_max, eos_ids, gate=gates[m[: -len("_gate")]],
                                     **config.sampling(seed))
            exact = traj.tokens == high.tokens
            ref = tf_high if exact else teacher_forced_logits(lm, prompt, traj.tokens, "high")  # (n, V)
            row["methods"][m] = {
                **_traj_row(traj),
                "kl": kl_per_step(ref, traj.logits).tolist(),
                "agree": (ref.argmax(-1) == traj.logits.argmax(-1)).tolist(),
                "exact": exact,
            }
            if m != "all_high":
                row["timing_s"][m] = time.perf_counter() - t
        rec.add(f"evaluation/{i}", row)
        log.info("evaluation prompt %d/%d: %d tokens, %d flips in replay", i + 1, len(eval_prompts),
                 len(high.tokens), int(steps.flip.sum()))
        _progress("evaluation prompt", i + 1, len(eval_prompts), t_eval, resumed)
    rows = [rec.get(f"evaluation/{i}") for i in range(len(eval_prompts))]
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
            rounds = [r for t in rec["trajs"] for r in t.rounds]
            entry["escalation_rate"] = None  # every round ends in an 8-bit verify pass
            entry["k"] = config.k
            entry["verify_passes_per_token"] = entry["high_forwards"] / n_tok
            drafted = [(d, a) for d, a in rounds if d > 0]  # a round without drafts is a plain 8-bit step
            entry["tau"] = sum(a + 1 for _, a in drafted) / len(drafted) if drafted else None
            entry["alpha"] = _chain_acceptance(rounds, config.k)
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


def _chain_acceptance(rounds: list[tuple[int, int]], k: int) -> list[float | None]:
    """alpha_i = P(draft i accepted | drafts 1..i-1 accepted and draft i proposed), i = 1..k."""
    reached, accepted = [0] * k, [0] * k
    for drafted, acc in rounds:
        for i in range(min(drafted, acc + 1)):
            reached[i] += 1
            accepted[i] += int(i < acc)
    return [accepted[i] / reached[i] if reached[i] else None for i in range(k)]
