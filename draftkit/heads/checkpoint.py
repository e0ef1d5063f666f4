"""Load a trained head back from a draftkit training checkpoint (``.ckpt``).

A draftkit Lightning checkpoint stores the head under ``state_dict["head.*"]`` without the frozen
``embed_tokens`` copy and without the target, plus ``checkpoint["draftkit"]`` with the metadata needed to
rebuild it: ``head_config`` (:class:`Eagle3Config` fields), ``target`` (the recipe reference),
``target_dtype``, ``aux_layer_ids`` (HF ``hidden_states`` indices), ``chat_template`` (or None for the
tokenizer's own) and ``ttt`` (steps, decay).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead

__all__ = ["head_from_checkpoint", "HEAD_PREFIX"]

HEAD_PREFIX = "head."


def head_from_checkpoint(path: str | Path) -> tuple[Eagle3LlamaHead, dict]:
    """Rebuild the head of a training checkpoint.

    The returned head's ``embed_tokens`` is uninitialised: call ``head.load_embedding(target_embedding)``
    with the target's (V, H_t) input embedding before use.

    Args:
        path: a ``.ckpt`` written by ``draftkit fit``.

    Returns:
        (head in eval mode, float32; the ``draftkit`` metadata dict).

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if the file is not a draftkit training checkpoint or cannot be read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unreadable file
        raise ValueError(f"checkpoint {path} could not be read ({exc}); is it a complete .ckpt file?") from exc
    meta = ckpt.get("draftkit") if isinstance(ckpt, dict) else None
    if meta is None:
        raise ValueError(f"{path} is not a draftkit training checkpoint (no 'draftkit' metadata)")
    head = Eagle3LlamaHead(Eagle3Config(**meta["head_config"]))
    state = {k[len(HEAD_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(HEAD_PREFIX)}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary_emb."))]
    if missing or unexpected:
        raise ValueError(f"{path}: head keys missing {missing}, unexpected {unexpected}")
    return head.eval(), meta
