"""A draft head with its target, ready to decode: the one loader behind ``evaluate``, ``bench decode`` and the
vLLM comparison (``benchmarks/vllm_compare.py``).

It sits in ``export/`` beside ``load.load_head`` (the head from a ``.ckpt`` or an export directory), which it
calls; the match check is ``heads.checkpoint.check_head_matches_target``.

Shapes: none (loading).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["HeadAndTarget", "load_head_and_target"]


class HeadAndTarget(NamedTuple):
    """What :func:`load_head_and_target` returns.

    Attributes:
        head: the ``Eagle3LlamaHead`` (eval mode, the target's input embedding loaded, on ``device`` in the
            draft dtype).
        target: the ``draftkit.target.frozen.FrozenTarget`` (the frozen HF model on ``device`` in ``dtype``,
            reading the head's aux layers).
        tokenizer: the target's tokenizer (None for a random-weights target without one).
        meta: the head's metadata (``load_head``'s: ``target``, ``aux_layer_ids``, ``chat_template``, ...,
            plus ``head_fingerprint``: ``heads.checkpoint.head_fingerprint`` of its weights; empty for a
            random-init head).
        target_ref: the target reference that was loaded.
    """

    head: torch.nn.Module
    target: object
    tokenizer: object
    meta: dict
    target_ref: str


def load_head_and_target(
    checkpoint: str | Path | None,
    target: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    draft_dtype: str | None = None,
    *,
    random_weights: bool = False,
    draft_vocab_size: int = 8192,
    device_map: str | dict | None = None,
) -> HeadAndTarget:
    """Load a draft head and its target: the head (``export.load.load_head``), the target (``load_target``, or
    built from its config for ``random_weights``) moved to ``device``, the ``FrozenTarget`` on the head's aux
    layers, the match check, the target's input embedding into the head, and the head's dtype and device.

    Args:
        checkpoint: a training ``.ckpt`` or an export directory; None: a random-init head
            (``Eagle3Config.from_target_config`` with ``draft_vocab_size`` rows, seed 0), for timing.
        target: a target reference overriding the head's (checked against it); needed without a checkpoint.
        dtype: the target's torch dtype name, resolved (``float32``, ``bfloat16``, ``float16``; not ``auto``).
        device: the torch device of both (resolved, e.g. ``cpu``, ``cuda:0``).
        draft_dtype: the head's torch dtype name (default: ``dtype``).
        random_weights: build the target from its config with seeded random weights (timing does not depend on
            the weights); the tokenizer is None when the reference has none.
        draft_vocab_size: V_d of the random-init head.
        device_map: place the target across devices as it loads (``load_target``'s ``device_map``: a target
            larger than one GPU) instead of moving it to ``device``; the head then runs where the target's input
            embedding is. Not with ``random_weights``.

    Returns:
        :class:`HeadAndTarget` (head, target, tokenizer, meta, target_ref).

    Raises:
        FileNotFoundError: if the checkpoint or the target does not exist.
        ValueError: if the checkpoint cannot be read, no target is known, or the head does not match the target
            (aux width, vocabulary, non-finite weights: ``check_head_matches_target``; the tokenizer:
            ``heads.checkpoint.check_tokenizer``), naming both.
    """
    from draftkit.export.load import load_head
    from draftkit.heads.checkpoint import check_head_matches_target, head_fingerprint
    from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
    from draftkit.target.frozen import FrozenTarget, load_target

    head, meta = load_head(checkpoint, target) if checkpoint else (None, {})
    if head is not None:  # float32 here, before the draft dtype: what an export of this head names
        meta = {**meta, "head_fingerprint": head_fingerprint(head.state_dict())}
    target_ref = target or meta.get("target")
    if not target_ref:
        raise ValueError("--target: no target given and no checkpoint to read it from")
    if device_map is not None and random_weights:
        raise ValueError("device_map places a loaded target; a random-weight target is built on one device")
    if random_weights:
        model, tokenizer = _random_target(target_ref, dtype)
    else:
        model, tokenizer = load_target(target_ref, dtype, device_map)
    if device_map is None:
        model.to(device)
    else:  # the head and every decoding tensor live where the target's input embedding is
        device = model.get_input_embeddings().weight.device
    frozen = FrozenTarget(model, meta.get("aux_layer_ids"))
    if head is None:
        torch.manual_seed(0)
        head = Eagle3LlamaHead(Eagle3Config.from_target_config(frozen.config, frozen.aux_layer_ids, draft_vocab_size))
    else:
        check_head_matches_target(head, frozen, f"head {checkpoint}", f"target {target_ref}")
    head.load_embedding(frozen.input_embeddings())  # copy_ converts: no float32 copy of the table on its device
    head = head.to(device=device, dtype=getattr(torch, draft_dtype or dtype)).eval()
    return HeadAndTarget(head, frozen, tokenizer, meta, target_ref)


def _random_target(target_ref: str, dtype: str):
    """(HF model with seeded random weights from the target's config, its tokenizer or None)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from draftkit.artifacts import resolve_model_dir

    path = resolve_model_dir(target_ref)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=getattr(torch, dtype))
    model = model.eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer
