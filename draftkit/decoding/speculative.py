"""Single-stream decoding with a KV cache: plain autoregressive and chain speculative decoding.

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

Prompt lookup (n-gram) drafting runs in the same loop as a baseline (Saxena 2023, Hugging Face
``PromptLookupCandidateGenerator``; vLLM ``ngram``).

Shapes: T tokens, k drafts per round, n prompt tokens, H draft hidden, H_t target hidden, A number of aux
layers, V target vocab, V_d draft vocab. Batch size is 1 throughout (single-stream latency).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from draftkit.decoding.metrics import AcceptanceStats, distribution_metrics
from draftkit.sampling import (
    DecodeConfig,
    check_finite_logits,
    check_sampling,
    probs_from_logits,
    sample,
    sample_from_probs,
)
from draftkit.heads.eagle3_llama import Eagle3LlamaHead, KVCache

__all__ = [
    "DecodeConfig",
    "Draft",
    "Drafter",
    "Eagle3Drafter",
    "GenerationResult",
    "PromptLookupDrafter",
    "Round",
    "TargetSession",
    "generate_plain",
    "generate_speculative",
    "generate_uncached",
    "greedy_verify",
    "rejection_verify",
    "speculative_loop",
    "weight_bytes",
]


def weight_bytes(module: torch.nn.Module, exclude: tuple[str, ...] = ()) -> int:
    """Bytes of the (deduplicated) parameters of ``module`` whose names do not start with ``exclude``."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith(exclude))


# -- target -------------------------------------------------------------------------------------------------
class TargetSession:
    """One decoding stream of a ``FrozenTarget`` over a Hugging Face KV cache.

    Args:
        target: a ``draftkit.target.frozen.FrozenTarget``.
    """

    def __init__(self, target) -> None:
        self.target = target
        self.cache = None
        self.length = 0
        # {n: m}: a forward over n new rows runs m > n rows (dummy rows after the real ones, dropped again);
        # set from ``decoding.cost.CostTable.padding`` where a kernel makes m rows cheaper than n
        self.pad_rows: dict[int, int] = {}
        model = target.model
        tied = model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
        embed = model.get_input_embeddings().weight
        # an untied input embedding is a row gather, not a weight read
        self.weight_bytes = weight_bytes(model) - (0 if tied else embed.numel() * embed.element_size())

    @property
    def max_length(self) -> int:
        """Context window in tokens (``max_position_embeddings``)."""
        return int(getattr(self.target.config, "max_position_embeddings", 1 << 30))

    def reset(self) -> None:
        self.cache = None
        self.length = 0

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        last_only: bool = False,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the cache by T tokens.

        Args:
            input_ids: (T,) int64 tokens, by default at positions length..length+T-1.
            last_only: compute the LM head for the last row only (prefill).
            position_ids: (T,) int64 RoPE positions (tree verification), or None for the default.
            attn_mask: (T, length+T) bool, True where a new row may attend (a tree mask over the cache),
                or None for causal attention.

        Returns:
            logits (T, V) float32 (or (1, V) with ``last_only``) and aux (T, A*H_t) in the target dtype.

        With T in ``pad_rows`` (and not ``last_only``) the forward runs ``pad_rows[T] - T`` dummy rows after the
        real ones (the last token again, attending to the cache and itself; no real row attends to them) and
        crops them from the cache, so the result and the cache are those of the unpadded forward.
        """
        T = input_ids.shape[0]
        pad = 0 if last_only else self.pad_rows.get(T, T) - T
        if pad > 0:
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad)])
            if position_ids is not None:
                position_ids = torch.cat([position_ids, position_ids[-1:].expand(pad)])
            if attn_mask is not None:
                full = attn_mask.new_zeros(T + pad, attn_mask.shape[1] + pad)
                full[:T, :-pad] = attn_mask
                full[T:, :self.length] = True
                full[T:, -pad:] = torch.eye(pad, dtype=torch.bool, device=attn_mask.device)
                attn_mask = full
        mask = None
        if attn_mask is not None:
            # a 4-D mask reaches the attention as-is (transformers ``masking_utils``); additive, so that
            # both the eager and the SDPA kernels read it
            dtype = self.target.model.dtype
            mask = torch.zeros(attn_mask.shape, dtype=dtype, device=input_ids.device)
            mask = mask.masked_fill(~attn_mask, torch.finfo(dtype).min)[None, None]  # (1, 1, T, length+T)
        pos = None if position_ids is None else position_ids[None]
        out = self.target(
            input_ids[None], attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True,
            compute_logits=not last_only,
        )
        self.cache = out.cache
        self.length += input_ids.shape[0]
        if last_only:
            logits = self.target.model.get_output_embeddings()(out.last_hidden_state[:, -1:])  # (1, 1, V)
        else:
            logits = out.logits[:, :T]  # (1, T, V)
        if pad > 0:
            self.crop(self.length - pad)
        return logits[0].float(), out.aux_hidden_states[0, :T]

    def crop(self, length: int) -> None:
        """Roll the cache back to its first ``length`` positions."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if drop:
            self.cache.crop(-drop)  # transformers 5: a negative count removes that many positions
            self.length = length

    def keep(self, rows: torch.Tensor) -> None:
        """Compact the cache to the given positions, in order (a tree's accepted path).

        Args:
            rows: (R,) int64 ascending cache rows to keep; row i of the new cache is old row ``rows[i]``.
        """
        for layer in self.cache.layers:  # transformers 5 ``DynamicLayer``: keys/values (B, A_kv, S, d)
            layer.keys = layer.keys.index_select(-2, rows)
            layer.values = layer.values.index_select(-2, rows)
        self.length = rows.shape[0]


