"""Read an export directory back: the reference loader and a plain reference forward (eagle3-format.md §3, §7.6).

:func:`load_exported_head` rebuilds an :class:`Eagle3LlamaHead` from ``config.json`` + ``model.safetensors``
(the sidecar gives the target metadata and the layer count N needed to decode the engine's aux ids) and checks
that the config, the weights and the sidecar agree. :func:`reference_forward` is an independent functional
implementation of one draft step written from §3 that runs directly on the exported tensors; tests and the
export self-check compare it with the training module.

Shapes: B batch, T new tokens, S cached positions, H draft hidden, H_t target hidden, n aux layers,
A heads, A_kv kv heads, d head dim, V target vocab, V_d draft vocab, N target layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from draftkit.export.common import NORM_FLAGS, SIDECAR, head_config_dict, validate_tensors
from draftkit.heads.checkpoint import (
    HeadSource, check_architecture, check_tokenizer, head_from_checkpoint, head_source,
)
from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead

__all__ = ["load_exported_head", "load_head", "read_export", "reference_forward"]

_STRUCTURAL = (
    "hidden_size", "target_hidden_size", "num_aux_layers", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "rms_norm_eps",
    "max_position_embeddings", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "aux_layer_ids",
)


def read_export(directory: str | Path) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """Read the files of an export directory.

    Args:
        directory: an export directory.

    Returns:
        (config.json dict, sidecar dict, tensors by name as stored). An engine with its own weight format
        (``read_files``, e.g. llama.cpp's GGUF) gives its config view and the tensors under draftkit names.

    Raises:
        FileNotFoundError: if the directory or one of ``config.json``, ``model.safetensors``,
            ``draftkit_export.json`` (or the engine's own file) is missing.
    """
    from safetensors.torch import load_file

    from draftkit.export import ENGINES

    directory = Path(directory)
    if not (directory / SIDECAR).is_file():
        raise FileNotFoundError(f"{directory} is not a draftkit export directory: {SIDECAR} is missing")
    sidecar = json.loads((directory / SIDECAR).read_text())
    read_files = getattr(ENGINES.get(sidecar.get("engine")), "read_files", None)
    if read_files is not None:
        config, tensors = read_files(directory, sidecar)
        return config, sidecar, tensors
    for name in ("config.json", "model.safetensors"):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory} is not a draftkit export directory: {name} is missing")
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    return config, sidecar, tensors


def load_exported_head(
    directory: str | Path,
    embedding: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Eagle3LlamaHead, dict]:
    """Rebuild the draft head of an export directory (any engine layout).

    The head shape comes from ``config.json`` (for speculators: ``transformer_layer_config`` plus the top-level
    EAGLE fields), the aux ids from the engine's own key decoded with that engine's rule, the weights from
    ``model.safetensors``; the sidecar supplies N and the training metadata and must agree with all of it.
    Like ``head_from_checkpoint``, the returned head's ``embed_tokens`` is uninitialised unless the export
    carries one (H != H_t) or ``embedding`` is given.

    Args:
        directory: an export directory written by ``draftkit export``.
        embedding: optional (V, H) target input embedding to load into ``embed_tokens``.
        dtype: dtype of the returned head (float32 reproduces the training module's logits).

    Returns:
        (head in eval mode, meta) with meta keys as ``head_from_checkpoint``'s (``head_config``, ``target``,
        ``target_dtype``, ``aux_layer_ids``, ``chat_template``, ``ttt``) plus ``engine``, ``engine_version``,
        ``dtype`` and ``export`` (the whole sidecar).

    Raises:
        FileNotFoundError: if a file of the export is missing.
        ValueError: if a norm flag is missing or set to a variant draftkit heads do not have, the tensors fail
            the strict checks (names, shapes, dtypes, d2t invariants), or config.json and the sidecar disagree.
    """
    directory = Path(directory)
    config, sidecar, tensors = read_export(directory)
    from draftkit.export import ENGINES

    engine = sidecar.get("engine")
    if engine not in ENGINES:
        raise ValueError(f"{directory}: unknown engine {engine!r} in {SIDECAR}; known: {', '.join(ENGINES)}")
    module = ENGINES[engine]
    layer, eagle, written = module.read_view(directory, config, sidecar)
    prefix = module.LAYER_PREFIX

    missing_flags = [f for f in NORM_FLAGS if f not in eagle]
    if missing_flags:
        raise ValueError(f"{directory}/config.json: norm flags {missing_flags} are missing; all four must be explicit")
    if ("input_norm.weight" in tensors) != bool(eagle["norm_before_fc"]):
        raise ValueError(f"{directory}: input_norm.weight present iff norm_before_fc, and they disagree")

    num_layers = int(sidecar["target_num_layers"])
    aux = module.from_engine_ids(written, num_layers, sidecar)
    hidden = int(layer["hidden_size"])
    target_hidden = eagle.get("target_hidden_size") or hidden
    rope = {"rope_theta": layer["rope_theta"], "rope_scaling": layer.get("rope_scaling")}
    cfg = Eagle3Config(
        hidden_size=hidden,
        target_hidden_size=int(target_hidden),
        num_aux_layers=len(aux),
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer["num_key_value_heads"]),
        head_dim=int(layer.get("head_dim") or hidden // int(layer["num_attention_heads"])),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(eagle.get("draft_vocab_size") or layer["vocab_size"]),
        rms_norm_eps=float(layer["rms_norm_eps"]),
        max_position_embeddings=int(layer["max_position_embeddings"]),
        rope=rope,
        **{flag: bool(eagle[flag]) for flag in NORM_FLAGS},
        aux_layer_ids=aux,
    )
    stored_dtype = tensors["fc.weight"].dtype
    if str(stored_dtype).removeprefix("torch.") != layer.get("torch_dtype"):
        raise ValueError(
            f"{directory}: config.json torch_dtype {layer.get('torch_dtype')!r} but weights are {stored_dtype}"
        )
    validate_tensors(tensors, cfg, stored_dtype, prefix, where=f"{directory}/model.safetensors")

    recorded = sidecar.get("head_config", {})
    rebuilt = head_config_dict(cfg)
    rebuilt["aux_layer_ids"] = aux
    recorded = {**dict.fromkeys(NORM_FLAGS, False), **recorded, "aux_layer_ids": sidecar.get("aux_layer_ids")}  # older sidecars
    diff = {k: (rebuilt[k], recorded.get(k)) for k in _STRUCTURAL if rebuilt[k] != recorded.get(k)}
    if diff:
        raise ValueError(f"{directory}: config.json and {SIDECAR} disagree on {diff} (config value, sidecar value)")

    head = Eagle3LlamaHead(cfg)
    state = {}
    for name, value in tensors.items():
        if name.startswith(prefix):
            name = "midlayer." + name[len(prefix):]
        state[name] = value
    result = head.load_state_dict(state, strict=False)
    absent = ("embed_tokens.",) + (("d2t", "t2d") if cfg.draft_vocab_size == cfg.vocab_size else ())
    missing = [k for k in result.missing_keys if not k.startswith(absent)]  # V_d == V: the identity it starts with
    if missing or result.unexpected_keys:
        raise ValueError(f"{directory}: head keys missing {missing}, unexpected {result.unexpected_keys}")
    head = head.to(dtype)
    if embedding is not None:
        head.load_embedding(embedding.to(dtype))
    meta = {
        "head_config": head_config_dict(cfg),
        "target": sidecar.get("target"),
        "target_dtype": sidecar.get("target_dtype"),
        "aux_layer_ids": aux,
        "chat_template": sidecar.get("chat_template"),
        "ttt": sidecar.get("ttt"),
        "trained_length": sidecar.get("trained_length"),
        "engine": engine,
        "engine_version": sidecar.get("engine_version"),
        "dtype": str(stored_dtype).removeprefix("torch."),
        "export": sidecar,
    }
    return head.eval(), meta


def read_export_source(directory: str | Path, target: str | None = None) -> HeadSource:
    """An export directory as a :class:`HeadSource`, so that ``draftkit export`` re-exports a shipped head for
    another engine: :func:`load_exported_head` rebuilds it in float32 (exact for bf16/fp16 weights), the weights
    are cast back to their stored dtype (so a re-export in that dtype writes the same bytes), then
    :func:`draftkit.heads.checkpoint.head_source` runs the checks a training checkpoint gets.

    Args:
        directory: an export directory written by ``draftkit export`` (any engine layout).
        target: a target reference overriding the sidecar's ``target``.

    Returns:
        The :class:`HeadSource`; ``meta`` is the sidecar (its ``head_config`` as the source checkpoint had it);
        ``target_name`` is the sidecar's (the name the serving host loads the target by) unless ``target``
        overrides the target or that name was only this machine's cache path (``target_path``).

    Raises:
        FileNotFoundError, ValueError: as :func:`load_exported_head` and ``head_source``.
    """
    directory = Path(directory)
    head, meta = load_exported_head(directory)  # float32: exact for bf16/fp16 weights, cast back below
    stored = getattr(torch, meta["dtype"])
    state = {k: v.to(stored) if v.is_floating_point() else v for k, v in head.state_dict().items()}
    source = head_source(directory, state, {**meta, **meta["export"]}, target)  # the sidecar as written wins
    name = meta["export"].get("target_name")
    if target is None and name and name != meta["export"].get("target_path"):
        source = dataclasses.replace(source, target_name=name)
    return source


def load_head(checkpoint: str | Path, target: str | None = None):
    """Load a head from a training checkpoint (``.ckpt``) or an exported head directory.

    Args:
        checkpoint: the ``.ckpt`` or export directory.
        target: a target reference overriding the recorded one (checked against the checkpoint).

    Returns:
        (head in eval mode, metadata dict with ``head_config``, ``target``, ``target_dtype``,
        ``aux_layer_ids``, ``chat_template``).

    Raises:
        FileNotFoundError: if the path does not exist.
        ValueError: if it cannot be read as a checkpoint or export, has non-finite weights, or the target's
            tokenizer differs from the one it was trained with (``heads.checkpoint.check_tokenizer``).
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint: {path} does not exist; give a .ckpt from draftkit fit or an export directory")
    if path.is_dir():
        head, meta = load_exported_head(path)
        from draftkit.artifacts import resolve_model_dir

        if target is not None:  # as a training checkpoint's --target is checked (heads.checkpoint)
            check_architecture(path, meta["export"], target)
        check_tokenizer(meta["export"], resolve_model_dir(target or meta["target"], "target"), f"export {path}")
        return head, meta
    return head_from_checkpoint(path, target)


# -- reference forward (§3), independent of draftkit.heads ------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (..., d)


def reference_forward(
    weights: dict[str, torch.Tensor],
    config: dict,
    input_ids: torch.Tensor,
    feature: torch.Tensor,
    position_ids: torch.Tensor,
    embedding: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor] | None = None,
    project: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One EAGLE3 draft step computed directly from the exported tensors, in fp32 (eagle3-format.md §3).

    Steps: (1) g = fc(F) when ``feature`` has the fc input width, else g = feature (the previous pre-norm h);
    (2) e = embedding[tokens]; (3) u = cat(input_layernorm(e), hidden_norm(g)); (4) residual r = g, or
    hidden_norm(g) with ``norm_before_residual``; (5) causal GQA attention of q, k, v = proj(u) with plain RoPE
    (rotate-half, theta from the config) over ``past`` plus the new keys, h1 = o_proj(attn) + r;
    (6) h = h1 + mlp(post_attention_layernorm(h1)); (7) logits = lm_head(norm(h)) over the draft vocab.
    EAGLE-3.1: before ``fc``, ``norm_before_fc`` applies ``input_norm`` to F and ``fc_norm`` one ``fc_norm.{i}``
    per H_t-wide aux chunk; ``norm_output`` returns norm(h) as the next feature.

    Args:
        weights: exported tensors (``midlayer.*`` or ``layers.0.*`` names).
        config: the engine ``config.json`` (for speculators its ``transformer_layer_config`` merged with the
            top-level flags); reads hidden_size, num_attention_heads, num_key_value_heads, head_dim,
            rms_norm_eps, rope_theta, rope_scaling (must be null) and the norm flags.
        input_ids: (B, T) int64 token ids (row t carries x_{t+1}).
        feature: (B, T, n*H_t) aux states for step 0, or (B, T, H) the previous step's h.
        position_ids: (B, T) int64 RoPE positions.
        embedding: (V, H) input embedding.
        past: (keys, values), each (B, A_kv, S, d) after RoPE, or None.
        project: apply ``fc`` to ``feature`` (step 1); None decides by width (fc input width != H).

    Returns:
        logits (B, T, V_d) fp32, the next step's feature (B, T, H) fp32 (pre-norm h, or norm(h) with
        ``norm_output``), and the new (keys, values) (B, A_kv, S+T, d).

    Raises:
        NotImplementedError: for scaled RoPE (``rope_scaling`` not null).
    """
    if config.get("rope_scaling"):
        raise NotImplementedError("reference_forward implements plain RoPE only (rope_scaling must be null)")
    prefix = "layers.0." if "layers.0.hidden_norm.weight" in weights else "midlayer."
    w = {k: v.float() for k, v in weights.items() if v.is_floating_point()}

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ w[name].T

    hidden = int(config["hidden_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    d = int(config.get("head_dim") or hidden // heads)
    eps = float(config["rms_norm_eps"])
    b, t = input_ids.shape

    g = feature.float()
    if (g.shape[-1] != hidden) if project is None else project:
        if config.get("norm_before_fc"):
            g = _rms_norm(g, w["input_norm.weight"], eps)
        if config.get("fc_norm"):
            width = w["fc_norm.0.weight"].numel()
            g = torch.cat([_rms_norm(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(g.split(width, -1))], -1)
        g = lin(g, "fc.weight")  # (B, T, n*H_t) -> (B, T, H)
    e = embedding.float()[input_ids]  # (B, T, H)
    g_normed = _rms_norm(g, w[f"{prefix}hidden_norm.weight"], eps)
    u = torch.cat([_rms_norm(e, w[f"{prefix}input_layernorm.weight"], eps), g_normed], dim=-1)  # (B, T, 2H)
    residual = g_normed if config.get("norm_before_residual") else g

    q = lin(u, f"{prefix}self_attn.q_proj.weight").view(b, t, heads, d).transpose(1, 2)  # (B, A, T, d)
    k = lin(u, f"{prefix}self_attn.k_proj.weight").view(b, t, kv_heads, d).transpose(1, 2)  # (B, A_kv, T, d)
    v = lin(u, f"{prefix}self_attn.v_proj.weight").view(b, t, kv_heads, d).transpose(1, 2)  # (B, A_kv, T, d)
    # theta_i = base^(-2i/d), computed in fp32 as Llama does
    inv_freq = 1.0 / (float(config["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (d/2,)
    angles = position_ids.float()[..., None] * inv_freq  # (B, T, d/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, d)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # (B, 1, T, d)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if past is not None:
        k = torch.cat([past[0].float(), k], dim=2)  # (B, A_kv, S+T, d)
        v = torch.cat([past[1].float(), v], dim=2)  # (B, A_kv, S+T, d)
    s = k.shape[2]
    groups = heads // kv_heads
    kk = k.repeat_interleave(groups, dim=1)  # (B, A, S+T, d)
    vv = v.repeat_interleave(groups, dim=1)  # (B, A, S+T, d)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(d)  # (B, A, T, S+T)
    allowed = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)  # new row i sees keys <= S + i
    scores = scores.masked_fill(~allowed, float("-inf"))
    attn = (scores.softmax(-1) @ vv).transpose(1, 2).reshape(b, t, heads * d)  # (B, T, A*d)
    h1 = lin(attn, f"{prefix}self_attn.o_proj.weight") + residual  # (B, T, H)

    x = _rms_norm(h1, w[f"{prefix}post_attention_layernorm.weight"], eps)
    mlp = lin(F.silu(lin(x, f"{prefix}mlp.gate_proj.weight")) * lin(x, f"{prefix}mlp.up_proj.weight"),
              f"{prefix}mlp.down_proj.weight")
    h = h1 + mlp  # (B, T, H), pre-norm
    normed = _rms_norm(h, w["norm.weight"], eps)
    logits = lin(normed, "lm_head.weight")  # (B, T, V_d)
    return logits, (normed if config.get("norm_output") else h), (k, v)
