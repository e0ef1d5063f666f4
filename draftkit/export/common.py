"""Shared export machinery: name/cast/validate the serving tensors, config-field helpers, atomic directory write.

The checkpoint is read by ``draftkit.heads.checkpoint.read_checkpoint`` (the one reader).

Every engine directory holds ``config.json``, ``model.safetensors`` and the ``draftkit_export.json`` sidecar
(eagle3-format.md §7). The tensor set is the same for all engines (§2, §7.1): ``fc.weight``,
``<prefix>{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``<prefix>self_attn.{q,k,v,o}_proj.weight``, ``<prefix>mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t`` (int64) and ``t2d`` (bool), with ``<prefix>`` = ``midlayer.`` (vLLM, SGLang,
TensorRT-LLM) or ``layers.0.`` (speculators). ``embed_tokens.weight`` is written only when H != H_t;
``d2t``/``t2d`` only when V_d < V (vLLM 0.33 ``llama_eagle3.py`` then has no ``draft_id_to_target_id`` and refuses
a ``d2t``; TensorRT-LLM creates its ``d2t`` only when V_d != V); the EAGLE-3.1 ``input_norm.weight`` /
``fc_norm.{i}.weight`` only with their flags.

Layer ids stay HF ``hidden_states`` indices here; each engine module converts them in one function.

Shapes: H draft hidden, H_t target hidden, n aux layers, I MLP width, A heads, A_kv kv heads, d head dim,
V target vocab, V_d draft vocab, N target layers.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import hashlib
import json
from pathlib import Path

import torch

from draftkit.heads.checkpoint import check_finite, expected_tensor_specs
from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.jsonio import InsufficientSpaceError, atomic_path, check_free_space
from draftkit.selection.vocab import VocabMap

__all__ = [
    "CHECKED_TARGET_FAMILIES",
    "ENGINE_TARGET_FAMILIES",
    "EXPORT_DTYPES",
    "SIDECAR",
    "check_replaceable",
    "engine_family_warning",
    "llama_config_fields",
    "norm_flags",
    "rope_legacy_fields",
    "serving_tensors",
    "validate_tensors",
    "vocab_fingerprint",
    "write_directory",
]

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""Weight dtypes an export may be written in (bf16 is the default; §7.1)."""

SIDECAR = "draftkit_export.json"
"""Sidecar file name; engines ignore it."""

NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

