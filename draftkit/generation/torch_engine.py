"""The torch engine of ``draftkit generate``: batched greedy or sampled decoding of the target with one KV cache.

:func:`generate_batch` decodes B prompts at once (left padding, per-row RoPE positions, rows leaving the batch as
they stop); ``draftkit.generation.regenerate`` renders the prompts, shards and writes the records, and
``draftkit.generation.llama_server`` is the other engine (llama.cpp's server on the target's GGUF).

Shapes: B batch, T tokens, S cached positions, V target vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from draftkit.sampling import sample

if TYPE_CHECKING:
    from draftkit.generation.regenerate import RegenerateConfig

__all__ = ["generate_batch"]


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    cfg: RegenerateConfig,
    stop_ids: list[int],
    pad_id: int,
    generators: list[torch.Generator | None] | None = None,
) -> list[tuple[list[int], str]]:
    """Decode a batch of prompts with one KV cache: left padding, one forward per new token.

    Left padding keeps every row's last prompt token in the last column; each row's RoPE positions count
    its own tokens (``cumsum(mask) - 1``), so a row's computation is the one it would get alone. A row
    that emits a stop id (kept in its output) or reaches ``max_new_tokens`` leaves the batch, and its
    cache rows are dropped. Tokens are picked by ``draftkit.sampling.sample`` (argmax at T = 0).

    Args:
        model: a Hugging Face causal LM (eval, no grad), e.g. ``FrozenTarget.model``.
        prompts: B non-empty lists of token ids.
        cfg: decode settings (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``).
        stop_ids: ids that end an answer.
        pad_id: id written into padding (masked out).
        generators: one RNG per row for sampling (None = the global RNG); unused at T = 0.

    Returns:
        B pairs (new token ids, stop reason ``eos`` or ``length``), in prompt order.

    Raises:
        ValueError: on an empty prompt.
    """
    from transformers import DynamicCache

    from draftkit.target.frozen import cache_kwarg

    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch: empty prompt")
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((b, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, device=device)
        mask[i, width - len(p):] = 1
    gens = list(generators) if generators is not None else [None] * b
    stops = set(int(s) for s in stop_ids)
    out: list[list[int]] = [[] for _ in range(b)]
    reason = ["length"] * b
    live = list(range(b))  # prompt index of each batch row still decoding
    cache = DynamicCache()
    cache_kw = cache_kwarg(model.forward)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # (B, T)
    step_ids = ids
    while True:
        # the last position as an index tensor, not logits_to_keep=1: HF slices hidden[:, -1:] (a strided view for
        # B > 1), and torch's matmul then expands the LM head weight to (B, H, V) and copies it (12 s for B = 16
        # on one SmolLM2 core); an index gathers a contiguous (B, 1, H) first
        last = torch.tensor([step_ids.shape[1] - 1], device=device)
        logits = model(
            input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
            **{cache_kw: cache}, logits_to_keep=last,
        ).logits[:, -1].float()  # (B', V)
        if cfg.temperature == 0:  # every row at once: one host read a step, not two a row
            nxt = sample(logits, 0.0)  # (B',)
        else:  # each row draws from its own generator (its samples do not depend on its batch)
            nxt = torch.stack([sample(logits[r], cfg.temperature, cfg.top_k, cfg.top_p, gens[i])
                               for r, i in enumerate(live)])
        keep = []
        for r, (i, tok) in enumerate(zip(live, nxt.tolist())):
            out[i].append(tok)
            if tok in stops:
                reason[i] = "eos"
            elif len(out[i]) < cfg.max_new_tokens:
                keep.append(r)
        if not keep:
            return [(o, s) for o, s in zip(out, reason)]
        if len(keep) < len(live):
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            mask, positions, nxt = mask[rows], positions[rows], nxt[rows]
            live = [live[r] for r in keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)  # (B', S+1)
        positions = positions[:, -1:] + 1  # (B', 1)
        step_ids = nxt[:, None]  # (B', 1)
