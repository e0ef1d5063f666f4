"""The one reader of draftkit training checkpoints (``.ckpt``): used by ``evaluate``, ``export`` and ``bench``.

A draftkit Lightning checkpoint stores the head under ``state_dict["head.*"]`` without the frozen
``embed_tokens`` copy and without the target, plus ``checkpoint["draftkit"]`` with the metadata needed to
rebuild it: ``head_config`` (:class:`Eagle3Config` fields, including ``aux_layer_ids``, the HF
``hidden_states`` indices the head reads: stored there once), ``target`` (the recipe reference),
``target_dtype``, ``chat_template`` (or None for the tokenizer's own) and ``ttt`` (steps, decay).

:func:`read_checkpoint` checks a checkpoint against its target (names, shapes, draft vocab, hidden size,
vocabulary, aux ids); :func:`head_from_checkpoint` builds the head from what it read, so a checkpoint
``evaluate`` accepts is one ``export`` accepts. The metadata's writer sits beside its readers:
:func:`checkpoint_tensors` and :func:`checkpoint_metadata` (what ``Eagle3Module.on_save_checkpoint`` stores),
:func:`read_training_state` and :func:`check_resumed_aux_ids` (what a resumed run reads back).
:func:`check_head_matches_target` checks a head built in memory against a loaded target (evaluate, bench, the
acceptance callback).

Shapes: H draft hidden, H_t target hidden, n aux layers, I MLP width, A heads, A_kv kv heads, d head dim,
V target vocab, V_d draft vocab, N target layers.
"""

from __future__ import annotations

import dataclasses
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.selection.layers import default_aux_layer_ids, validate_aux_layer_ids
from draftkit.target.frozen import text_config

__all__ = [
    "ARCHITECTURE_FIELDS", "HEAD_PREFIX", "HeadSource", "check_finite", "check_head_matches_target",
    "check_architecture", "check_resumed_aux_ids", "check_tokenizer", "checkpoint_metadata", "checkpoint_tensors", "expected_tensor_specs",
    "head_fingerprint", "head_from_checkpoint", "load_checkpoint", "read_checkpoint", "read_training_state", "target_architecture",
]

log = logging.getLogger(__name__)

HEAD_PREFIX = "head."
"""Prefix of the head's tensors in a training checkpoint's ``state_dict``."""

ARCHITECTURE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "vocab_size")
"""The target (text) config fields a head is tied to: its aux ids index the layers, ``fc`` reads the hidden
states, and what the states mean depends on the model family. A fine-tune or a quantization of the training
target keeps them all; another family or size changes some."""


def target_architecture(config) -> dict:
    """``{field: value}`` of :data:`ARCHITECTURE_FIELDS` of a target's (text) ``PretrainedConfig``; stored in
    checkpoints (``draftkit.target_architecture``) and export sidecars."""
    cfg = text_config(config)
    return {f: getattr(cfg, f, None) for f in ARCHITECTURE_FIELDS}


def head_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """16 hex digits naming a draft head's weights, the same for the head in every form it is read in: a training
    checkpoint (float32), an export in bfloat16 or float32, or the head as ``evaluate`` loaded it. Float tensors are
    hashed rounded to bfloat16 (the default export dtype, so float32 and bf16 copies agree); ``d2t``/``t2d`` as
    stored; the frozen ``embed_tokens`` copy of the target (absent from most exports) and rotary buffers are left
    out. A float16 export rounds twice, so it may name another fingerprint than its checkpoint.

    Args:
        state: head tensors by draftkit name (``HeadSource.state``, or an ``Eagle3LlamaHead.state_dict()``).

    Returns:
        The fingerprint (sha256 of names, shapes and bytes, first 16 hex digits).
    """
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state):
        if name.startswith(("embed_tokens.", "rotary_emb.")):
            continue
        tensor = state[name].detach().to("cpu")
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16)
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