_CAPTURE_EVERYWHERE = frozenset({"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "deepseek_v3"})
ENGINE_TARGET_FAMILIES: dict[str, frozenset[str]] = {
    # vLLM 0.34.0 (PyPI wheel, commit g62d4bc3c7): the target's *ForCausalLM in vllm/model_executor/models/ declares
    # SupportsEagle3 (set_aux_hidden_state_layers); gemma3.py and gemma2.py do not
    "vllm": _CAPTURE_EVERYWHERE,
    # a speculators directory is served by vLLM's speculators loader: the target side is vLLM's
    "speculators": _CAPTURE_EVERYWHERE,
    # SGLang 0.5.23 (PyPI wheel): python/sglang/srt/models/<file> defines set_eagle3_layers_to_capture
    # (gemma3_causal.py does; gemma2.py does not)
    "sglang": _CAPTURE_EVERYWHERE | {"gemma3_text"},
    # TensorRT-LLM (source, tensorrt_llm/_torch/models/modeling_<family>.py): the decoder layers hand their output to
    # spec_metadata.maybe_capture_hidden_states; modeling_gemma3.py and modeling_gemma2.py do not
    "trtllm": _CAPTURE_EVERYWHERE,
    # llama.cpp b11434: the target's graph (src/models/<file>.cpp) records its layer inputs (res->t_layer_inp), which
    # draft-eagle3 extracts: llama.cpp (llama, mistral), qwen3.cpp, qwen3moe.cpp, openai-moe.cpp (gpt_oss); qwen2.cpp,
    # deepseek2.cpp, gemma2.cpp and gemma3.cpp do not (llama-server aborts: "layer input tensor is null")
    "llamacpp": frozenset({"llama", "mistral", "qwen3", "qwen3_moe", "gpt_oss"}),
}
"""Engine -> the target ``model_type`` values whose target model captures EAGLE3 aux hidden states in that
engine, as read in each engine's code (the table, files and versions: eagle3-format.md §7.7). Only the families of
:data:`CHECKED_TARGET_FAMILIES` were checked; ``draftkit export`` warns (never refuses) outside these sets."""

CHECKED_TARGET_FAMILIES = frozenset({*_CAPTURE_EVERYWHERE, "gemma2", "gemma3_text"})
"""The target ``model_type`` values looked up in every engine of :data:`ENGINE_TARGET_FAMILIES`."""


def engine_family_warning(engine: str, model_type: str | None) -> str | None:
    """The warning ``draftkit export`` logs when ``engine`` does not declare EAGLE3 for the target's family.

    Args:
        engine: the export engine (a name of ``draftkit.export.ENGINES``).
        model_type: the target's (text) config ``model_type``; None when unknown.

    Returns:
        None when :data:`ENGINE_TARGET_FAMILIES` lists ``model_type`` for ``engine``; else one line naming the
        engine, the model_type and the engines that do serve it, or saying the pair was not checked (a family
        outside :data:`CHECKED_TARGET_FAMILIES`, or an engine without an entry).
    """
    served = ENGINE_TARGET_FAMILIES.get(engine)
    if served is not None and model_type in served:
        return None
    if served is None or model_type not in CHECKED_TARGET_FAMILIES:
        return (
            f"--to {engine}: EAGLE3 support for target model_type {model_type!r} in {engine} was not checked "
            f"(draftkit records {', '.join(sorted(CHECKED_TARGET_FAMILIES))} for "
            f"{', '.join(ENGINE_TARGET_FAMILIES)}); the export is written: check that {engine}'s model for this "
            "target captures the aux hidden states before serving it"
        )
    others = [e for e, families in ENGINE_TARGET_FAMILIES.items() if model_type in families]
    return (
        f"--to {engine}: {engine}'s model for target model_type {model_type!r} does not declare EAGLE3 (no aux "
        f"hidden-state capture, eagle3-format.md §7.7); engines that serve it: {', '.join(others) or 'none'}. "
        "The export is written, but the engine will refuse or ignore this head for this target"
    )


def serving_tensors(
    state: dict[str, torch.Tensor], dtype: torch.dtype, layer_prefix: str, cfg: Eagle3Config
) -> dict[str, torch.Tensor]:
    """Rename and cast draftkit head tensors for an engine.

    Args:
        state: tensors under draftkit names (``midlayer.*``, ...).
        dtype: weight dtype; ``d2t`` becomes int64 and ``t2d`` bool whatever it is.
        layer_prefix: ``"midlayer."`` (kept) or ``"layers.0."`` (speculators rename).
        cfg: the head shape; with V_d == V the identity map ``d2t``/``t2d`` is left out (the engines refuse it).

    Returns:
        A new dict of contiguous tensors.
    """
    out = {}
    identity = cfg.draft_vocab_size == cfg.vocab_size
    for name, value in state.items():
        if identity and name in ("d2t", "t2d"):
            continue
        if name.startswith("midlayer."):
            name = layer_prefix + name[len("midlayer."):]
        if name == "d2t":
            value = value.to(torch.long)
        elif name == "t2d":
            value = value.to(torch.bool)
        else:
            value = value.detach().to(dtype)
        out[name] = value.contiguous().clone()
    return out


def validate_tensors(
    tensors: dict[str, torch.Tensor], cfg: Eagle3Config, dtype: torch.dtype, layer_prefix: str, where: str
) -> None:
    """Strict checks of an engine tensor set (§7.6.1).

    Args:
        tensors: name -> tensor as written (or about to be written).
        cfg: the head shape.
        dtype: the expected weight dtype.
        layer_prefix: ``"midlayer."`` or ``"layers.0."``.
        where: file or directory named in errors.

    Raises:
        ValueError: on a missing or unexpected name (``d2t``/``t2d`` are unexpected when V_d == V), a wrong
            shape or dtype, non-finite weights, or a d2t that breaks the §5 invariants (ids strictly increasing
            in [0, V), t2d marks exactly those ids).
    """
    specs = expected_tensor_specs(cfg, layer_prefix, serving=True)
    missing = sorted(set(specs) - set(tensors))
    unexpected = sorted(set(tensors) - set(specs))
    if missing or unexpected:
        raise ValueError(f"{where}: tensor names missing {missing}, unexpected {unexpected}")
    kinds = {"float": dtype, "int64": torch.int64, "bool": torch.bool}
    for name, (shape, kind) in specs.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != kinds[kind]:
            raise ValueError(f"{where}: {name} has dtype {t.dtype}, expected {kinds[kind]}")
    check_finite(tensors, where)
    if "d2t" not in tensors:  # V_d == V: the identity, left out
        return
    try:
        VocabMap(d2t=tensors["d2t"], t2d=tensors["t2d"]).validate()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def vocab_fingerprint(d2t: torch.Tensor, vocab_size: int) -> str:
    """sha256 over V and the int64 bytes of d2t (zeros for V_d == V): equal fingerprints mean the same draft
    vocab."""
    h = hashlib.sha256()
    h.update(f"V={vocab_size};V_d={d2t.numel()};".encode())
    h.update(d2t.to(torch.long).contiguous().numpy().tobytes())
    return h.hexdigest()


def rope_legacy_fields(rope: dict) -> tuple[float, dict | None]:
    """``rope_theta`` and ``rope_scaling`` for engine configs from a head's rope fields.

    transformers 5 stores RoPE as ``rope_parameters`` (theta inside, ``rope_type`` "default" for plain RoPE);
    engine configs keep the legacy top-level pair, as SpecForge ``apply_legacy_rope_scaling`` writes it.

    Args:
        rope: ``Eagle3Config.rope`` (any of ``rope_theta``, ``rope_scaling``, ``rope_parameters``).

    Returns:
        (rope_theta, rope_scaling) with rope_scaling None for plain RoPE.

    Raises:
        ValueError: if no rope theta can be found.
    """
    params = rope.get("rope_parameters")
    if not isinstance(params, dict):
        scaling = rope.get("rope_scaling")
        params = dict(scaling) if isinstance(scaling, dict) else {}
    params = copy.deepcopy(dict(params))
    theta = rope.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError(f"no rope_theta in the head's rope fields {rope}")
    params.pop("rope_theta", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" and len(set(params) - {"rope_type", "type"}) == 0 else params
    return float(theta), scaling


def norm_flags(cfg: Eagle3Config) -> dict[str, bool]:
    """All four norm flags, always explicit and top level (§3, §7): vLLM 0.33, SGLang 0.5.23 and speculators read
    each there (TensorRT-LLM reads ``fc_norm``/``norm_output`` there and ``norm_before_fc`` only nested, see
    ``draftkit.export.trtllm``)."""
    return {name: bool(getattr(cfg, name)) for name in NORM_FLAGS}


def llama_config_fields(cfg: Eagle3Config, dtype_name: str) -> dict:
    """The one-layer Llama fields every engine config shares (§7.2), in the documented order.

    Args:
        cfg: the head shape.
        dtype_name: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (written as ``torch_dtype``, never null).
    """
    theta, scaling = rope_legacy_fields(cfg.rope)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }


def head_config_dict(cfg: Eagle3Config) -> dict:
    """``dataclasses.asdict`` of the head config (JSON-safe)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)


def check_replaceable(out_dir: Path, source: Path | None = None) -> None:
    """What ``--overwrite`` may replace: nothing, an empty directory, or an earlier export (a directory holding
    the sidecar), and never one holding the checkpoint being exported. ``export ckpt run/checkpoints --overwrite
    true`` deleted the run's checkpoints, the source among them; ``export ckpt . --overwrite true`` a whole folder.

    Args:
        out_dir: the absolute export directory.
        source: the checkpoint or export directory being exported, when known.

    Raises:
        FileExistsError: naming ``out_dir``, what it holds and what to do, before anything is written.
    """
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if source is not None and out_dir.is_dir() and Path(source).expanduser().absolute().is_relative_to(out_dir) \
            and Path(source).expanduser().absolute() != out_dir:
        raise FileExistsError(f"--overwrite: {out_dir} holds the checkpoint being exported ({source}); replacing "
                              "it would delete it: give another export directory")
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise FileExistsError(f"--overwrite replaces only an earlier export directory, and {out_dir} is a file or "
                              "a link: give another export directory")
    entries = sorted(p.name for p in out_dir.iterdir())
    if entries and SIDECAR not in entries:
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise FileExistsError(f"--overwrite replaces only an earlier export directory (one holding {SIDECAR}), "
                              f"and {out_dir} is none: it holds {shown}; give a new directory, or empty this one")


def write_directory(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    json_files: dict[str, dict],
    text_files: dict[str, str],
    overwrite: bool,
    check,
    write_weights=None,
    extra_tensor_files: dict | None = None,
) -> Path:
    """Write an export directory atomically: build it in a temporary sibling, check it, then rename.

    Args:
        out_dir: the final directory.
        tensors: written to ``model.safetensors`` (with ``{"format": "pt"}`` metadata), or by ``write_weights``.
        json_files: file name -> JSON object (``config.json``, the sidecar, ...).
        text_files: file name -> text.
        overwrite: replace an existing ``out_dir``.
        check: ``check(tmp_dir)`` runs on the finished temporary directory before the rename; it raises to abort.
        write_weights: ``write_weights(tensors, tmp_dir)`` writes the weights in an engine's own format (llama.cpp:
            one GGUF) instead of ``model.safetensors``.
        extra_tensor_files: file name -> ``(writer, tensor)``: ``writer(tmp_dir, tensor)`` writes one more file
            (the head's trained prompts, ``draftkit.data.trained_prompts.write_trained_prompts``).

    Returns:
        The final directory path.

    Raises:
        FileExistsError: if ``out_dir`` exists and ``overwrite`` is false.
        draftkit.jsonio.InsufficientSpaceError: (a ValueError) naming ``out_dir`` and the bytes needed, when the
            filesystem has less free space than the files plus a margin (checked before anything is written),
            or fills up while writing (the temporary directory is removed).
        Exception: whatever ``check`` raises; the temporary directory is removed and ``out_dir`` is untouched.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"export directory {out_dir} already exists; pass --overwrite to replace it")
    check_replaceable(out_dir)
    json_text = {name: json.dumps(obj, indent=2) + "\n" for name, obj in json_files.items()}
    nbytes = (sum(t.numel() * t.element_size() for t in tensors.values()) + 128 * len(tensors) + 4096
              + sum(len(t.encode("utf-8")) for t in [*json_text.values(), *text_files.values()])
              + sum(t.numel() * t.element_size() + 4096 for _, t in (extra_tensor_files or {}).values()))
    check_free_space(out_dir.parent, nbytes, f"export to {out_dir}")
    with atomic_path(out_dir, directory=True) as tmp:
        try:
            if write_weights is None:
                _write_safetensors(tensors, tmp / "model.safetensors", {"format": "pt"})
            else:
                write_weights(tensors, tmp)
            for name, text in json_text.items():
                (tmp / name).write_text(text)
            for name, text in text_files.items():
                (tmp / name).write_text(text)
            for writer, tensor in (extra_tensor_files or {}).values():
                writer(tmp, tensor)
        except Exception as exc:  # the disk filled while writing (safetensors raises its own error type)
            if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc):
                raise InsufficientSpaceError(
                    f"export to {out_dir}: the disk filled while writing ({nbytes} bytes needed plus a margin); "
                    "nothing was left behind: free space or write somewhere else"
                ) from exc
            raise
        check(tmp)
    return out_dir


