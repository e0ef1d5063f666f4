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
    num_speculative_tokens: Optional[int] = None,
    tree: Optional[str] = None,
    from_report: Optional[str] = None,
    sglang_version: Optional[str] = None,
    sglang_aux_rule: Optional[str] = None,
    verifier: Optional[str] = None,
    target_name: Optional[str] = None,
    target_gguf: Optional[str] = None,
) -> str:
    """Export a training checkpoint as a directory a serving engine loads (config.json, model.safetensors, sidecar).

    Args:
        checkpoint: a .ckpt written by `draftkit fit`, or an export directory (e.g. checkpoints/smollm2-135m-eagle3-head) to re-export for another engine.
        out_dir: export directory to create (refused if it exists, unless --overwrite true).
        to: engine layout, one of draftkit.export.ENGINES (vllm, speculators, sglang, trtllm, llamacpp: one .gguf, ...).
        dtype: weight dtype: bfloat16 (default), float16 or float32; for --to llamacpp also q8_0.
        overwrite: replace an existing out_dir: an earlier export (it holds draftkit_export.json) or an empty directory, never one holding the checkpoint.
        target: target reference overriding the checkpoint's (local dir, hub id, pypi:..., .gguf).
        num_speculative_tokens: chain of k draft tokens per round written into speculators/TensorRT-LLM configs and the launch line (default 3; old spelling -k).
        tree: speculate with a tree depth,topk,N (e.g. 5,4,16: N draft nodes verified per round): SGLang --speculative-num-steps D --speculative-eagle-topk K --speculative-num-draft-tokens N+1, TensorRT-LLM dynamic tree in trtllm_spec.yaml; vLLM serves only chains and gets the chain of depth D (the sidecar says so).
        from_report: take the shape from a `draftkit evaluate` JSON report: the cost model's choice (--k auto / --tree auto), else the report's tree or k; the sidecar records it with the report's device, CPU capability, predicted and measured speedup and path. The report must have measured this head (its weights' fingerprint; a report of another head is refused).
        sglang_version: SGLang release the export targets (selects the aux-id rule; default the newest verified).
        sglang_aux_rule: explicit SGLang aux-id rule (plus_one or plus_one_if_first_is_one) for newer releases.
        verifier: speculators verifier name_or_path (default: the target name).
        target_gguf: for --to llamacpp, the target's GGUF (its tokenizer goes into the head's GGUF; llama-server -m loads it); default: the checkpoint's target when it is a .gguf.
        target_name: name the serving host loads the target by (hub id or its path there), for the launch line, the speculators verifier and the sidecar; default: the checkpoint's target reference as given, or (with a warning) the local cache path when that reference is tiny:, pypi: or a cache path.

    Returns:
        The export directory.

    Raises:
        ValueError, FileNotFoundError, FileExistsError: as ``draftkit.export.export_checkpoint``, and for more
            than one of --num_speculative_tokens / --tree / --from_report, a malformed --tree, or a report without
            a speculation shape (``draftkit.export.speculation.resolve_speculation``); nothing is written then.
    """
    import json

    from draftkit.export import ENGINES, export_checkpoint
    from draftkit.export.common import SIDECAR
    from draftkit.export.speculation import resolve_speculation

    if to is None:
        raise ValueError(f"give the engine layout with --to, one of {', '.join(ENGINES)}")
    k, speculation = resolve_speculation(num_speculative_tokens, tree, from_report)
    options = {"sglang_version": sglang_version, "sglang_aux_rule": sglang_aux_rule, "verifier": verifier,
               "target_gguf": target_gguf}
    path = export_checkpoint(
        checkpoint, to, out_dir, dtype=dtype, overwrite=overwrite, target=target, target_name=target_name,
        num_speculative_tokens=k, speculation=speculation, **{n: v for n, v in options.items() if v is not None},
    )
    sidecar = json.loads((path / SIDECAR).read_text())
    shape = sidecar.get("speculation")
    shape = "" if shape is None else f", {shape['topology']} {shape['depth']},{shape['topk']},{shape['num_nodes']}"
    print(f"exported {checkpoint} for {to} ({dtype}{shape}) into {path}\nlaunch: {sidecar['launch']}")
    return str(path)