# -- drafters -----------------------------------------------------------------------------------------------
@dataclass
class Draft:
    """One round's proposal.

    Attributes:
        ids: (k',) int64 target ids, k' <= k (prompt lookup may propose fewer, even none).
        probs: (k', V) float32 draft distribution each d_i was drawn from, in the target vocab; None for a
            deterministic draft (greedy, or prompt lookup: q is one-hot at d_i).
        logits: (k', V_d) raw draft logits (for KL), or None.
        t2d: (V,) bool draft-vocab membership (for KL), or None.
    """

    ids: torch.Tensor
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    t2d: torch.Tensor | None = None


class Drafter(Protocol):
    """What the speculative loop needs from a drafter."""

    def reset(self, prompt_ids: torch.Tensor, aux: torch.Tensor) -> None:
        """Start a stream: prompt (n,) and the target's prefill aux states (n, A*H_t)."""

    def propose(self, tokens: torch.Tensor, k: int, cfg: DecodeConfig, generator: torch.Generator | None) -> Draft:
        """Draft up to k tokens after ``tokens`` (L+1,), the whole sequence so far."""

    def commit(self, aux: torch.Tensor) -> None:
        """The target accepted a+1 new positions; aux (a+1, A*H_t) are their aux states."""

    def round_bytes(self, drafted: int) -> int:
        """Weight bytes read to draft ``drafted`` tokens in one round."""


