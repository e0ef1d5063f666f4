"""Decoding loops of a two-precision target: single precision, gated, verified speculation, teacher forcing.

Definitions: docs/dual-precision.md §3-4 (gated steps, KV drift) and §7 (verified speculation:
self-speculation with shared weights, QSpec arXiv 2410.11305, QuantSpec arXiv 2502.10424; greedy or by
rejection sampling, arXiv 2211.17192). The prompt forward is step 0 of every loop and counts as one weight
read; every loop runs on one ``draftkit.target.session.TargetSession`` with a precision switch (its cache
restarts with each call, and a step's precision is the forward's ``precision``); the token limit, the stop
ids and the sampling options come in one
``draftkit.sampling.DecodeConfig``; sampling (T > 0) draws from the warped distribution of the
logits a step ends with (``draftkit.sampling``), and the accept rules are those of
``draftkit.decoding.verify``.

Shapes: n generated tokens, V target vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from draftkit.sampling import probs_from_logits, sample, sample_from_probs
from draftkit.decoding.verify import greedy_verify, rejection_verify
from draftkit.sampling import DecodeConfig
from draftkit.dual_precision.gates import Gate
from draftkit.quant import WeightBytes
from draftkit.target.session import TargetSession

__all__ = ["Trajectory", "greedy_decode", "teacher_forced_logits", "verified_decode"]


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


@torch.inference_mode()
def greedy_decode(
    lm: TargetSession,
    prompt_ids: Sequence[int],
    cfg: DecodeConfig,
    precision: str = "high",
    gate: Gate | None = None,
    keep_logits: bool = True,
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Greedy (or sampled) decoding at one precision, or gated (dual-precision.md §3-4).

    Gated step (``gate`` given; ``precision`` ignored):
    1. run the step's tokens (the prompt at step 0, else the last token) at 4 bits; its K/V enter the cache;
    2. score p_lo with the gate (on the untempered softmax, the scale the thresholds are calibrated on);
    3. if score > tau: crop those tokens from the cache and re-run the step at 8 bits, which overwrites
       its K/V, and take the 8-bit logits;
    4. emit the argmax, or at ``cfg.temperature`` > 0 a draw from the warped distribution of the step's final
       logits (``draftkit.sampling``); stop at an id of ``cfg.eos_token_ids`` or after
       ``cfg.max_new_tokens``.

    Args:
        lm: the session of the two-precision target (``TargetSession.with_precision_switch``).
        prompt_ids: prompt token ids (chat template applied).
        cfg: n_max (``max_new_tokens``), the ids that end generation (``eos_token_ids``, kept in the output)
            and the sampling: ``temperature`` 0 = greedy, > 0 one draw per step from ``generator``; ``top_p``
            and ``top_k`` cut the sampled distribution.
        precision: ``high`` or ``low`` for single-precision decoding.
        gate: the escalation gate, or None.
        keep_logits: keep the (n, V) logits in the trajectory.
        generator: torch RNG of the draws (None = global RNG); unused when greedy.

    Returns:
        :class:`Trajectory`.

    Raises:
        nothing of its own: ``DecodeConfig`` refuses ``max_new_tokens`` < 1 and out-of-range sampling options
        (ValueError) when it is built.
    """
    eos = set(cfg.eos_token_ids)
    first = "low" if gate is not None else precision
    lm.reset()
    traj, kept, x = Trajectory(), [], list(prompt_ids)
    for _ in range(cfg.max_new_tokens):
        logits = lm.forward(x, 1, precision=first)[0][-1]  # (V,)
        if first == "low":
            traj.low_forwards += 1
        else:
            traj.high_forwards += 1
        if gate is not None:
            score = float(gate.score(logits))
            escalate = score > gate.threshold
            if escalate:
                lm.crop(lm.length - len(x))
                logits = lm.forward(x, 1, precision="high")[0][-1]  # (V,), K/V of this step now 8-bit
                traj.high_forwards += 1
            traj.scores.append(score)
            traj.escalated.append(escalate)
        token = int(sample(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator))
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
    lm: TargetSession,
    prompt_ids: Sequence[int],
    k: int,
    cfg: DecodeConfig,
    keep_logits: bool = True,
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Verified speculation: 4-bit drafts, one 8-bit verify pass per round (dual-precision.md §7).

    Steps (Leviathan et al. arXiv 2211.17192; shared-weight drafter as in QSpec arXiv 2410.11305):
    0. prefill the prompt at 8 bits; emit its argmax, or a draw from its warped distribution p_hi (one A read,
       one token);
    1. draft: k 4-bit forwards from the last emitted token give d_1..d_k, each the argmax or a draw from the
       warped 4-bit distribution q_i (stop early at EOS), writing 4-bit K/V that step 2 discards;
    2. verify: crop the drafts' K/V and run [last token, d_1..d_k] at 8 bits -> k+1 distributions p_0..p_k;
    3. accept: greedy (``cfg.temperature`` 0) the longest prefix with d_i = argmax p_{i-1}, then the argmax at the
       first mismatch or the bonus token (``draftkit.decoding.verify.greedy_verify``); sampled,
       rejection sampling: accept d_i with probability min(1, p(d_i) / q(d_i)), else draw from
       norm(max(0, p - q)) (``rejection_verify``). Crop the K/V of rejected drafts; the cache stays all
       8-bit, so greedy output is the all-high output and sampled output is distributed as all-high sampling.

    Args:
        lm: the session of the two-precision target (``TargetSession.with_precision_switch``).
        prompt_ids: prompt token ids.
        k: draft tokens per round, >= 1 (fewer near ``cfg.max_new_tokens``).
        cfg: n_max (``max_new_tokens``), the ids that end generation (``eos_token_ids``, kept in the output)
            and the sampling: ``temperature`` 0 = greedy, > 0 samples drafts and verifies by rejection
            sampling; ``top_p`` and ``top_k`` cut both p and q.
        keep_logits: keep the (n, V) verify logits each token was chosen from.
        generator: torch RNG of the draws (None = global RNG); unused when greedy.

    Returns:
        :class:`Trajectory` with ``rounds`` = [(drafted, accepted), ...] (the prefill is not a round).

    Raises:
        ValueError: if k < 1 (``DecodeConfig`` refuses ``max_new_tokens`` < 1 and out-of-range sampling
            options when it is built).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    eos, warp, max_new_tokens = set(cfg.eos_token_ids), (cfg.temperature, cfg.top_k, cfg.top_p), cfg.max_new_tokens
    lm.reset()
    logits = lm.forward(list(prompt_ids), 1, precision="high")[0][-1]  # (V,)
    traj = Trajectory(tokens=[int(sample(logits, *warp, generator))], high_forwards=1)
    kept = [logits]
    while len(traj.tokens) < max_new_tokens and traj.tokens[-1] not in eos:
        k_round = min(k, max_new_tokens - len(traj.tokens) - 1)  # drafts + 1 correction/bonus fit the limit
        drafts, q_rows, x = [], [], traj.tokens[-1]
        for _ in range(k_round):
            z = lm.forward([x], 1, precision="low")[0][-1]  # (V,)
            if cfg.greedy:
                x = int(z.argmax())
            else:
                q_rows.append(probs_from_logits(z, *warp))  # (V,)
                x = int(sample_from_probs(q_rows[-1], generator))
            drafts.append(x)
            traj.low_forwards += 1
            if x in eos:
                break
        lm.crop(lm.length - len(drafts))
        verify, _ = lm.forward([traj.tokens[-1], *drafts], len(drafts) + 1, precision="high")  # (m+1, V)
        traj.high_forwards += 1
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=verify.device)  # (m,)
        if cfg.greedy:
            accepted, last = greedy_verify(draft_ids, verify)
        else:
            q = torch.stack(q_rows) if q_rows else verify.new_zeros(0, verify.shape[-1])  # (m, V)
            accepted, last = rejection_verify(draft_ids, q, probs_from_logits(verify, *warp), generator)
        lm.crop(lm.length - (len(drafts) - accepted))
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
def teacher_forced_logits(
    lm: TargetSession, prompt_ids: Sequence[int], tokens: Sequence[int], precision: str
) -> torch.Tensor:
    """Logits of every generated position of a fixed trajectory, one forward at one precision from an empty
    cache (the session is reset before and after).

    Args:
        lm: the session of the two-precision target.
        prompt_ids: prompt ids.
        tokens: n >= 1 generated ids.
        precision: ``high`` or ``low``.

    Returns:
        (n, V) float32: row t is the distribution that chose ``tokens[t]``, on the exact same prefix.
    """
    seq = [*prompt_ids, *tokens[:-1]]
    lm.reset()
    logits, _ = lm.forward(seq, len(tokens), precision=precision)  # (n, V)
    lm.reset()
    return logits
