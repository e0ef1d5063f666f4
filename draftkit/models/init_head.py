"""``model.init_head``: start a new training run from a trained head (continue it on other data).

Resuming (``fit --ckpt_path``) continues one run: its data, options, optimizer state and step count. A head
trained once and then trained further on new data (another domain, regenerated answers) is a new run that starts
from the head's weights and its draft vocab map: ``fit --model.init_head <.ckpt or export directory>``. The
optimizer, the learning-rate schedule (warmup included) and the step count start fresh; the data's token counts
no longer choose the draft vocab (the head's map is kept, so its ``lm_head`` rows keep their meaning).

Shapes: V target vocab, V_d draft vocab.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

__all__ = ["check_same_head_shape", "load_into", "read_init_head"]


def read_init_head(path: str, target: str, aux_layer_ids: list[int], draft_vocab_size: int):
    """The trained head ``path`` as a starting point for this run, checked against it.

    Args:
        path: a ``.ckpt`` from ``draftkit fit`` or an export directory (``model.init_head``).
        target: this run's ``model.target``; the head must have been trained on it, or on a target of the same
            architecture (a fine-tune, a quantization), with the same tokenizer.
        aux_layer_ids: this run's resolved aux layer ids.
        draft_vocab_size: this run's ``model.draft_vocab_size``.

    Returns:
        ``(head, meta)`` as ``export.load.load_head`` returns them: the head's ``config`` (an ``Eagle3Config``),
        its weights, ``d2t`` (V_d,) int64 and ``t2d`` (V,) bool.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when ``path`` is no training checkpoint or export directory, or the head was trained on another
            architecture or tokenizer, reads other aux layers, or has another draft vocab size, naming
            ``model.init_head`` and the option to change.
    """
    from draftkit.export.load import load_head

    if not Path(path).exists():
        raise FileNotFoundError(f"model.init_head: {path} does not exist; give a .ckpt from draftkit fit or an "
                                "export directory")
    try:
        head, meta = load_head(path, target)
    except (ValueError, OSError) as exc:  # not a checkpoint, not an export, another target: name the option
        raise ValueError(f"model.init_head: {exc}") from exc
    cfg = head.config
    if list(cfg.aux_layer_ids) != list(aux_layer_ids):
        raise ValueError(f"model.init_head {path} reads aux layers {list(cfg.aux_layer_ids)}, this run "
                         f"{list(aux_layer_ids)}: set model.aux_layer_ids {list(cfg.aux_layer_ids)}")
    if cfg.draft_vocab_size != draft_vocab_size:
        raise ValueError(f"model.init_head {path} has a draft vocab of {cfg.draft_vocab_size} ids, this run "
                         f"model.draft_vocab_size={draft_vocab_size}: set model.draft_vocab_size "
                         f"{cfg.draft_vocab_size} (the head's lm_head rows are its draft ids)")
    return head, meta


def check_same_head_shape(init_cfg, cfg, path: str) -> None:
    """Refuse a head whose shape or variant (``norm_before_fc``, ``fc_norm``, ...) differs from the head this run
    builds, naming each field (``model.<field>`` where the option exists).

    Raises:
        ValueError: naming ``model.init_head`` and each differing field with both values.
    """
    a, b = dataclasses.asdict(init_cfg), dataclasses.asdict(cfg)
    # RoPE settings come from the target's config (checked by load_head); an export spells them the engines' way
    diff = [f"{k} {a[k]!r} (this run {b[k]!r})" for k in a
            if k not in ("max_position_embeddings", "rope") and a[k] != b.get(k)]
    if diff:
        raise ValueError(f"model.init_head {path}: the head differs from the one this run builds in "
                         f"{'; '.join(diff)}; set the model options to the head's")


def load_into(head: torch.nn.Module, init: torch.nn.Module) -> None:
    """Copy ``init``'s trained tensors (all but the frozen ``embed_tokens`` copy and the RoPE tables) and vocab
    map into ``head`` (same shape, :func:`check_same_head_shape`)."""
    state = {k: v for k, v in init.state_dict().items() if not k.startswith(("embed_tokens.", "rotary_emb."))}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary_emb."))]
    if missing or unexpected:
        raise ValueError(f"model.init_head: tensors missing {missing}, unexpected {unexpected}")
