"""Decode-speed benchmark: plain tokens/s, per-round cost of chain speculation, and speedup at a set acceptance.

The library half of ``draftkit bench decode --target REF [--checkpoint HEAD] --dtype '[float32]' --k 5``; the
command loads the target and the head (``draftkit.commands.bench``).

For each prompt, in this order (so that machine load hits all alike):

1. plain greedy decoding with the target's KV cache (the reference output and the baseline time), and
   Hugging Face ``generate()`` on the same model, ids and dtype (greedy, KV cache, exactly ``max_new_tokens``):
   ``plain_vs_hf_generate`` is draftkit's plain tokens/s over HF's, ``hf_outputs_equal_plain`` the prompts
   whose two outputs are identical (the command adds HF ``generate()`` on stock kernels, as a Hugging Face user
   runs it, when draftkit's kernels packed the target: :func:`time_hf_generate`);
2. speculative decoding with the head: its real tau, draft ms per round (k head passes) and verify ms per
   round (one target forward over k+1 tokens, cache crop included);
3. speculative decoding with the same head computation but a scripted acceptance pattern: the proposed
   ids are replaced by the reference output for the first ``pattern[r]`` positions and by a wrong token
   after, so that every cost is real and only the acceptance is set. This gives the wall-clock speedup
   that a head with that tau would reach on this machine (greedy output stays equal to plain). In
   bfloat16 the speculative output can drift from the plain reference (the verify forward's numerics
   differ from a one-token forward), which lowers the scripted tau; ``cost_model_speedup`` (tau x plain
   ms per token / (draft + verify ms per round)) is then the better estimate.

A random-init head is used when no checkpoint is given; ``--random_weights`` builds the target from its
config alone (timing does not depend on the weight values), for machines without the weights.

Shapes: n prompt tokens, k drafts per round.
"""

from __future__ import annotations

import logging
import os
import platform

import torch

from draftkit.decoding.drafters import Draft, Eagle3Drafter
from draftkit.decoding.verify import generate_plain, generate_speculative
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession

__all__ = ["ScriptedAcceptanceDrafter", "bench_decode", "time_hf_generate"]

log = logging.getLogger(__name__)


class ScriptedAcceptanceDrafter:
    """Wraps a drafter: runs it (all its cost is paid), then sets how many of its ids will be accepted.

    Round r proposes the reference continuation for its first ``pattern[r % len(pattern)]`` positions and a
    different token afterwards. With greedy verification the accepted count is exactly that (capped by
    the reference length), and the output stays the reference output.

    Args:
        inner: the drafter whose cost is measured.
        reference: the plain greedy output (new tokens) for this prompt.
        prompt_len: n, the prompt length.
        pattern: accepted drafts per round, cycled.
        vocab_size: V, to pick a wrong token.
    """

    def __init__(self, inner, reference: list[int], prompt_len: int, pattern: list[int], vocab_size: int) -> None:
        self.inner, self.reference, self.n, self.pattern, self.vocab_size = inner, reference, prompt_len, pattern, vocab_size
        self.round = 0

    def reset(self, prompt_ids, aux) -> None:
        self.round = 0
        self.inner.reset(prompt_ids, aux)

    def commit(self, aux) -> None:
        self.inner.commit(aux)

    def round_bytes(self, drafted: int) -> int:
        return self.inner.round_bytes(drafted)

    def propose(self, tokens, k, cfg, generator) -> Draft:
        draft = self.inner.propose(tokens, k, cfg, generator)
        good = self.pattern[self.round % len(self.pattern)]
        self.round += 1
        start = tokens.shape[0] - self.n  # index in the reference of the token after tokens[-1]
        ref = [self.reference[start + i] if start + i < len(self.reference) else 0 for i in range(k)]
        ids = [t if i < good else (t + 1) % self.vocab_size for i, t in enumerate(ref)]
        return Draft(torch.tensor(ids, device=tokens.device), None, draft.logits, draft.t2d)


def bench_decode(target, tokenizer, head, prompts: list[torch.Tensor], k: int = 5, max_new_tokens: int = 64,
                 pattern: list[int] = (1, 3, 2, 4, 0, 2)) -> dict:
    """Time plain, head-drafted and scripted-acceptance speculative decoding (greedy) on the prompts.

    No stop token: every call generates exactly ``max_new_tokens``.

    Returns:
        dict of timings (see the module docstring); ``*_ms_per_token`` exclude the prefill.
    """
    session = TargetSession(target)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    vocab = target.vocab_size
    generate_plain(session, prompts[0], DecodeConfig(max_new_tokens=4))
    generate_speculative(session, Eagle3Drafter(head), prompts[0], k, DecodeConfig(max_new_tokens=8))
    hf_tokens, hf_s, hf_equal = 0, 0.0, 0
    _hf_generate(target.model, prompts[0], 4)  # warm-up
    plain_s = plain_decode_s = head_s = scripted_s = draft_s = verify_s = 0.0
    plain_tokens = plain_decode = head_tokens = scripted_tokens = rounds = scripted_rounds = 0
    head_accepted = scripted_accepted = 0
    equal = 0
    for ids in prompts:
        plain = generate_plain(session, ids, cfg)
        plain_s += plain.seconds
        plain_decode_s += plain.seconds - plain.prefill_seconds
        plain_tokens += len(plain.tokens)
        plain_decode += plain.decode_tokens
        hf, seconds = _hf_generate(target.model, ids, max_new_tokens)
        hf_s += seconds
        hf_tokens += len(hf)
        hf_equal += hf == plain.tokens
        spec = generate_speculative(session, Eagle3Drafter(head), ids, k, cfg)
        head_s += spec.seconds
        head_tokens += len(spec.tokens)
        rounds += spec.stats.rounds
        head_accepted += sum(spec.stats.accepted)
        draft_s += spec.draft_seconds
        verify_s += spec.verify_seconds
        drafter = ScriptedAcceptanceDrafter(Eagle3Drafter(head), plain.tokens, ids.numel(), list(pattern), vocab)
        scripted = generate_speculative(session, drafter, ids, k, cfg)
        scripted_s += scripted.seconds
        scripted_tokens += len(scripted.tokens)
        scripted_rounds += scripted.stats.rounds
        scripted_accepted += sum(scripted.stats.accepted)
        equal += scripted.tokens == plain.tokens and spec.tokens == plain.tokens
    plain_tps = plain_tokens / plain_s
    return {
        "num_prompts": len(prompts),
        "k": k,
        "max_new_tokens": max_new_tokens,
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "draft_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "hardware": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
        "plain_tokens_per_s": plain_tps,
        "plain_ms_per_token": 1000 * plain_decode_s / plain_decode,
        "hf_generate_tokens_per_s": hf_tokens / hf_s,
        "plain_vs_hf_generate": plain_tps / (hf_tokens / hf_s),
        "hf_outputs_equal_plain": hf_equal,
        "head_tau": (head_accepted + rounds) / rounds,
        "head_tokens_per_s": head_tokens / head_s,
        "draft_ms_per_round": 1000 * draft_s / rounds,
        "verify_ms_per_round": 1000 * verify_s / rounds,
        "scripted_pattern": list(pattern),
        "scripted_tau": (scripted_accepted + scripted_rounds) / scripted_rounds,
        "scripted_tokens_per_s": scripted_tokens / scripted_s,
        "scripted_speedup": scripted_tokens / scripted_s / plain_tps,
        # tau x plain ms/token / (draft + verify ms/round): what the per-round costs predict at that tau
        "cost_model_speedup": ((scripted_accepted + scripted_rounds) / scripted_rounds
                               * (1000 * plain_decode_s / plain_decode) / (1000 * (draft_s + verify_s) / rounds)),
        "outputs_equal_plain": equal,
    }


def time_hf_generate(model, prompts: list[torch.Tensor], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """Hugging Face greedy ``generate()`` over the prompts after a 4-token warm-up: (each prompt's new ids,
    seconds in all). Its tokens/s is ``max_new_tokens * len(prompts) / seconds``."""
    _hf_generate(model, prompts[0], 4)
    outputs, seconds = [], 0.0
    for ids in prompts:
        out, s = _hf_generate(model, ids, max_new_tokens)
        outputs.append(out)
        seconds += s
    return outputs, seconds


def _hf_generate(model, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float]:
    """Hugging Face greedy ``generate()`` (KV cache, no stop token): (the ``max_new_tokens`` new ids, seconds)."""
    import time

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, use_cache=True,
                             pad_token_id=0, eos_token_id=None)
    return out[0, ids.numel():].tolist(), time.perf_counter() - t0