def portable_path(path: str | Path) -> str:
    """How a sidecar names a file or folder of the machine that exported: its path relative to the working
    directory when it lies inside it (``checkpoints/run/last.ckpt``), else its name alone (``last.ckpt``, a cache
    folder's name), so no absolute path of that machine is written. A relative reference that is no local path
    (a hub id such as ``org/model``) comes back as it is.

    Args:
        path: a local path (absolute or relative to the working directory) or a hub id.

    Returns:
        str: the relative path or the name.
    """
    full = Path(path).expanduser().absolute()
    try:
        return str(full.relative_to(Path.cwd()))
    except ValueError:
        return full.name


def require_three_aux_states(cfg: Eagle3Config, loader: str, why: str = "(target_hidden_size x 3)") -> None:
    """Refuse a head fusing other than 3 aux hidden states for an engine whose loader sizes ``fc`` for exactly 3
    (SGLang, TensorRT-LLM, speculators; vLLM reads ``num_aux_hidden_states`` instead).

    Args:
        cfg: the head's config (``num_aux_layers``, ``hidden_size``, ``target_hidden_size``).
        loader: the engine's loader, named in the message (``SGLang's llama_eagle3``).
        why: how the loader comes to 3, in parentheses.

    Raises:
        ValueError: naming the layers, the fc.weight shape that would not load, and ``--to vllm``.
    """
    if cfg.num_aux_layers != 3:
        raise ValueError(
            f"this head fuses {cfg.num_aux_layers} target layers (model.aux_layer_ids), but {loader} builds fc for "
            f"exactly 3 {why}, so its fc.weight ({cfg.hidden_size}, {cfg.num_aux_layers * cfg.target_hidden_size}) "
            "would not load; export it --to vllm (num_aux_hidden_states is written), or train a head on 3 layers"
        )
