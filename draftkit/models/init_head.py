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
import json
from pathlib import Path

import torch

__all__ = ["OPTION_FIELDS", "check_head_options", "check_same_head_shape", "load_into", "read_init_head"]


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
    _check_vocab_size(path, cfg.draft_vocab_size, draft_vocab_size)
    return head, meta


def _check_vocab_size(path: str, head: int, run: int) -> None:
    if head != run:
        raise ValueError(f"model.init_head {path} has a draft vocab of {head} ids, this run "
                         f"model.draft_vocab_size={run}: set model.draft_vocab_size {head} (the head's lm_head rows "
                         "are its draft ids)")


OPTION_FIELDS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
"""Head variant fields that are ``model.*`` options of the same name (the shape follows from the target and
``model.draft_vocab_size``)."""


def _refuse(path: str, head: dict, run: dict, names) -> None:
    """Raise the refusal of a head whose fields ``names`` differ from this run's, with the flags that match it."""
    diff = [k for k in names if head[k] != run.get(k)]
    if not diff:
        return
    flags = " ".join(f"--model.{k} {str(head[k]).lower()}" for k in diff if k in OPTION_FIELDS)
    raise ValueError(f"model.init_head {path}: the head differs from the one this run builds in "
                     + "; ".join(f"{k} {head[k]!r} (this run {run.get(k)!r})" for k in diff)
                     + "; set the model options to the head's" + (f": {flags}" if flags else ""))


def check_same_head_shape(init_cfg, cfg, path: str) -> None:
    """Refuse a head whose shape or variant (``norm_before_fc``, ``fc_norm``, ...) differs from the head this run
    builds, naming each field (and the ``--model.<field>`` flags where the option exists).

    Raises:
        ValueError: naming ``model.init_head`` and each differing field with both values.
    """
    a = dataclasses.asdict(init_cfg)
    # RoPE settings come from the target's config (checked by load_head); an export spells them the engines' way
    _refuse(path, a, dataclasses.asdict(cfg), [k for k in a if k not in ("max_position_embeddings", "rope")])


def check_head_options(path: str, hp) -> None:
    """Before ``fit`` reads its data and loads its target (minutes on a real run): refuse an init head whose draft
    vocab size or variant (:data:`OPTION_FIELDS`) differs from this run's ``model.*``, from the head's metadata alone
    (an export's ``draftkit_export.json`` or the checkpoint's ``draftkit`` record). A head that cannot be read so is
    left to :func:`read_init_head`, which names what is wrong when the head is built.

    Raises:
        ValueError: as :func:`read_init_head` (draft vocab size) and :func:`check_same_head_shape`.
    """
    from draftkit.heads.checkpoint import load_checkpoint

    try:
        p = Path(path)
        head = (json.loads((p / "draftkit_export.json").read_text())["head_config"] if p.is_dir()
                else load_checkpoint(p, "model.init_head")[1]["head_config"])
        head = {k: head[k] for k in ("draft_vocab_size", *OPTION_FIELDS)}
    except Exception:  # noqa: BLE001 - not readable here: read_init_head gives the error
        return
    _check_vocab_size(path, head["draft_vocab_size"], hp["draft_vocab_size"])
    _refuse(path, head, {k: hp[k] for k in OPTION_FIELDS}, OPTION_FIELDS)


def load_into(head: torch.nn.Module, init: torch.nn.Module) -> None:
    """Copy ``init``'s trained tensors (all but the frozen ``embed_tokens`` copy and the RoPE tables) and vocab
    map into ``head`` (same shape, :func:`check_same_head_shape`)."""
    state = {k: v for k, v in init.state_dict().items() if not k.startswith(("embed_tokens.", "rotary_emb."))}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary_emb."))]
    if missing or unexpected:
        raise ValueError(f"model.init_head: tensors missing {missing}, unexpected {unexpected}")
