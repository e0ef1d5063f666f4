"""Drafters: what proposes a speculative round's k tokens.

- :class:`Eagle3Drafter`: chain drafting with an EAGLE3 head and its own KV cache (EAGLE3, arXiv 2503.01840;
  eagle3-format.md §3). It first feeds its pending step-0 rows (the aux hidden states of the positions the
  target accepted in the previous verify pass, each with the token after it), then chains k - 1
  single-token steps on its own pre-norm output.
- :class:`PromptLookupDrafter`: prompt-lookup (n-gram) drafting, the baseline (Saxena 2023, Hugging Face
  ``PromptLookupCandidateGenerator``; vLLM ``ngram``).

A new drafter is a class with the :class:`Drafter` protocol; the loops of ``draftkit.decoding.verify`` and the
harness run it unchanged.

Shapes: k drafts per round, n prompt tokens, L + 1 tokens so far, H draft hidden, H_t target hidden, A number
of aux layers, V target vocab, V_d draft vocab. Batch size is 1 throughout (single-stream latency).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftkit.heads.eagle3_llama import Eagle3LlamaHead, KVCache
from draftkit.quant.bytes import param_bytes
from draftkit.sampling import DecodeConfig, check_finite_logits, probs_from_logits, sample_from_probs

__all__ = ["Draft", "Drafter", "Eagle3Drafter", "PromptLookupDrafter"]


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
        fc = param_bytes(head.fc)
        chain = param_bytes(head, exclude=("embed_tokens.", "fc.", "rotary_emb."))
        self._first_bytes, self._chain_bytes = fc + chain, chain

    def round_bytes(self, drafted: int) -> int:
        """``fc`` once (on the pending rows) plus the layer, norm and ``lm_head`` per draft token."""
        return self._first_bytes + (drafted - 1) * self._chain_bytes if drafted else 0

    def reset(self, prompt_ids: torch.Tensor, aux: torch.Tensor) -> None:
        self.cache = KVCache()
        self.pending = aux

    def commit(self, aux: torch.Tensor) -> None:
        """The target accepted a + 1 positions; aux (a+1, A*H_t) become step-0 rows.

        When the head did not draft the round (a hybrid round drafted by prompt lookup alone,
        ``decoding.tree``), its pending rows were not fed: the new rows join them, so the next
        :meth:`feed_pending` still gives every accepted position its own target features.
        """
        self.pending = aux if self.pending is None else torch.cat([self.pending, aux])  # (m + a + 1, A*H_t)

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
            logits.append(z)
            # checked after the loop: a check here would wait for the device at every token
            if cfg.greedy:
                d = z.argmax()
            else:  # a non-finite row samples from flat logits until the check refuses the round (a NaN in
                # multinomial would stop a CUDA device)
                safe = torch.where(torch.isfinite(z).all(), z, torch.zeros_like(z))
                q = probs_from_logits(safe, cfg.temperature, cfg.top_k, cfg.top_p, check=False)  # (V_d,)
                d = sample_from_probs(q, generator)
                probs.append(q)
            t = self.draft_target_ids[d.view(1)]  # (1,): a tensor index (a 0-d one would be read to the host)
            ids.append(t)
            if j + 1 < k:
                z, h = self._step(t, h, L + j)
        self.cache.crop(L)
        stacked = torch.stack(logits)  # (k, V_d)
        if not bool(torch.isfinite(stacked).all()):  # one host sync a round, not one a token
            for j, z in enumerate(logits):
                check_finite_logits(z, f"draft logits at draft position {j + 1}")
        draft_ids = torch.cat(ids)  # (k,)
        q_full = None
        if probs:
            q_full = torch.zeros(k, self.vocab_size, device=self.device)
            q_full[:, self.draft_target_ids] = torch.stack(probs)  # (k, V_d) -> (k, V)
        return Draft(draft_ids, q_full, stacked, self.head.t2d)


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

    def describe(self) -> str:
        """The match rule in words, for reports (e.g. ``suffix of 3, then 2 tokens``)."""
        lengths = ", then ".join(str(n) for n in range(self.max_ngram, self.min_ngram - 1, -1))
        return f"suffix of {lengths} tokens"

    def reset(self, prompt_ids: torch.Tensor, aux: torch.Tensor) -> None:
        pass

    def commit(self, aux: torch.Tensor) -> None:
        pass

    def round_bytes(self, drafted: int) -> int:
        return 0

    def propose(self, tokens: torch.Tensor, k: int, cfg: DecodeConfig, generator: torch.Generator | None) -> Draft:
        """Up to k tokens that followed an earlier match of the last n tokens (empty when none)."""
        return Draft(self.continuation(tokens, k))

    def continuation(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """(k',) int64, k' <= k: what followed an earlier match of the suffix of ``tokens`` (L+1,); empty when
        no suffix of ``min_ngram`` or more tokens recurs."""
        L = tokens.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = tokens[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram with a continuation
            hits = (windows == tokens[-n:]).all(-1).nonzero()[:, 0]
            if hits.numel():
                # the latest match that still has k tokens after it, else the earliest (longest continuation)
                full = hits[hits <= L - n - k]
                start = int(full[-1] if full.numel() else hits[0]) + n
                return tokens[start:start + k].clone()
        return tokens.new_zeros(0)
