"""Verification and the round loop: plain autoregressive and chain speculative decoding with a KV cache.

Speculative round (chain of k drafts, arXiv 2211.17192 / 2302.01318, EAGLE3 drafting arXiv 2503.01840):

1. The drafter proposes k tokens d_1..d_k. An EAGLE3 head first feeds its pending step-0 rows (the aux
   hidden states of the positions the target accepted in the previous verify pass, each with the token
   after it), then chains k - 1 single-token steps on its own pre-norm output; it keeps a draft KV cache.
2. The target verifies [x_L, d_1..d_k] in one forward (k + 1 rows, over its own KV cache).
3. Acceptance: greedy (T = 0) takes the longest prefix with d_i = argmax z; sampled (T > 0) runs standard
   rejection sampling with the draft distribution q mapped into the target vocab through d2t: accept
   d_i with probability min(1, p(d_i) / q(d_i)), otherwise draw from norm(max(0, p - q)) and stop.
4. Both caches roll back to the accepted length; the target's correction or bonus token is emitted, so a
   round emits a + 1 tokens. The accepted positions' aux states become the draft's next step-0 rows.

Cache invariant at the start of a round, with the sequence x_0..x_L (x_L emitted, not yet seen by the
target): the target cache holds positions 0..L-1; the draft cache holds step-0 rows 0..p0-1 and the
drafter holds m = L - p0 pending aux rows for positions p0..L-1 (row t reads token x_{t+1}).

The drafters (step 1; the EAGLE3 head and prompt lookup) are in ``draftkit.decoding.drafters``, the target's
KV-cache session (steps 2 and 4) in ``draftkit.target.session``; this module holds the acceptance rules
(step 3) and the loops.

Shapes: T tokens, k drafts per round, n prompt tokens, H draft hidden, H_t target hidden, A number of aux
layers, V target vocab, V_d draft vocab. Batch size is 1 throughout (single-stream latency).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from draftkit.decoding.drafters import Drafter
from draftkit.decoding.metrics import AcceptanceStats, distribution_metrics
from draftkit.precision import synchronize
from draftkit.sampling import DecodeConfig, check_finite_logits, probs_from_logits, sample, sample_from_probs
from draftkit.target.session import TargetSession

__all__ = [
    "GenerationResult",
    "Round",
    "Sync",
    "generate_plain",
    "generate_speculative",
    "generate_uncached",
    "greedy_verify",
    "rejection_verify",
    "speculative_loop",
]


# -- acceptance ---------------------------------------------------------------------------------------------
def greedy_verify(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy acceptance: the longest prefix of drafts equal to the target's argmax.

    Args:
        draft_ids: (k,) int64 target ids.
        target_logits: (k+1, V); row i is the target's prediction after d_1..d_i.

    Returns:
        (a, next token): a accepted drafts and the target's argmax at row a (correction or bonus).

    Raises:
        NonFiniteLogitsError: on NaN/inf target logits (naming the row and vocab id).
    """
    check_finite_logits(target_logits, "target verify logits")
    k = draft_ids.shape[0]
    ids = torch.cat([draft_ids.to(torch.long), target_logits.argmax(-1)]).tolist()  # one copy to the host
    drafts, best = ids[:k], ids[k:]  # k drafts, k+1 target argmaxes
    a = 0
    while a < k and drafts[a] == best[a]:
        a += 1
    return a, best[a]


