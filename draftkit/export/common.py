"""Shared export machinery: read a training checkpoint, name/cast/validate the serving tensors, write atomically.

Every engine directory holds ``config.json``, ``model.safetensors`` and the ``draftkit_export.json`` sidecar
(eagle3-format.md §7). The tensor set is the same for all engines (§2, §7.1): ``fc.weight``,
``<prefix>{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``<prefix>self_attn.{q,k,v,o}_proj.weight``, ``<prefix>mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t`` (int64) and ``t2d`` (bool), with ``<prefix>`` = ``midlayer.`` (vLLM, SGLang,
TensorRT-LLM) or ``layers.0.`` (speculators). ``embed_tokens.weight`` is written only when H != H_t.

Layer ids stay HF ``hidden_states`` indices here; each engine module converts them in one function.

Shapes: H draft hidden, H_t target hidden, n aux layers, I MLP width, A heads, A_kv kv heads, d head dim,
V target vocab, V_d draft vocab, N target layers.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.selection.layers import default_aux_layer_ids, validate_aux_layer_ids
from draftkit.selection.vocab import VocabMap

__all__ = [
    "DTYPES",
    "ENGINES",
    "SIDECAR",
    "HeadSource",
    "expected_tensor_specs",
    "llama_config_fields",
    "norm_flags",
    "read_checkpoint",
    "rope_legacy_fields",
    "serving_tensors",
    "validate_tensors",
    "vocab_fingerprint",
    "write_directory",
]

log = logging.getLogger(__name__)

ENGINES = ("vllm", "speculators", "sglang", "trtllm")
"""Export targets accepted by ``draftkit export --to``."""

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""Weight dtypes an export may be written in (bf16 is the default; §7.1)."""

SIDECAR = "draftkit_export.json"
"""Sidecar file name; engines ignore it."""

HEAD_PREFIX = "head."
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class HeadSource:
    """A trained head read from a checkpoint, checked against its target.

    Attributes:
        path: the checkpoint file.
        state: serving tensors by draftkit name (``midlayer.*``, ``fc.weight``, ..., ``d2t``, ``t2d``), as stored.
        config: the head shape.
        meta: the checkpoint's ``draftkit`` metadata (head_config, target, target_dtype, aux_layer_ids, ...).
        target: the target reference used (``meta["target"]`` unless overridden).
        target_path: what ``from_pretrained`` loads for it (local directory or hub id).
        target_config: the target's Hugging Face text config.
        num_layers: N, the target's decoder layers.
        aux_layer_ids: HF ``hidden_states`` indices the head reads, validated against N.
    """

    path: Path
    state: dict[str, torch.Tensor]
    config: Eagle3Config
    meta: dict
    target: str
    target_path: str
    target_config: Any
    num_layers: int
    aux_layer_ids: list[int]

    @property
    def default_aux(self) -> bool:
        """True when the ids equal the EAGLE3 rule [2, N//2, N-3] (engines then use their own default)."""
        return self.aux_layer_ids == default_aux_layer_ids(self.num_layers)


def _load_target_config(target: str):
    from transformers import AutoConfig

    from draftkit.artifacts import resolve_model_dir

    path = resolve_model_dir(target, option="target")
    cfg = AutoConfig.from_pretrained(path)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return path, cfg