# -- writing: what a training run stores, and what a resumed run reads back ----------------------------------
def checkpoint_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a training checkpoint keeps of a module's ``state_dict``: the head's (:data:`HEAD_PREFIX`)
    without the frozen ``embed_tokens`` copy and the rotary buffers, and the metrics' states (``train_``,
    ``val_``, ``kept_``); never the target."""
    return {
        k: v for k, v in state_dict.items()
        if k.startswith(HEAD_PREFIX) and not k.startswith((f"{HEAD_PREFIX}embed_tokens.", f"{HEAD_PREFIX}rotary_emb."))
        or k.startswith(("train_", "val_", "kept_"))
    }


def checkpoint_metadata(head_config: Eagle3Config, target: str, target_config, target_dtype: str,
                        chat_template: str | None, tokenizer_fingerprint: str | None, ttt: dict,
                        training: dict) -> dict:
    """``checkpoint["draftkit"]``: what every verb reads back to rebuild and check the head, and the training
    state a resumed run continues from.

    Args:
        head_config: the head's shape (stored as ``head_config``, the aux ids included).
        target: the recipe's target reference.
        target_config: the target's Hugging Face config (its :func:`target_architecture` is stored: evaluate and
            export refuse a target of another architecture).
        target_dtype: the resolved dtype the target ran in.
        chat_template: the training template, or None for the tokenizer's own.
        tokenizer_fingerprint: ``draftkit.target.tokens.tokenizer_identity`` of the training tokenizer.
        ttt: the TTT settings (steps, decay).
        training: ``tokens_trained``, ``trained_length`` (the longest sequence trained, tokens; 0 = none: evaluate
            warns past it, exports carry it), ``lr_horizon``, ``lr_anchor`` (a tuple or None) and
            ``planned_total`` (:func:`read_training_state` reads them back).
    """
    return {
        "head_config": dataclasses.asdict(head_config),
        "target": target,
        "target_architecture": target_architecture(target_config),
        "target_dtype": target_dtype,
        "chat_template": chat_template,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "ttt": ttt,
        "tokens_trained": training["tokens_trained"],
        "trained_length": training["trained_length"] or None,
        "lr_horizon": training["lr_horizon"],
        "lr_anchor": None if training["lr_anchor"] is None else list(training["lr_anchor"]),
        "planned_total": training["planned_total"],
    }


def read_training_state(meta: dict, max_steps=None) -> dict:
    """The training state of :func:`checkpoint_metadata`, as a resumed run continues from it.

    Args:
        meta: ``checkpoint["draftkit"]``.
        max_steps: the checkpoint's recorded ``trainer.max_steps``: the ``planned_total`` of checkpoints written
            before it was stored (when a positive int; else None).

    Returns:
        ``tokens_trained`` (int; 0 when absent), ``trained_length`` (int; 0 = none), ``lr_horizon``,
        ``lr_anchor`` ((W, a, p_a) or None: absent in checkpoints written before re-planning, the first plan)
        and ``planned_total`` (int or None).
    """
    anchor = meta.get("lr_anchor")
    planned = meta.get("planned_total")
    if planned is None:
        planned = max_steps if isinstance(max_steps, int) and max_steps > 0 else None
    return {
        "tokens_trained": int(meta.get("tokens_trained", 0)),
        "trained_length": int(meta.get("trained_length") or 0),
        "lr_horizon": meta.get("lr_horizon"),
        "lr_anchor": None if anchor is None else (int(anchor[0]), int(anchor[1]), float(anchor[2])),
        "planned_total": None if planned is None else int(planned),
    }


def check_resumed_aux_ids(meta: dict, aux_layer_ids: list[int]) -> None:
    """Refuse to resume a checkpoint whose head read other aux layers than this run's head.

    Raises:
        ValueError: naming both lists (nothing is compared when the checkpoint records none).
    """
    stored = meta["head_config"].get("aux_layer_ids") or meta.get("aux_layer_ids")
    if stored and list(stored) != list(aux_layer_ids):
        raise ValueError(
            f"checkpoint aux layers {list(stored)} differ from this run's "
            f"{list(aux_layer_ids)}; use the recipe the checkpoint was trained with"
        )


# -- reading ------------------------------------------------------------------------------------------------
def check_architecture(path: Path, meta: dict, target_ref: str, tcfg=None) -> None:
    """Refuse a ``--target`` of another architecture than the head's training target (:data:`ARCHITECTURE_FIELDS`
    as stored, or read from the training target's config for checkpoints written before they were stored; not
    compared when neither is available).

    Args:
        path: the checkpoint or export directory (named in the error).
        meta: its ``draftkit`` metadata or export sidecar (``target_architecture``, ``trained_target``, ``target``).
        target_ref: the ``--target`` given.
        tcfg: that target's text config, when already loaded (else it is read here).

    Raises:
        ValueError: naming the training target and ``--target`` with each differing field's two values.
    """
    trained, trained_ref = meta.get("target_architecture"), meta.get("trained_target") or meta.get("target")
    if trained is None and trained_ref:
        try:
            trained = target_architecture(_load_target_config(str(trained_ref))[1])
        except (OSError, ValueError):
            log.info("%s: the training target %r is not available here; its architecture is not compared with "
                     "--target %r", path, trained_ref, target_ref)
            return
    given = target_architecture(tcfg if tcfg is not None else _load_target_config(target_ref)[1])
    diff = [f"{f} {trained[f]!r} vs {given[f]!r}" for f in ARCHITECTURE_FIELDS
            if trained.get(f) is not None and given[f] is not None and trained[f] != given[f]]
    if diff:
        raise ValueError(
            f"{path} was trained on target {trained_ref!r}, but --target {target_ref!r} has another architecture "
            f"({'; '.join(diff)}, training target vs --target): a head drafts only for the architecture it was "
            "trained on; leave --target out (or give that target, a fine-tune or a quantization of it), or train a "
            "head for this target"
        )


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
        target_name: the name a serving host loads the target by (set by export, see
            ``draftkit.export.exporter.serving_target_name``); None = ``target_path``.
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
    target_name: str | None = None

    @property
    def serving_name(self) -> str:
        """What launch commands and engine configs name the target by."""
        return self.target_name or self.target_path

    @property
    def default_aux(self) -> bool:
        """True when the ids equal the EAGLE3 rule [2, N//2, N-3] (engines then use their own default)."""
        return self.aux_layer_ids == default_aux_layer_ids(self.num_layers)


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a head with NaN or inf in any floating-point tensor (it would draft garbage, silently).

    The one finiteness check of a head's weights: used on training checkpoints (evaluate, export), on
    export directories and by the callbacks before they decode with the head being trained.

    Args:
        tensors: name -> tensor; non-float tensors (``d2t``, ``t2d``) are skipped.
        where: the file, directory or module named in the error.

    Raises:
        ValueError: naming every non-finite tensor.
    """
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"{where}: {', '.join(bad)} has non-finite values (NaN/inf); the head would draft garbage")


def check_tokenizer(meta: dict, tokenizer, where: str) -> None:
    """Refuse a target whose tokenizer is not the one the head was trained with.

    Compares ``meta["tokenizer_fingerprint"]`` (written at training, copied into export sidecars) with
    :func:`draftkit.target.tokens.tokenizer_identity` of ``tokenizer`` and ``meta["chat_template"]``; equal
    vocabulary sizes are not enough (a permuted vocabulary breaks every draft id).

    Args:
        meta: checkpoint metadata or export sidecar.
        tokenizer: the target's tokenizer, or a path ``AutoTokenizer`` loads it from.
        where: names the head in the error.

    Raises:
        ValueError: naming both fingerprints. A head that records none (written before fingerprints) is
            accepted with a warning.
    """
    from draftkit.target.tokens import tokenizer_identity

    expected = meta.get("tokenizer_fingerprint")
    if not expected:
        log.warning("%s records no tokenizer fingerprint: cannot check that the target's tokenizer is the one it "
                    "was trained with", where)
        return
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    actual = tokenizer_identity(tokenizer, meta.get("chat_template"))
    if actual != expected:
        raise ValueError(
            f"{where} was trained with tokenizer fingerprint {expected}, but the target's tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '?')}) has {actual}: another vocabulary, special tokens or chat "
            "template, so its token ids mean other tokens; use the target the head was trained with"
        )


def check_head_matches_target(head, target, head_name: str = "head", target_name: str = "target") -> None:
    """Check that a head can read this target's aux states and vocabulary, and that its weights are finite
    (:func:`check_finite`; the tokenizer is checked where the head is loaded, :func:`check_tokenizer`).

    Args:
        head: an ``Eagle3LlamaHead`` (its ``config``: V, H_t, n aux states).
        target: a ``draftkit.target.frozen.FrozenTarget`` (``vocab_size``, ``hidden_size``, ``aux_layer_ids``).
        head_name, target_name: how the error names them (e.g. the checkpoint and the target reference).

    Raises:
        ValueError: naming the head's and the target's values for every mismatch, or the non-finite tensors.
    """
    check_finite(dict(head.named_parameters()), head_name)
    cfg = head.config
    width = len(target.aux_layer_ids) * target.hidden_size
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size: {head_name} V={cfg.vocab_size}, {target_name} V={target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(
            f"hidden size: {head_name} was trained on H_t={cfg.target_hidden_size}, {target_name} has H_t={target.hidden_size}"
        )
    elif cfg.num_aux_layers * cfg.target_hidden_size != width:
        problems.append(
            f"aux width: {head_name} fc reads {cfg.num_aux_layers}x{cfg.target_hidden_size}, {target_name} gives "
            f"{len(target.aux_layer_ids)}x{target.hidden_size} (aux ids {target.aux_layer_ids})"
        )
    if problems:
        raise ValueError(
            f"{head_name} does not match {target_name}: " + "; ".join(problems)
            + ". Evaluate a head with the target it was trained for."
        )


def _load_target_config(target: str):
    from transformers import AutoConfig

    from draftkit.artifacts import resolve_model_dir

    path = resolve_model_dir(target, option="target")
    return path, text_config(AutoConfig.from_pretrained(path))


def load_checkpoint(path: str | Path, option: str = "checkpoint") -> tuple[dict, dict]:
    """The one ``torch.load`` of a training checkpoint: (checkpoint dict, its ``draftkit`` metadata). A zip
    checkpoint (what ``torch.save`` writes) is memory-mapped, so reading it costs no copy of its optimizer state.

    Args:
        path: a ``.ckpt`` written by ``draftkit fit``.
        option: the option that named it, for errors (``--ckpt_path``, ``--checkpoint``).

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if it is a directory, cannot be unpickled, or holds no ``draftkit`` metadata with
            ``head_config`` (each naming the option and the file).
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{option} {path} is a directory, not a .ckpt file: give the checkpoint `draftkit fit` wrote (below "
            "lightning_logs/version_N/checkpoints/); an export directory holds a head without training state: "
            "fit --model.init_head DIR starts a new run from it, evaluate --checkpoint DIR measures it"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{option} {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unreadable file
        raise ValueError(f"{option} {path} could not be read ({exc}); is it a complete .ckpt file?") from exc
    meta = ckpt.get("draftkit") if isinstance(ckpt, dict) else None
    if not isinstance(meta, dict) or "head_config" not in meta:
        raise ValueError(
            f"{option} {path} is not a draftkit training checkpoint (no 'draftkit' metadata with 'head_config'); "
            "give a .ckpt written by `python -m draftkit fit`"
        )
    return ckpt, meta


def _stored_aux_ids(path: Path, meta: dict) -> list[int]:
    """The aux ids a checkpoint records: ``head_config.aux_layer_ids`` (where they are stored, once), or the
    ``aux_layer_ids`` key that checkpoints written before that kept beside it.

    Raises:
        ValueError: when neither is there: the default rule is never guessed, since a head trained on other
            layers would load fine and draft garbage.
    """
    ids = meta["head_config"].get("aux_layer_ids") or meta.get("aux_layer_ids")
    if not ids:
        raise ValueError(
            f"checkpoint {path} records no aux layer ids (head_config.aux_layer_ids); the layers the head was "
            "trained on cannot be guessed. Re-save it from the training run (its recipe's model.aux_layer_ids)"
        )
    return [int(i) for i in ids]


def read_checkpoint(path: str | Path, target: str | None = None) -> HeadSource:
    """Read the head of a draftkit training checkpoint and check it against its target.

    Args:
        path: a ``.ckpt`` written by ``draftkit fit`` (``state_dict["head.*"]`` plus ``checkpoint["draftkit"]``).
        target: a target reference overriding ``meta["target"]`` (local dir, hub id, ``pypi:`` or GGUF).

    Returns:
        The :class:`HeadSource`.

    Raises:
        FileNotFoundError: if the checkpoint (or a local target) does not exist.
        ValueError: if the file is not a draftkit checkpoint, or as :func:`head_source`.
    """
    path = Path(path)
    ckpt, meta = load_checkpoint(path)
    state = {k[len(HEAD_PREFIX):]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith(HEAD_PREFIX)}
    return head_source(path, state, meta, target)


def head_source(path: Path, state: dict[str, torch.Tensor], meta: dict, target: str | None = None) -> HeadSource:
    """Check a head's tensors and metadata against its target: the one set of checks every head source passes
    (a training checkpoint here, an export directory in ``draftkit.export.load.read_export_source``).

    Args:
        path: the file or directory the head came from (named in errors).
        state: head tensors by draftkit name (``midlayer.*``, ``fc.weight``, ``lm_head.weight``, ``d2t``, ...).
        meta: ``head_config`` (with or beside it ``aux_layer_ids``), ``target``, ``tokenizer_fingerprint``,
            ``chat_template``, ``target_dtype``, ``ttt``.
        target: a target reference overriding ``meta["target"]``.

    Returns:
        The :class:`HeadSource`.

    Raises:
        FileNotFoundError: if a local target does not exist.
        ValueError: if the metadata records no aux layer ids (never guessed), the draft-vocab map ``d2t`` is
            missing while V_d < V or not the identity (zeros) while V_d == V, head tensors are missing or
            unexpected, have other shapes than the stored
            ``head_config`` gives (:func:`expected_tensor_specs`) or hold non-finite weights
            (:func:`check_finite`), the target has another hidden size, vocabulary or tokenizer
            (:func:`check_tokenizer`; names both), or lacks the aux layers.
    """
    cfg = Eagle3Config(**{**meta["head_config"], "aux_layer_ids": _stored_aux_ids(path, meta)})
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
        log.info("%s: no d2t and V_d == V: the identity map (d2t zeros)", path)
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
    for name, (shape, _) in expected.items():  # the stored head_config must describe the tensors (every verb)
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"checkpoint {path}: {name} has shape {tuple(state[name].shape)}, expected {shape} from its "
                "stored head_config; the metadata and the tensors disagree (an edited or mixed checkpoint): "
                "re-save it from the run that trained it"
            )

    if cfg.draft_vocab_size == cfg.vocab_size and bool(state["d2t"].any()):
        raise ValueError(f"checkpoint {path}: V_d == V but head.d2t is not all zeros (the identity map must be "
                         "zeros, never arange: verl-SpeCo PR #67); re-save it from the run that trained it")
    check_finite(state, f"checkpoint {path}")
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
    if target is not None:
        check_architecture(path, meta, target_ref, tcfg)
    check_tokenizer(meta, target_path, f"checkpoint {path}")
    num_layers = int(tcfg.num_hidden_layers)
    aux = validate_aux_layer_ids(cfg.aux_layer_ids, num_layers, option=f"{path}: aux_layer_ids")
    if len(aux) != cfg.num_aux_layers:
        raise ValueError(
            f"checkpoint {path}: {len(aux)} aux layer ids {aux} but fc reads {cfg.num_aux_layers} aux states"
        )
    return HeadSource(
        path=path, state=state, config=cfg, meta=meta, target=target_ref, target_path=str(target_path),
        target_config=tcfg, num_layers=num_layers, aux_layer_ids=aux,
    )


def expected_tensor_specs(
    cfg: Eagle3Config, layer_prefix: str, serving: bool = False
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The exact tensor set of a head (§2, §7.1): name -> (shape, kind).

    Args:
        cfg: the head shape.
        layer_prefix: ``"midlayer."`` or ``"layers.0."``.
        serving: the set an export directory holds: without ``d2t``/``t2d`` when V_d == V (vLLM 0.33 then
            creates no ``draft_id_to_target_id`` and refuses a file that carries ``d2t``; TensorRT-LLM creates
            its ``d2t`` only when V_d != V). False: the checkpoint set, which always has the map.

    Returns:
        ``kind`` is ``"float"`` for weights, ``"int64"`` for ``d2t`` and ``"bool"`` for ``t2d``.
        ``embed_tokens.weight`` (V, H) is included only when H != H_t; ``input_norm.weight`` (n*H_t,) only with
        ``norm_before_fc``; ``fc_norm.{i}.weight`` (H_t,) for each aux state only with ``fc_norm``.
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
    if cfg.norm_before_fc:
        specs["input_norm.weight"] = ((n * ht,), "float")
    if cfg.fc_norm:
        specs.update({f"fc_norm.{i}.weight": ((ht,), "float") for i in range(n)})
    if serving and cfg.draft_vocab_size == cfg.vocab_size:
        del specs["d2t"], specs["t2d"]
    return specs


def head_from_checkpoint(path: str | Path, target: str | None = None) -> tuple[Eagle3LlamaHead, dict]:
    """Rebuild the head of a training checkpoint, after the checks of :func:`read_checkpoint`.

    The returned head's ``embed_tokens`` is uninitialised unless the checkpoint carries one (H != H_t): call
    ``head.load_embedding(target_embedding)`` with the target's (V, H_t) input embedding before use.

    Args:
        path: a ``.ckpt`` written by ``draftkit fit``.
        target: a target reference overriding the checkpoint's.

    Returns:
        (head in eval mode, float32; the ``draftkit`` metadata dict with ``aux_layer_ids`` set to the
        validated ids and ``target`` to the reference used).

    Raises:
        FileNotFoundError, ValueError: as :func:`read_checkpoint`.
    """
    source = read_checkpoint(path, target)
    head = Eagle3LlamaHead(source.config)
    missing, unexpected = head.load_state_dict(source.state, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary_emb."))]
    if missing or unexpected:
        raise ValueError(f"{source.path}: head keys missing {missing}, unexpected {unexpected}")
    meta = dict(source.meta, aux_layer_ids=source.aux_layer_ids, target=source.target)
    return head.float().eval(), meta