def rejection_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al., arXiv 2211.17192, Alg. 1; Chen et al., arXiv 2302.01318).

    Steps: for i = 1..k: 1. draw u ~ U[0, 1); 2. accept d_i if u < p_i(d_i) / q_i(d_i); 3. on rejection
    draw the next token from norm(max(0, p_i - q_i)) and stop. If every draft is accepted, draw the bonus
    token from p_{k+1}. The emitted tokens are then distributed exactly as samples from p.

    Args:
        draft_ids: (k,) int64 target ids, d_i drawn from q_i.
        draft_probs: (k, V) q in the target vocab, or None for a deterministic draft (q_i one-hot at d_i).
        target_probs: (k+1, V) float32 target distributions p (already warped).
        generator: RNG.

    Returns:
        (a, next token).
    """
    k = draft_ids.shape[0]
    if k:
        rows = torch.arange(k, device=draft_ids.device)
        p = target_probs[rows, draft_ids]  # (k,)
        q = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones_like(p)  # (k,)
        u = torch.rand(k, generator=generator, device=p.device)
        accept = u * q < p  # u < p/q without dividing; q > 0 because d_i was drawn from q
        a = int(accept.int().cumprod(0).sum())
    else:
        a = 0
    if a == k:
        return a, int(sample_from_probs(target_probs[k], generator))
    if draft_probs is not None:
        residual = (target_probs[a] - draft_probs[a]).clamp_min(0)  # (V,)
    else:
        residual = target_probs[a].clone()
        residual[draft_ids[a]] = 0
    if not residual.sum() > 0:  # p == q: a rejection has probability 0, kept for float round-off
        residual = target_probs[a]
    return a, int(sample_from_probs(residual, generator))


# -- generation loops ---------------------------------------------------------------------------------------
@dataclass
class GenerationResult:
    """One stream's output and counters.

    Attributes:
        tokens: new token ids (prompt excluded), stop token included.
        seconds: wall-clock of the whole call (prefill included; KL collection excluded).
        stats: acceptance per round (speculative only).
        target_forwards: target forwards after the prefill (one per token in plain decoding).
        prefill_seconds, draft_seconds, verify_seconds: time split (speculative: draft vs target verify).
        top2_gaps: plain greedy with ``record_gaps``: target logit gap top1 - top2 at each emitted token.
        weight_bytes: weight bytes read after the prefill (target forwards + draft passes).
        decode_tokens: tokens emitted after the prefill (all but the first).
        stop_reason: ``eos`` or ``length``.
    """

    tokens: list[int]
    seconds: float = 0.0
    stats: AcceptanceStats | None = None
    target_forwards: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    top2_gaps: list[float] | None = None
    weight_bytes: int = 0
    decode_tokens: int = 0
    stop_reason: str = "length"


def _check_prompt(prompt_ids: torch.Tensor, cfg: DecodeConfig, k: int, max_length: int) -> None:
    if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt_ids.shape)}")
    need = prompt_ids.numel() + cfg.max_new_tokens + k
    if need > max_length:
        raise ValueError(
            f"prompt of {prompt_ids.numel()} tokens + max_new_tokens {cfg.max_new_tokens} + k {k} = {need} "
            f"exceeds the target's context window of {max_length} tokens; shorten the prompt or lower max_new_tokens"
        )


def _pick(logits: torch.Tensor, cfg: DecodeConfig, generator) -> torch.Tensor:
    check_finite_logits(logits, "target logits")
    return sample(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator)


Sync = Callable[[Any], Any]
"""A decoding loop's ``sync`` hook: given this rank's decision (a picklable value), return rank 0's, on every rank
(e.g. ``lambda x: trainer.strategy.broadcast(x, src=0)``, a ``torch.distributed.broadcast_object_list`` of one
object). Under a target sharded across the ranks (``trainer.strategy fsdp_target``) every target forward gathers
each layer from all ranks, so every rank must run the same number of forwards on sequences of the same lengths;
their greedy picks may still differ (non-deterministic GPU reductions, other kernels), so the loops apply rank 0's
pick, or rank 0's round (accepted drafts and the target's next token), on every rank. From it follow the cache
lengths, the stop (EOS or ``max_new_tokens``) and the number of forwards: the ranks cannot part. None: a single
process, nothing exchanged."""


@torch.no_grad()
def generate_plain(
    target: TargetSession,
    prompt_ids: torch.Tensor,
    cfg: DecodeConfig,
    generator: torch.Generator | None = None,
    record_gaps: bool = False,
    sync: Sync | None = None,
) -> GenerationResult:
    """Autoregressive decoding with the target's KV cache: one forward per new token.

    Args:
        target: the target session (reset here).
        prompt_ids: (n,) int64 templated prompt.
        cfg: stop and sampling options.
        generator: RNG for sampling.
        record_gaps: record the top-2 logit gap at each emitted token (lossless check).
        sync: every rank emits rank 0's token (:data:`Sync`); None = a single process.

    Returns:
        :class:`GenerationResult`.

    Raises:
        ValueError: on an empty prompt or one that does not fit the context window.
    """
    _check_prompt(prompt_ids, cfg, 0, target.max_length)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt_ids, logits_to_keep=1)
    t_prefill = time.perf_counter() - t0
    tokens, gaps, forwards, stop, t_metrics = [], [], 0, "length", 0.0
    while True:
        z = logits[-1]  # (V,)
        if record_gaps:
            t1 = time.perf_counter()
            top2 = z.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            t_metrics += time.perf_counter() - t1  # measurement, not decoding: kept out of the timings
        x = _pick(z, cfg, generator)
        if sync is not None:
            x = x.new_tensor(sync(int(x)))
        tokens.append(int(x))
        if tokens[-1] in cfg.eos_token_ids:
            stop = "eos"
            break
        if len(tokens) >= cfg.max_new_tokens:
            break
        logits, _ = target.forward(x.view(1))
        forwards += 1
    seconds = time.perf_counter() - t0 - t_metrics
    return GenerationResult(
        tokens, seconds, None, forwards, t_prefill, 0.0, seconds - t_prefill, gaps if record_gaps else None,
        forwards * target.weight_bytes, len(tokens) - 1, stop,
    )


@dataclass
class Round:
    """What one verification round produced; :func:`speculative_loop` emits ``accepted + [next_token]``.

    Attributes:
        accepted: the a accepted draft token ids.
        next_token: the target's correction or bonus token.
        drafted: draft tokens the target verified (k for a chain, N nodes for a tree).
        weight_bytes: weight bytes read by the round (target verify + draft passes).
        draft_seconds, verify_seconds: time split of the round (measurement excluded).
        dist: :func:`~draftkit.decoding.metrics.distribution_metrics` of the round ((drafted,) each), or None.
        sources: (which drafters proposed the round's drafts, which proposed each accepted draft), bit masks of
            ``metrics.HEAD`` and ``metrics.LOOKUP`` (``AcceptanceStats.update``); None = not recorded.
    """

    accepted: list[int]
    next_token: int
    drafted: int
    weight_bytes: int
    draft_seconds: float
    verify_seconds: float
    dist: dict[str, torch.Tensor] | None = None
    sources: tuple[int, list[int]] | None = None


@torch.no_grad()
def speculative_loop(
    target: TargetSession,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    cfg: DecodeConfig,
    play_round,
    max_accept: int,
    generator: torch.Generator | None = None,
    sync: Sync | None = None,
) -> GenerationResult:
    """The round loop shared by chain and tree speculative decoding.

    The first new token comes from the prefill logits; then every round calls ``play_round(seq, L)``,
    which drafts after ``seq[:L+1]``, verifies with one target forward, leaves both caches at the
    accepted length L + a + 1 (the drafter committed with the accepted positions' aux states) and
    returns a :class:`Round`. A round that emits a stop token or reaches ``max_new_tokens`` ends the
    stream (tokens past the stop are dropped). For tau, an accepted draft stop token ends the accepted
    prefix: drafts accepted after it are not counted.

    Args:
        target: the target session (reset here).
        drafter: the drafter (reset here with the prefill's aux states).
        prompt_ids: (n,) int64 templated prompt.
        cfg: stop and sampling options.
        play_round: ``(seq (n + max_new_tokens + max_accept + 1,) int64, L) -> Round``.
        max_accept: most drafts a round can accept (k, or a tree's depth); sizes stats and buffers.
        generator: RNG of the first token's draw.
        sync: every rank takes rank 0's first token (:data:`Sync`; ``play_round`` applies rank 0's rounds);
            None = a single process.

    Returns:
        :class:`GenerationResult` with ``stats`` filled.

    Raises:
        ValueError: on an empty prompt or one that does not fit the context window.
    """
    _check_prompt(prompt_ids, cfg, max_accept, target.max_length)
    t0 = time.perf_counter()
    n = prompt_ids.shape[0]
    seq = prompt_ids.new_zeros(n + cfg.max_new_tokens + max_accept + 1)  # prompt + output (+ one round of slack)
    seq[:n] = prompt_ids
    target.reset()
    logits, aux = target.forward(prompt_ids, logits_to_keep=1)
    x = _pick(logits[-1], cfg, generator)
    if sync is not None:
        x = x.new_tensor(sync(int(x)))
    drafter.reset(prompt_ids, aux)
    t_prefill = time.perf_counter() - t0
    seq[n] = x
    L = n  # seq[:L+1] is known; the target cache holds L positions
    tokens = [int(x)]
    stats = AcceptanceStats(max_accept)
    t_draft = t_verify = t_metrics = 0.0
    forwards = bytes_read = 0
    stop = "eos" if tokens[0] in cfg.eos_token_ids else "length"
    done = stop == "eos" or cfg.max_new_tokens == 1
    while not done:
        t1 = time.perf_counter()
        r = play_round(seq, L)
        # what the round spent outside drafting and verifying is measurement (KL), kept out of the timings
        t_metrics += time.perf_counter() - t1 - r.draft_seconds - r.verify_seconds
        t_draft += r.draft_seconds
        t_verify += r.verify_seconds
        forwards += 1
        bytes_read += r.weight_bytes
        a = len(r.accepted)
        emitted = r.accepted + [r.next_token]
        counted = a
        for i, t in enumerate(emitted):
            tokens.append(t)
            if t in cfg.eos_token_ids:
                counted, stop, done = min(a, i + 1), "eos", True
                break
            if len(tokens) >= cfg.max_new_tokens:
                done = True
                break
        stats.update(counted, r.drafted, r.dist, r.sources)
        seq[L + 1:L + 2 + a] = torch.tensor(emitted, dtype=seq.dtype, device=seq.device)
        L += a + 1
    seconds = time.perf_counter() - t0 - t_metrics
    return GenerationResult(
        tokens, seconds, stats, forwards, t_prefill, t_draft, t_verify, None, bytes_read, len(tokens) - 1, stop,
    )


@torch.no_grad()
def generate_speculative(
    target: TargetSession,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    k: int,
    cfg: DecodeConfig,
    generator: torch.Generator | None = None,
    collect_kl: bool = False,
    sync: Sync | None = None,
) -> GenerationResult:
    """Chain speculative decoding (see the module docstring for the round and the cache invariant).

    Every round costs k draft passes and one target forward over k+1 tokens; the loop around the rounds
    is :func:`speculative_loop`.

    Args:
        target: the target session (reset here).
        drafter: an :class:`Eagle3Drafter`, :class:`PromptLookupDrafter` or any :class:`Drafter`.
        prompt_ids: (n,) int64 templated prompt.
        k: draft tokens per round (>= 1).
        cfg: stop and sampling options.
        generator: RNG for sampling (draft draws, acceptance draws and corrections share it).
        collect_kl: record the distribution metrics per draft position (KL on the draft vocab, target mass
            outside it, expected acceptance; ``decoding.metrics.distribution_metrics``); needs a drafter that
            returns logits.
        sync: every rank applies rank 0's first token and rounds (:data:`Sync`); a rank whose own drafts or picks
            differed keeps its cache lengths in step with rank 0's, and its output and ``stats`` are rank 0's
            (its distribution metrics stay its own). None = a single process.

    Returns:
        :class:`GenerationResult` with ``stats`` filled.

    Raises:
        ValueError: if k < 1, or on an empty prompt or one that does not fit the context window.
    """
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")

    def chain_round(seq: torch.Tensor, L: int) -> Round:
        t1 = time.perf_counter()
        draft = drafter.propose(seq[:L + 1], k, cfg, generator)
        synchronize(seq.device)  # the draft's kernels finish inside the draft time (CUDA runs them asynchronously)
        t2 = time.perf_counter()
        kd = draft.ids.shape[0]
        logits, aux = target.forward(torch.cat([seq[L:L + 1], draft.ids]))  # (kd+1, V), (kd+1, A*H_t)
        if cfg.greedy:
            a, nxt = greedy_verify(draft.ids, logits)
        else:
            p = probs_from_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # (kd+1, V)
            a, nxt = rejection_verify(draft.ids, draft.probs, p, generator)
        accepted = draft.ids[:a].tolist()
        if sync is not None:  # rank 0's round on every rank, before the caches roll back (see Sync)
            accepted, nxt = sync((accepted, nxt))
            a = len(accepted)
        target.crop(L + a + 1)
        drafter.commit(aux[:a + 1])
        synchronize(seq.device)
        t3 = time.perf_counter()
        dist = None
        if collect_kl and draft.logits is not None:  # measurement: its copy to the host waits here, outside the timings
            dist = {name: v.cpu() for name, v in distribution_metrics(logits[:kd], draft.logits, draft.t2d).items()}
        bytes_read = target.weight_bytes + drafter.round_bytes(kd)
        return Round(accepted, nxt, kd, bytes_read, t2 - t1, t3 - t2, dist)

    return speculative_loop(target, drafter, prompt_ids, cfg, chain_round, k, generator, sync)


@torch.no_grad()
def generate_uncached(target, prompt_ids: torch.Tensor, cfg: DecodeConfig, generator: torch.Generator | None = None) -> list[int]:
    """Reference decoding without a KV cache: the whole sequence is re-run for every new token.

    Args:
        target: a ``FrozenTarget``.
        prompt_ids: (n,) int64.
        cfg: stop and sampling options.
        generator: RNG (draws in the same order as :func:`generate_plain`).

    Returns:
        New token ids.
    """
    seq = prompt_ids.clone()
    tokens = []
    while True:
        z = target(seq[None]).logits[0, -1].float()  # (V,)
        x = _pick(z, cfg, generator)
        tokens.append(int(x))
        if tokens[-1] in cfg.eos_token_ids or len(tokens) >= cfg.max_new_tokens:
            return tokens
        seq = torch.cat([seq, x.view(1)])  # (n + len(tokens),)