def read_checkpoint(path: str | Path, target: str | None = None) -> HeadSource:
    """Read the head of a draftkit training checkpoint and check it against its target.

    Args:
        path: a ``.ckpt`` written by ``draftkit fit`` (``state_dict["head.*"]`` plus ``checkpoint["draftkit"]``).
        target: a target reference overriding ``meta["target"]`` (local dir, hub id, ``pypi:`` or GGUF).

    Returns:
        The :class:`HeadSource`.

    Raises:
        FileNotFoundError: if the checkpoint (or a local target) does not exist.
        ValueError: if the file is not a draftkit checkpoint, lacks the draft-vocab map ``d2t`` while
            V_d < V, has missing or unexpected head tensors, was trained for a target with another hidden
            size or vocabulary (names both), or reads aux layers the target does not have.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # any unpickling failure means an unreadable file
        raise ValueError(f"checkpoint {path} could not be read ({exc}); is it a complete .ckpt file?") from exc
    meta = ckpt.get("draftkit") if isinstance(ckpt, dict) else None
    if not isinstance(meta, dict) or "head_config" not in meta:
        raise ValueError(
            f"{path} is not a draftkit training checkpoint (no 'draftkit' metadata with 'head_config'); "
            "export a .ckpt written by `python -m draftkit fit`"
        )
    cfg = Eagle3Config(**meta["head_config"])
    state = {k[len(HEAD_PREFIX):]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith(HEAD_PREFIX)}
    state = {k: v for k, v in state.items() if not k.startswith("rotary_emb.")}
    own_embedding = cfg.hidden_size != cfg.target_hidden_size
    if not own_embedding:
        state.pop("embed_tokens.weight", None)  # the engines share the target's embedding (§7.1)

    if "d2t" not in state:
        if cfg.draft_vocab_size < cfg.vocab_size:
            raise ValueError(
                f"checkpoint {path} has no draft-vocab map (head.d2t) but its draft vocab is smaller than the "
                f"target's (V_d={cfg.draft_vocab_size} < V={cfg.vocab_size}); without d2t every engine would map "
                "draft id i to target id i. Re-save the checkpoint from a run that built its VocabMap"
            )
        log.info("%s: no d2t and V_d == V: writing the identity map (zeros)", path)
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        vm = state["d2t"].to(torch.long)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        ids = torch.arange(vm.numel()) + vm
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            raise ValueError(f"checkpoint {path}: head.d2t maps outside the target vocab [0, {cfg.vocab_size})")
        t2d[ids] = True
        state["t2d"] = t2d

    expected = expected_tensor_specs(cfg, "midlayer.")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path}: head tensors missing {missing}, unexpected {unexpected}"
            + ("; a head with H != H_t needs its own embed_tokens.weight (V, H) in the checkpoint" if
               "embed_tokens.weight" in missing else "")
        )

    target_ref = str(target if target is not None else meta.get("target") or "")
    if not target_ref:
        raise ValueError(f"checkpoint {path} names no target (meta['target']); pass --target")
    target_path, tcfg = _load_target_config(target_ref)
    t_hidden, t_vocab = int(tcfg.hidden_size), int(tcfg.vocab_size)
    if t_hidden != cfg.target_hidden_size or t_vocab != cfg.vocab_size:
        raise ValueError(
            f"checkpoint {path} was trained for a target with hidden size {cfg.target_hidden_size} and vocab "
            f"{cfg.vocab_size}, but target {target_ref!r} ({target_path}) has hidden_size {t_hidden} and "
            f"vocab_size {t_vocab}; export against the target the head was trained on (--target)"
        )
    num_layers = int(tcfg.num_hidden_layers)
    ids = meta.get("aux_layer_ids") or cfg.aux_layer_ids or None
    aux = validate_aux_layer_ids(ids, num_layers, option=f"{path}: aux_layer_ids")
    if len(aux) != cfg.num_aux_layers:
        raise ValueError(
            f"checkpoint {path}: {len(aux)} aux layer ids {aux} but fc reads {cfg.num_aux_layers} aux states"
        )
    return HeadSource(
        path=path, state=state, config=cfg, meta=meta, target=target_ref, target_path=str(target_path),
        target_config=tcfg, num_layers=num_layers, aux_layer_ids=aux,
    )


def expected_tensor_specs(cfg: Eagle3Config, layer_prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The exact serving tensor set of a head (§2, §7.1): name -> (shape, kind).

    Args:
        cfg: the head shape.
        layer_prefix: ``"midlayer."`` or ``"layers.0."``.

    Returns:
        ``kind`` is ``"float"`` for weights, ``"int64"`` for ``d2t`` and ``"bool"`` for ``t2d``.
        ``embed_tokens.weight`` (V, H) is included only when H != H_t.
    """
    h, ht, n = cfg.hidden_size, cfg.target_hidden_size, cfg.num_aux_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    p = layer_prefix
    specs = {
        "fc.weight": ((h, n * ht), "float"),
        f"{p}input_layernorm.weight": ((h,), "float"),
        f"{p}hidden_norm.weight": ((h,), "float"),
        f"{p}self_attn.q_proj.weight": ((q, 2 * h), "float"),
        f"{p}self_attn.k_proj.weight": ((kv, 2 * h), "float"),
        f"{p}self_attn.v_proj.weight": ((kv, 2 * h), "float"),
        f"{p}self_attn.o_proj.weight": ((h, q), "float"),
        f"{p}post_attention_layernorm.weight": ((h,), "float"),
        f"{p}mlp.gate_proj.weight": ((cfg.intermediate_size, h), "float"),
        f"{p}mlp.up_proj.weight": ((cfg.intermediate_size, h), "float"),
        f"{p}mlp.down_proj.weight": ((h, cfg.intermediate_size), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((cfg.draft_vocab_size, h), "float"),
        "d2t": ((cfg.draft_vocab_size,), "int64"),
        "t2d": ((cfg.vocab_size,), "bool"),
    }
    if h != ht:
        specs["embed_tokens.weight"] = ((cfg.vocab_size, h), "float")
    return specs


def serving_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype, layer_prefix: str) -> dict[str, torch.Tensor]:
    """Rename and cast draftkit head tensors for an engine.

    Args:
        state: tensors under draftkit names (``midlayer.*``, ...).
        dtype: weight dtype; ``d2t`` becomes int64 and ``t2d`` bool whatever it is.
        layer_prefix: ``"midlayer."`` (kept) or ``"layers.0."`` (speculators rename).

    Returns:
        A new dict of contiguous tensors.
    """
    out = {}
    for name, value in state.items():
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
        ValueError: on a missing or unexpected name, a wrong shape or dtype, non-finite weights, a d2t that
            breaks the §5 invariants (ids strictly increasing in [0, V), t2d marks exactly those ids), or a
            non-zero d2t when V_d == V.
    """
    specs = expected_tensor_specs(cfg, layer_prefix)
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
        if kind == "float" and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: {name} has non-finite values (NaN/inf); the head would draft garbage")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    try:
        VocabMap(d2t=d2t, t2d=t2d).validate()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if cfg.draft_vocab_size == cfg.vocab_size and bool(d2t.any()):
        raise ValueError(f"{where}: V_d == V but d2t is not all zeros (the identity map must be zeros, never arange)")


def vocab_fingerprint(d2t: torch.Tensor, vocab_size: int) -> str:
    """sha256 over V and the int64 bytes of d2t: equal fingerprints mean the same draft vocab."""
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
    """All four norm flags, always explicit (§3, §7). Only ``norm_before_residual`` is ever true in draftkit."""
    return {
        "norm_before_residual": bool(cfg.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    }


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


def write_directory(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    json_files: dict[str, dict],
    text_files: dict[str, str],
    overwrite: bool,
    check,
) -> Path:
    """Write an export directory atomically: build it in a temporary sibling, check it, then rename.

    Args:
        out_dir: the final directory.
        tensors: written to ``model.safetensors`` (with ``{"format": "pt"}`` metadata).
        json_files: file name -> JSON object (``config.json``, the sidecar, ...).
        text_files: file name -> text.
        overwrite: replace an existing ``out_dir``.
        check: ``check(tmp_dir)`` runs on the finished temporary directory before the rename; it raises to abort.

    Returns:
        The final directory path.

    Raises:
        FileExistsError: if ``out_dir`` exists and ``overwrite`` is false.
        Exception: whatever ``check`` raises; the temporary directory is removed and ``out_dir`` is untouched.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"export directory {out_dir} already exists; pass --overwrite to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = None
    try:
        _write_safetensors(tensors, tmp / "model.safetensors", {"format": "pt"})
        for name, obj in json_files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        for name, text in text_files.items():
            (tmp / name).write_text(text)
        check(tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "dir")
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            if old is not None:  # put the previous export back rather than leave nothing
                os.replace(old / "dir", out_dir)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out_dir
