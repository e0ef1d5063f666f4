"""TensorRT-LLM (PyTorch backend) export directory (eagle3-format.md §7.5).

``tensorrt_llm/_torch/models/modeling_speculative.py`` (``Eagle3DraftModel``) reads the SGLang layout:
``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` (used only when V_d != V) and ``embed_tokens`` only
when H != H_t. Norm flags are not known to be read, so only standard heads are exported. Aux ids are given
in the LLM-API config in output-of-layer form; whether the loader also reads the draft config is unverified,
so the exporter writes them (when non-default) into ``trtllm_spec.yaml`` beside the weights and keeps them
out of ``config.json``.

Launch: ``trtllm-serve <target> --extra_llm_api_options <dir>/trtllm_spec.yaml`` (newer releases:
``--config``).

Shapes: H draft hidden, H_t target hidden, N target layers.
"""

from __future__ import annotations

from pathlib import Path

from draftkit.export.common import llama_config_fields, norm_flags
from draftkit.heads.checkpoint import HeadSource
from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.selection.layers import default_aux_layer_ids

__all__ = ["ENGINE", "ENGINE_VERSION", "LAYER_PREFIX", "SPEC_FILE", "build_config", "build_files", "build_spec_yaml",
           "check_supported", "from_engine_ids", "hf_aux_layer_ids", "launch_command", "read_view",
           "trtllm_aux_layer_ids"]

ENGINE = "trtllm"
ENGINE_VERSION = "1.2.1"
"""TensorRT-LLM release the layout and LLM-API keys are written for (newest on PyPI when written)."""
LAYER_PREFIX = "midlayer."
SPEC_FILE = "trtllm_spec.yaml"


def trtllm_aux_layer_ids(aux_layer_ids: list[int], num_layers: int, omit_default: bool = True) -> list[int] | None:
    """Aux ids as the LLM-API ``speculative_config.eagle3_layers_to_capture``.

    Rule: TensorRT-LLM names the decoder layer whose *output* is captured (output-of-layer), and the output of
    layer ℓ − 1 is HF ``hidden_states[ℓ]``, so each id is written ℓ − 1. The default ``[2, N//2, N-3]``
    (TensorRT-LLM's own default, written ``[1, N//2-1, N-4]``) is omitted (None).

    Args:
        aux_layer_ids: HF ``hidden_states`` indices, ascending, in 1..N-1.
        num_layers: N.
        omit_default: return None for the default set (what the exporter writes); False gives its explicit form.

    Returns:
        The ids to write, or None to omit the key.
    """
    ids = [int(i) for i in aux_layer_ids]
    return None if omit_default and ids == default_aux_layer_ids(num_layers) else [i - 1 for i in ids]


def hf_aux_layer_ids(written: list[int] | None, num_layers: int) -> list[int]:
    """Inverse of :func:`trtllm_aux_layer_ids` (default when absent)."""
    return default_aux_layer_ids(num_layers) if not written else [int(i) + 1 for i in written]


def check_supported(cfg: Eagle3Config) -> None:
    """Refuse heads TensorRT-LLM is not known to compute.

    Raises:
        ValueError: if the head uses ``norm_before_residual``.
    """
    if cfg.norm_before_residual:
        raise ValueError(
            "this head was trained with norm_before_residual=true, which TensorRT-LLM's Eagle3DraftModel is not "
            "known to implement; export it --to vllm or --to speculators"
        )


def build_config(cfg: Eagle3Config, dtype_name: str) -> dict:
    """``config.json`` for TensorRT-LLM: the SGLang/§7.2 fields without any aux-id key.

    Raises:
        ValueError: see :func:`check_supported`.
    """
    check_supported(cfg)
    config = llama_config_fields(cfg, dtype_name)
    config.update(norm_flags(cfg))
    if cfg.hidden_size != cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    return config


def build_spec_yaml(out_dir: str, aux_layer_ids: list[int], num_layers: int, k: int) -> str:
    """The LLM-API options file (``--extra_llm_api_options``) for a chain of k draft tokens.

    Args:
        out_dir: the final export directory (``speculative_model_dir``).
        aux_layer_ids: HF ``hidden_states`` indices.
        num_layers: N.
        k: ``max_draft_len``.
    """
    ids = trtllm_aux_layer_ids(aux_layer_ids, num_layers)
    lines = [
        "# TensorRT-LLM LLM-API options written by draftkit export (eagle3-format.md §7.5).",
        "speculative_config:",
        "  decoding_type: Eagle3          # \"Eagle\" is an accepted alias in some releases",
        f"  max_draft_len: {int(k)}",
        f"  speculative_model_dir: {out_dir}   # newer releases name this key speculative_model",
        "  eagle3_one_model: true",
    ]
    if ids is not None:
        lines.append(f"  eagle3_layers_to_capture: {ids}   # output-of-layer ids = HF ids {list(aux_layer_ids)} - 1")
    return "\n".join(lines) + "\n"


def launch_command(source: HeadSource, out_dir: str, k: int) -> str:
    """The ``trtllm-serve`` command using the exported options file."""
    return f"trtllm-serve {source.serving_name} --extra_llm_api_options {out_dir}/{SPEC_FILE}"


def build_files(source: HeadSource, out_dir: str, dtype_name: str, k: int, options: dict) -> dict:
    """The engine's files (registry protocol): config.json without aux ids, and :data:`SPEC_FILE` with them."""
    aux, n = source.aux_layer_ids, source.num_layers
    return {
        "config": build_config(source.config, dtype_name),
        "engine_aux_layer_ids": trtllm_aux_layer_ids(aux, n),
        "text_files": {SPEC_FILE: build_spec_yaml(str(out_dir), aux, n, k)},
    }


def read_view(directory, config: dict, sidecar: dict) -> tuple[dict, dict, list[int] | None]:
    """(config, config, ``eagle3_layers_to_capture`` of :data:`SPEC_FILE`) (registry protocol).

    Raises:
        FileNotFoundError: if :data:`SPEC_FILE` is missing.
    """
    import yaml

    spec_path = Path(directory) / SPEC_FILE
    if not spec_path.is_file():
        raise FileNotFoundError(f"{directory}: {SPEC_FILE} is missing")
    spec = yaml.safe_load(spec_path.read_text()) or {}
    return config, config, (spec.get("speculative_config") or {}).get("eagle3_layers_to_capture")


def from_engine_ids(written: list[int] | None, num_layers: int, sidecar: dict) -> list[int]:
    """HF ids of the written ids (registry protocol): :func:`hf_aux_layer_ids`."""
    return hf_aux_layer_ids(written, num_layers)
