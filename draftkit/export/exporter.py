"""``export_checkpoint``: one training checkpoint -> one engine directory, checked before it appears.

Steps (eagle3-format.md §7):
1. read the checkpoint and its target config; refuse a head trained for another target (hidden size, vocab)
   or without a draft-vocab map; warn when the engine's model for the target's family does not capture EAGLE3
   aux hidden states (``common.ENGINE_TARGET_FAMILIES``, eagle3-format.md §7.7);
2. rename/cast the serving tensors for the engine and validate them strictly (names, shapes, dtypes, d2t);
3. build ``config.json`` (aux ids converted by the engine module, all four norm flags explicit), the launch
   line for the chain k or the tree shape (``export.speculation``) and the ``draftkit_export.json`` sidecar;
4. write everything into a temporary sibling directory, reload it with :func:`load_exported_head`, compare its
   logits with the checkpoint's head (same dtype rounding) and with :func:`reference_forward`, and only then
   rename it into place.

Shapes: B batch, T tokens, H draft hidden, H_t target hidden, V target vocab, V_d draft vocab, N target layers.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

from draftkit.artifacts import cache_dir
from draftkit.data.trained_prompts import EXPORT_FILE, read_trained_prompts, write_trained_prompts
from draftkit.export.common import (
    EXPORT_DTYPES,
    NORM_FLAGS,
    SIDECAR,
    check_replaceable,
    engine_family_warning,
    head_config_dict,
    portable_path,
    serving_tensors,
    validate_tensors,
    vocab_fingerprint,
    write_directory,
)
from draftkit.export.load import load_exported_head, read_export, read_export_source, reference_forward
from draftkit.export.speculation import Speculation
from draftkit.heads.checkpoint import HeadSource, read_checkpoint, target_architecture
from draftkit.heads.eagle3_llama import Eagle3LlamaHead, KVCache
from draftkit.jsonio import check_writable

__all__ = ["export_checkpoint", "export_head_source", "verify_export"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def _draftkit_version() -> str:
    try:
        return metadata.version("draftkit")
    except metadata.PackageNotFoundError:  # running from a source tree without an install
        return "unknown"


def export_checkpoint(
    checkpoint: str | Path,
    engine: str,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    target: str | None = None,
    num_speculative_tokens: int | None = None,
    target_name: str | None = None,
    speculation: Speculation | None = None,
    **engine_options,
) -> Path:
    """Export a draftkit training checkpoint for one serving engine.

    Args:
        checkpoint: a ``.ckpt`` written by ``draftkit fit``, or an export directory (re-exported; its
            weights pass through unchanged in their stored dtype).
        engine: a name in the registry ``draftkit.export.ENGINES`` (``vllm``, ``speculators``, ``sglang``,
            ``trtllm``, or one registered with ``register_engine``).
        out_dir: the directory to create.
        dtype: weight dtype, ``bfloat16`` (default), ``float32`` or ``float16`` (fp16 drafts have overflowed
            to NaN logits in engines: sglang PR #27883, vllm #55250).
        overwrite: replace an existing ``out_dir``.
        target: target reference overriding the checkpoint's ``meta["target"]``.
        target_name: the name the serving host loads the target by (hub id or its path there), written into
            the launch line, speculators' verifier and the sidecar; default :func:`serving_target_name`.
        num_speculative_tokens: k, a chain's draft tokens (default 3), written where the format carries it
            (speculators, TensorRT-LLM options) and into the launch command.
        speculation: a chain or tree shape (``draftkit.export.speculation.Speculation``: ``--tree`` or an
            evaluate report) instead of ``num_speculative_tokens``; k is then its depth, the engines write its
            settings (SGLang steps/topk/draft tokens, TensorRT-LLM dynamic tree; vLLM serves the chain of its
            depth) and the sidecar records it under ``speculation``. None (default) writes what a chain of k
            always wrote, byte for byte.
        engine_options: options the engine module reads (``sglang_version``, ``sglang_aux_rule`` for SGLang,
            ``verifier`` for speculators; see each module's ``build_files``).

    Returns:
        The export directory.

    Raises:
        ValueError: on an unknown engine or dtype, k < 1, both ``num_speculative_tokens`` and a ``speculation``
            of another depth, a bad checkpoint (see :func:`read_checkpoint`), a head or a speculation shape the
            engine cannot express, or a failed self-check (nothing is written then).
        FileExistsError: if ``out_dir`` exists and ``overwrite`` is false, or ``overwrite`` would replace what is
            no earlier export or holds ``checkpoint`` (``common.check_replaceable``).
    """
    from draftkit.export import ENGINES

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    dtypes = _engine_dtypes(ENGINES[engine])
    if dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r} for {engine}; choose one of {', '.join(dtypes)}")
    k = _draft_tokens(num_speculative_tokens, speculation)
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not overwrite:  # fail before the (possibly slow) checkpoint read
        raise FileExistsError(f"export directory {out_dir} already exists; pass --overwrite to replace it")
    check_replaceable(out_dir, Path(checkpoint))
    check_writable(out_dir, "export directory", directory=True)
    if Path(checkpoint).is_dir():  # an export directory (a shipped head): re-export it for this engine
        source = read_export_source(checkpoint, target=target)
    else:
        source = read_checkpoint(checkpoint, target=target)
    return export_head_source(
        source, engine, out_dir, dtype=dtype, overwrite=overwrite, num_speculative_tokens=k,
        target_name=target_name, speculation=speculation, **engine_options,
    )


def _engine_dtypes(module) -> dict[str, torch.dtype]:
    """Export dtype name -> dtype of the serving tensors: :data:`EXPORT_DTYPES` plus the engine's
    ``EXTRA_DTYPES`` (llama.cpp's ``q8_0``, quantized when written)."""
    return {**EXPORT_DTYPES, **getattr(module, "EXTRA_DTYPES", {})}


def _draft_tokens(num_speculative_tokens: int | None, speculation: Speculation | None) -> int:
    """k: the speculation's depth, the given k, or 3.

    Raises:
        ValueError: if k < 1, or k and a speculation of another depth are both given.
    """
    if speculation is not None:
        if num_speculative_tokens not in (None, speculation.k):
            raise ValueError(f"num_speculative_tokens {num_speculative_tokens} and the speculation shape "
                             f"{speculation.tree} (depth {speculation.k}) disagree; give one of them")
        return speculation.k
    k = 3 if num_speculative_tokens is None else num_speculative_tokens
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    return k


def serving_target_name(source: HeadSource, target_name: str | None = None) -> str:
    """The name an export gives its target, for ``vllm serve``, speculators' ``verifier.name_or_path`` and the
    other launch lines: ``target_name`` when given; else ``source.target_name`` (an export directory being
    re-exported keeps its sidecar's name, ``read_export_source``); else the reference the user gave (a hub id,
    or a local path as written); else, for a reference only this machine can resolve (``tiny:``, ``pypi:``, a
    path inside the draftkit cache), the name of the local cache path (:func:`portable_path`), with a warning: the
    serving host will not find it.
    """
    if target_name or source.target_name:
        return target_name or source.target_name
    ref = source.target
    local = Path(ref).expanduser()
    in_cache = local.exists() and local.resolve().is_relative_to(cache_dir().resolve())
    if not (ref.startswith(("tiny:", "pypi:")) or in_cache):
        return ref
    name = portable_path(source.target_path)
    log.warning(
        "the export names its target by %s, the name of its local cache path (the checkpoint's target is %r, which "
        "only this machine resolves); a serving host will not find it: pass --target_name with the target's hub id "
        "or its path on the serving host", name, ref,
    )
    return name


def _as_text(value) -> str | None:
    """A reference as the sidecar's JSON holds it (a module given a ``Path`` as its target stores the ``Path``)."""
    return None if value is None else str(value)


def export_head_source(
    source: HeadSource,
    engine: str,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    num_speculative_tokens: int | None = None,
    target_name: str | None = None,
    speculation: Speculation | None = None,
    **engine_options,
) -> Path:
    """Export an already-read :class:`HeadSource` (see :func:`export_checkpoint` for the arguments and errors)."""
    from draftkit.export import ENGINES

    k = _draft_tokens(num_speculative_tokens, speculation)
    if speculation is not None:
        speculation.check_head(source.path, source.state)
        engine_options = {**engine_options, "tree": speculation.tree}
        hybrid = (speculation.report or {}).get("hybrid")
        if hybrid:
            engine_options["hybrid"] = hybrid
            if engine != "llamacpp":
                log.warning(
                    "%s: the report's choice was a hybrid with prompt lookup (+%s=%s); %s runs the head's shape "
                    "only, so the report's speedup, which counted the lookup rounds, is not what it will serve "
                    "(llama.cpp runs the hybrid: --to llamacpp)", engine, hybrid.get("mode"),
                    hybrid.get("lookup_tokens"), engine)
    source = dataclasses.replace(source, target_name=serving_target_name(source, target_name))

    module = ENGINES[engine]
    out_dir = Path(out_dir).expanduser().absolute()
    cfg, n_layers, aux = source.config, source.num_layers, source.aux_layer_ids
    model_type = getattr(source.target_config, "model_type", None)
    family_note = engine_family_warning(engine, model_type)
    if family_note:
        log.warning("%s", family_note)
    torch_dtype = _engine_dtypes(module)[dtype]
    if dtype == "float16":
        log.warning("exporting fp16 weights: fp16 drafts have overflowed to NaN logits in engines; prefer bfloat16")

    tensors = serving_tensors(source.state, torch_dtype, module.LAYER_PREFIX, cfg)
    validate_tensors(tensors, cfg, torch_dtype, module.LAYER_PREFIX, where=f"{source.path} -> {engine}")

    files = module.build_files(source, str(out_dir), dtype, k, engine_options)
    launch = files.get("launch") or _launch_command(module, source, str(out_dir), k, speculation)
    config, written = files["config"], files["engine_aux_layer_ids"]
    engine_version = files.get("engine_version", module.ENGINE_VERSION)

    meta = source.meta
    # the prompts the head trained on, so that a run continuing it validates on others (draftkit.data.trained_prompts)
    prompts = read_trained_prompts(source.path, "export") if Path(source.path).exists() else None
    sidecar = {
        "format": "draftkit-export",
        "format_version": FORMAT_VERSION,
        "draftkit_version": _draftkit_version(),
        "engine": engine,
        "engine_version": engine_version,
        **files.get("sidecar", {}),
        "dtype": dtype,
        "layer_prefix": module.LAYER_PREFIX,
        "source_checkpoint": portable_path(source.path),
        "target": source.target,
        # the target the head was trained on (an export of an export keeps the first one) and its architecture
        "trained_target": _as_text(meta.get("trained_target") or meta.get("target")),
        "target_architecture": meta.get("target_architecture") or target_architecture(source.target_config),
        "target_path": portable_path(source.target_path),
        "target_name": source.serving_name,
        "target_model_type": model_type,
        "target_dtype": meta.get("target_dtype"),
        "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
        "chat_template": meta.get("chat_template"),
        "target_num_layers": n_layers,
        "aux_layer_ids": aux,
        "aux_layer_ids_convention": "HF hidden_states index: id k = input of decoder layer k",
        "aux_layer_ids_default": source.default_aux,
        "engine_aux_layer_ids": written,
        "vocab": {
            "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size,
            "fingerprint": vocab_fingerprint(source.state["d2t"], cfg.vocab_size),
        },
        "head_config": head_config_dict(cfg),
        "ttt": meta.get("ttt"),
        # the longest sequence (tokens) the head was trained on; None for heads trained before it was recorded
        "trained_length": meta.get("trained_length"),
        # distinct first prompts it trained on, hashed in draftkit/trained_prompts.safetensors; None: not recorded
        "trained_prompts": None if prompts is None else len(prompts),
        "num_speculative_tokens": k,
        **({} if speculation is None else {"speculation": speculation.record(files.get("speculation"))}),
        "launch": launch,
    }
    note = (files.get("speculation") or {}).get("note") if speculation is not None else None
    if note:
        log.warning("%s: %s", engine, note)

    def check(tmp: Path) -> None:
        verify_export(tmp, source)

    json_files = {SIDECAR: sidecar} if config is None else {"config.json": config, SIDECAR: sidecar}
    extra = {} if prompts is None else {EXPORT_FILE: (write_trained_prompts, prompts)}
    path = write_directory(out_dir, tensors, json_files, files.get("text_files", {}), overwrite, check,
                           write_weights=files.get("write_weights"), extra_tensor_files=extra)
    log.info("exported %s for %s into %s", source.path, engine, path)
    return path


def _launch_command(module, source: HeadSource, out_dir: str, k: int, speculation: Speculation | None) -> str:
    """The engine's launch line; the tree goes to ``launch_command(..., tree=)`` only when one is given, so an
    engine written before trees (``launch_command(source, out_dir, k)``) still exports chains.

    Raises:
        ValueError: for a tree and an engine whose ``launch_command`` takes no ``tree``.
    """
    if speculation is None:
        return module.launch_command(source, out_dir, k)
    if "tree" not in inspect.signature(module.launch_command).parameters:
        if speculation.is_chain:
            return module.launch_command(source, out_dir, k)
        raise ValueError(f"engine {module.ENGINE!r} takes no tree shape (its launch_command has no `tree` "
                         f"parameter); export tree {speculation.tree} to sglang or trtllm, or a chain with -k")
    return module.launch_command(source, out_dir, k, tree=speculation.tree)


def _small_embedding(head: Eagle3LlamaHead, rows: torch.Tensor) -> None:
    """Replace the (V, H) embedding by a few random rows: enough for ids < len(rows), and cheap for big V."""
    head.embed_tokens = nn.Embedding.from_pretrained(rows, freeze=True)


@torch.no_grad()
def verify_export(directory: str | Path, source: HeadSource, seed: int = 0) -> float:
    """Self-check an export directory against the checkpoint it came from (§7.6.2).

    1. :func:`load_exported_head` rebuilds the head from the files (strict keys, shapes, dtypes, d2t, flags,
       config/sidecar agreement).
    2. The checkpoint's head with its weights rounded to the export dtype and the rebuilt head run the same
       random serving pass in fp32: a 5-token prefill from random aux states, then 3 chained single-token
       steps with the KV cache. Their logits must be equal.
    3. :func:`reference_forward` on the raw exported tensors must reproduce the same logits (RoPE from the
       config's ``rope_theta``; skipped for scaled RoPE).

    Args:
        directory: the (temporary) export directory.
        source: the checkpoint it was written from.
        seed: seed of the random inputs.

    Returns:
        The largest absolute logit difference found.

    Raises:
        ValueError: when a check fails (names the directory, the step and the difference).
    """
    from draftkit.export import ENGINES

    directory = Path(directory)
    loaded, _ = load_exported_head(directory)
    cfg = source.config
    config, sidecar, tensors = read_export(directory)
    dtype = tensors["fc.weight"].dtype
    original = Eagle3LlamaHead(cfg)
    round_weights = getattr(ENGINES[sidecar["engine"]], "round_weights", None)  # an engine that quantizes (q8_0)
    if round_weights is not None:
        rounded = round_weights(source.state, sidecar["dtype"])
    else:
        rounded = {k: (v.to(dtype).float() if v.is_floating_point() else v) for k, v in source.state.items()}
    original.load_state_dict(rounded, strict=False)
    original.eval()

    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(min(cfg.vocab_size, 64), cfg.hidden_size, generator=g)  # (64, H)
    _small_embedding(original, rows)
    _small_embedding(loaded, rows)
    t = 5
    ids = torch.randint(0, rows.shape[0], (1, t + 4), generator=g)  # (1, T+4)
    aux = torch.randn(1, t, cfg.num_aux_layers * cfg.target_hidden_size, generator=g)  # (1, T, n*H_t)
    ref_config = dict(config.get("transformer_layer_config", config))
    ref_config.update({flag: bool(getattr(cfg, flag)) for flag in NORM_FLAGS})
    run_reference = not ref_config.get("rope_scaling")

    worst = 0.0
    caches = (KVCache(), KVCache())
    feats = (original.project(aux), loaded.project(aux))
    past = None
    ref_feat = aux
    for step in range(4):
        lo, hi = (0, t) if step == 0 else (t + step - 1, t + step)
        pos = torch.arange(lo, hi)[None]  # (1, T') positions
        outs = [head(ids[:, lo + 1:hi + 1], f, pos, cache=c)
                for head, f, c in zip((original, loaded), feats, caches)]
        (la, ha), (lb, hb) = outs
        diff = float((la - lb).abs().max())
        worst = max(worst, diff)
        if diff != 0.0:
            raise ValueError(f"{directory}: reloaded head differs from the checkpoint at draft step {step} "
                             f"(max |logit diff| {diff:.3g})")
        if run_reference:
            lr, hr, past = reference_forward(tensors, ref_config, ids[:, lo + 1:hi + 1], ref_feat, pos, rows,
                                             past=past, project=step == 0)
            diff = float((lr - la).abs().max())
            tol = 1e-4 * max(1.0, float(la.abs().max()))
            worst = max(worst, diff)
            if diff > tol:
                raise ValueError(f"{directory}: reference forward differs from the head at draft step {step} "
                                 f"(max |logit diff| {diff:.3g} > {tol:.3g}); the config does not describe the weights")
            ref_feat = hr[:, -1:]
        feats = (ha[:, -1:], hb[:, -1:])
    return worst