class Eagle3Drafter:
    """Chain drafting with an EAGLE3 head and its own KV cache (eagle3-format.md §3).

    Args:
        head: an :class:`Eagle3LlamaHead` in eval mode, with ``embed_tokens`` loaded from the target.
    """

    def __init__(self, head: Eagle3LlamaHead) -> None:
        self.head = head
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        cfg = head.config
        self.draft_target_ids = torch.arange(cfg.draft_vocab_size, device=self.device) + head.d2t  # (V_d,)
        self.vocab_size = cfg.vocab_size
        self.cache = KVCache()
        self.pending: torch.Tensor | None = None
        fc = weight_bytes(head.fc)
        chain = weight_bytes(head, exclude=("embed_tokens.", "fc.", "rotary_emb."))
        self._first_bytes, self._chain_bytes = fc + chain, chain

    def round_bytes(self, drafted: int) -> int:
        """``fc`` once (on the pending rows) plus the layer, norm and ``lm_head`` per draft token."""
        return self._first_bytes + (drafted - 1) * self._chain_bytes if drafted else 0

    def reset(self, prompt_ids: torch.Tensor, aux: torch.Tensor) -> None:
        self.cache = KVCache()
        self.pending = aux

    def commit(self, aux: torch.Tensor) -> None:
        self.pending = aux

    def feed_pending(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the m pending step-0 rows (tokens x_{p0+1..p0+m}, features fc(aux)) at positions p0..p0+m-1.

        Args:
            tokens: (L+1,) the sequence so far; L = p0 + m.

        Returns:
            logits (V_d,) of the last row (the distribution of d_1) and its pre-norm output h (1, 1, H).

        Raises:
            RuntimeError: if the draft cache and pending rows do not cover ``tokens``.
        """
        p0, m = self.cache.length, self.pending.shape[0]
        if tokens.shape[0] != p0 + m + 1:
            raise RuntimeError(f"draft state out of sync: {p0} cached + {m} pending rows for {tokens.shape[0]} tokens")
        feature = self.head.project(self.pending.to(self.dtype)[None])  # (1, m, A*H_t) -> (1, m, H)
        self.pending = None
        return self._step(tokens[p0 + 1:], feature, p0)

    def _step(self, ids: torch.Tensor, feature: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head on T new rows over the draft cache; return the last row's logits (V_d,) and h (1, 1, H)."""
        pos = torch.arange(start, start + ids.shape[0], device=self.device)[None]  # (1, T)
        logits, h = self.head(ids[None], feature, pos, self.cache, last_only=True)  # (1, 1, V_d), (1, 1, H)
        return logits[0, 0], h

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, k: int, cfg: DecodeConfig, generator: torch.Generator | None) -> Draft:
        """Draft k tokens.

        Steps: 1. feed the m pending rows (tokens x_{p0+1..p0+m}, features fc(aux)) at positions p0..p0+m-1;
        2. pick d_1 from the last row; 3. for j = 1..k-1 feed (d_j, previous h) at position p0+m+j-1 and
        pick d_{j+1}; 4. crop the draft cache back to its p0+m step-0 rows.

        Args:
            tokens: (L+1,) the sequence so far; L = p0 + m.
            k: draft length (>= 1).
            cfg: sampling options (the draft is warped like the target).
            generator: RNG for sampled drafts.

        Returns:
            :class:`Draft` with k target ids, q in the target vocab when sampling, and the raw logits.
        """
        L = tokens.shape[0] - 1
        z, h = self.feed_pending(tokens)
        ids, logits, probs = [], [], []
        for j in range(k):
            check_finite_logits(z, f"draft logits at draft position {j + 1}")
            logits.append(z)
            if cfg.greedy:
                d = z.argmax()
            else:
                q = probs_from_logits(z, cfg.temperature, cfg.top_k, cfg.top_p)  # (V_d,)
                d = sample_from_probs(q, generator)
                probs.append(q)
            t = self.draft_target_ids[d]
            ids.append(t)
            if j + 1 < k:
                z, h = self._step(t.view(1), h, L + j)
        self.cache.crop(L)
        draft_ids = torch.stack(ids)  # (k,)
        q_full = None
        if probs:
            q_full = torch.zeros(k, self.vocab_size, device=self.device)
            q_full[:, self.draft_target_ids] = torch.stack(probs)  # (k, V_d) -> (k, V)
        return Draft(draft_ids, q_full, torch.stack(logits), self.head.t2d)


class PromptLookupDrafter:
    """Prompt-lookup (n-gram) drafting: copy what followed an earlier occurrence of the sequence's suffix.

    Tries suffix lengths ``max_ngram`` down to ``min_ngram``; among the earlier occurrences it takes the
    latest one followed by k tokens, else the earliest; proposes nothing when no suffix recurs.

    Args:
        max_ngram: longest suffix matched.
        min_ngram: shortest suffix matched (>= 1).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def reset(self, prompt_ids: torch.Tensor, aux: torch.Tensor) -> None:
        pass

    def commit(self, aux: torch.Tensor) -> None:
        pass

    def round_bytes(self, drafted: int) -> int:
        return 0

    def propose(self, tokens: torch.Tensor, k: int, cfg: DecodeConfig, generator: torch.Generator | None) -> Draft:
        """Up to k tokens that followed an earlier match of the last n tokens (empty when none)."""
        L = tokens.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = tokens[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram with a continuation
            hits = (windows == tokens[-n:]).all(-1).nonzero()[:, 0]
            if hits.numel():
                # the latest match that still has k tokens after it, else the earliest (longest continuation)
                full = hits[hits <= L - n - k]
                start = int(full[-1] if full.numel() else hits[0]) + n
                return Draft(tokens[start:start + k].clone())
        return Draft(tokens.new_zeros(0))


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
    best = target_logits.argmax(-1)  # (k+1,)
    k = draft_ids.shape[0]
    a = int((draft_ids == best[:k]).int().cumprod(0).sum()) if k else 0
    return a, int(best[a])


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


@torch.no_grad()
def generate_plain(
    target: TargetSession,
    prompt_ids: torch.Tensor,
    cfg: DecodeConfig,
    generator: torch.Generator | None = None,
    record_gaps: bool = False,
) -> GenerationResult:
    """Autoregressive decoding with the target's KV cache: one forward per new token.

    Args:
        target: the target session (reset here).
        prompt_ids: (n,) int64 templated prompt.
        cfg: stop and sampling options.
        generator: RNG for sampling.
        record_gaps: record the top-2 logit gap at each emitted token (lossless check).

    Returns:
        :class:`GenerationResult`.

    Raises:
        ValueError: on an empty prompt or one that does not fit the context window.
    """
    _check_prompt(prompt_ids, cfg, 0, target.max_length)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt_ids, last_only=True)
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
    """

    accepted: list[int]
    next_token: int
    drafted: int
    weight_bytes: int
    draft_seconds: float
    verify_seconds: float
    dist: dict[str, torch.Tensor] | None = None


@torch.no_grad()
def speculative_loop(
    target: TargetSession,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    cfg: DecodeConfig,
    play_round,
    max_accept: int,
    generator: torch.Generator | None = None,
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
    logits, aux = target.forward(prompt_ids, last_only=True)
    x = _pick(logits[-1], cfg, generator)
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
        stats.update(counted, r.drafted, r.dist)
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
        t2 = time.perf_counter()
        kd = draft.ids.shape[0]
        logits, aux = target.forward(torch.cat([seq[L:L + 1], draft.ids]))  # (kd+1, V), (kd+1, A*H_t)
        if cfg.greedy:
            a, nxt = greedy_verify(draft.ids, logits)
        else:
            p = probs_from_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # (kd+1, V)
            a, nxt = rejection_verify(draft.ids, draft.probs, p, generator)
        target.crop(L + a + 1)
        drafter.commit(aux[:a + 1])
        t3 = time.perf_counter()
        dist = None
        if collect_kl and draft.logits is not None:
            dist = distribution_metrics(logits[:kd], draft.logits, draft.t2d)
        bytes_read = target.weight_bytes + drafter.round_bytes(kd)
        return Round(draft.ids[:a].tolist(), nxt, kd, bytes_read, t2 - t1, t3 - t2, dist)

    return speculative_loop(target, drafter, prompt_ids, cfg, chain_round, k, generator)


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
