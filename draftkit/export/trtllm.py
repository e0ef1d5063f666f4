"""TensorRT-LLM (PyTorch backend) export directory (eagle3-format.md §7.5).

``tensorrt_llm/_torch/models/modeling_speculative.py`` (``Eagle3DraftModel``) reads the SGLang layout:
``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` (used only when V_d != V) and ``embed_tokens`` only
when H != H_t. The architecture is written ``LlamaForCausalLM`` (with ``draft_vocab_size``): TensorRT-LLM resolves a
draft by prefixing ``EAGLE3`` to it (``EAGLE3LlamaForCausalLM`` is the registered ``Eagle3ForCausalLM``), and
older releases do not strip an ``...Eagle3`` suffix first, so ``LlamaForCausalLMEagle3`` is unknown there.
Norm flags: ``Eagle3DraftModel`` reads ``norm_before_fc`` from ``eagle_config`` (written there), the others are
written as the SGLang fields; a ``norm_before_residual`` head is refused (:func:`check_supported`). Aux ids are given
in the LLM-API config in output-of-layer form; whether the loader also reads the draft config is unverified,
so the exporter writes them (when non-default) into ``trtllm_spec.yaml`` beside the weights and keeps them
out of ``config.json``.

Launch: ``trtllm-serve <target> --extra_llm_api_options <dir>/trtllm_spec.yaml`` (newer releases:
``--config``). A chain writes ``max_draft_len: k``; a tree (depth D, top-k K, N draft nodes) writes TensorRT-LLM's
dynamic-tree keys ``max_draft_len: D``, ``use_dynamic_tree: true``, ``dynamic_tree_max_topK: K`` and
``max_total_draft_tokens: N`` (:func:`speculation_settings`; the keys are verified against TensorRT-LLM's
``llm_args.py`` and its 1.3/1.4 API reference, not against the pinned 1.2.1).

Shapes: H draft hidden, H_t target hidden, N target layers.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from draftkit.decoding.tree import TreeConfig
from draftkit.export.common import llama_config_fields, norm_flags, require_three_aux_states
from draftkit.heads.checkpoint import HeadSource
from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.selection.layers import default_aux_layer_ids

__all__ = ["ENGINE", "ENGINE_VERSION", "LAYER_PREFIX", "SPEC_FILE", "build_config", "build_files", "build_spec_yaml",
           "check_supported", "from_engine_ids", "hf_aux_layer_ids", "launch_command", "read_view",
           "speculation_settings", "trtllm_aux_layer_ids"]

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
        ValueError: if the head fuses other than 3 aux states (TensorRT-LLM's
            ``tensorrt_llm/_torch/models/modeling_speculative.py`` sizes ``fc`` as ``target_hidden_size * 3``: its
            weight would not load), or uses ``norm_before_residual``.
    """
    require_three_aux_states(cfg, "TensorRT-LLM's Eagle3DraftModel")
    if cfg.norm_before_residual:
        raise ValueError(
            "this head was trained with norm_before_residual=true, which TensorRT-LLM's Eagle3DraftModel is not "
            "known to implement; export it --to vllm or --to speculators"
        )


def build_config(cfg: Eagle3Config, dtype_name: str) -> dict:
    """``config.json`` for TensorRT-LLM: the SGLang/§7.2 fields without any aux-id key, architecture
    ``LlamaForCausalLM`` (module docstring).

    Raises:
        ValueError: see :func:`check_supported`.
    """
    check_supported(cfg)
    config = llama_config_fields(cfg, dtype_name)
    config["architectures"] = ["LlamaForCausalLM"]
    config.update(norm_flags(cfg))
    if cfg.norm_before_fc:  # Eagle3DraftModel reads it only from eagle_config (modeling_speculative.py)
        config["eagle_config"] = {"norm_before_fc": True}
    if cfg.hidden_size != cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    return config


def speculation_settings(k: int, tree: TreeConfig | None = None) -> dict:
    """The ``speculative_config`` keys of a chain of k drafts or of a tree (D, K, N).

    A chain is ``max_draft_len: k`` (TensorRT-LLM's linear tree). A tree is TensorRT-LLM's EAGLE-2 dynamic tree:
    ``max_draft_len: D`` (drafter layers = depth), ``use_dynamic_tree: true``, ``dynamic_tree_max_topK: K``
    ("the number of nodes to expand each time") and ``max_total_draft_tokens: N`` ("the number of all nodes in
    the tree (except the root)"). Key names and meanings are read from TensorRT-LLM's
    ``tensorrt_llm/llmapi/llm_args.py`` (``EagleDecodingConfig.validate_eagle_config``, main branch),
    ``tensorrt_llm/_torch/speculative/spec_tree_manager.py`` and the ``Eagle3DecodingConfig`` API reference of
    1.3.0rc27 and 1.4.0rc4; whether the pinned release (:data:`ENGINE_VERSION`) accepts them on the PyTorch
    backend with ``eagle3_one_model`` is unverified. Its validator requires D <= N <= K * D: the dynamic tree
    keeps the K nodes it expands per layer and selects N of those K * D, where SGLang and draftkit select among
    all K + (D-1) K^2 proposed children, so the same (D, K, N) may build a different tree.

    Args:
        k: the chain's drafts (used when ``tree`` is None or a chain).
        tree: a tree topology, or None.

    Returns:
        The keys, in the order written.

    Raises:
        ValueError: for a tree with N outside [D, K * D] (TensorRT-LLM refuses it).
    """
    if tree is None or tree.is_chain:
        return {"max_draft_len": int(k)}
    d, topk, n = tree.depth, tree.topk, tree.num_nodes
    if not d <= n <= topk * d:
        raise ValueError(
            f"tree {tree}: TensorRT-LLM's dynamic tree needs max_draft_len <= max_total_draft_tokens <= "
            f"dynamic_tree_max_topK * max_draft_len, i.e. {d} <= N <= {topk * d}, got N = {n}; choose N in that range"
        )
    return {"max_draft_len": d, "use_dynamic_tree": True, "dynamic_tree_max_topK": topk, "max_total_draft_tokens": n}


def build_spec_yaml(
    out_dir: str, aux_layer_ids: list[int], num_layers: int, k: int, tree: TreeConfig | None = None
) -> str:
    """The LLM-API options file (``--extra_llm_api_options``) for a chain of k draft tokens or a tree.

    Args:
        out_dir: the final export directory (``speculative_model_dir``).
        aux_layer_ids: HF ``hidden_states`` indices.
        num_layers: N.
        k: ``max_draft_len`` of a chain.
        tree: a tree topology (dynamic-tree keys of :func:`speculation_settings`), or None for the chain k.

    Raises:
        ValueError: see :func:`speculation_settings`.
    """
    ids = trtllm_aux_layer_ids(aux_layer_ids, num_layers)
    spec = speculation_settings(k, tree)
    lines = [
        "# TensorRT-LLM LLM-API options written by draftkit export (eagle3-format.md §7.5).",
        "speculative_config:",
        "  decoding_type: Eagle3          # \"Eagle\" is an accepted alias in some releases",
        f"  max_draft_len: {spec['max_draft_len']}",
        f"  speculative_model_dir: {out_dir}   # newer releases name this key speculative_model",
        "  eagle3_one_model: true",
    ]
    if "use_dynamic_tree" in spec:
        lines += [
            "  use_dynamic_tree: true         # EAGLE-2 dynamic tree (EagleDecodingConfig; unverified for 1.2.1)",
            f"  dynamic_tree_max_topK: {spec['dynamic_tree_max_topK']}       # top-k expanded per drafter layer",
            f"  max_total_draft_tokens: {spec['max_total_draft_tokens']}     # draft nodes verified per round, "
            "root excluded",
        ]
    if ids is not None:
        lines.append(f"  eagle3_layers_to_capture: {ids}   # output-of-layer ids = HF ids {list(aux_layer_ids)} - 1")
    return "\n".join(lines) + "\n"


def launch_command(source: HeadSource, out_dir: str, k: int, tree: TreeConfig | None = None) -> str:
    """The ``trtllm-serve`` command using the exported options file (which carries k or the tree)."""
    return shlex.join(["trtllm-serve", source.serving_name, "--extra_llm_api_options", f"{out_dir}/{SPEC_FILE}"])


def build_files(source: HeadSource, out_dir: str, dtype_name: str, k: int, options: dict) -> dict:
    """The engine's files (registry protocol): config.json without aux ids, and :data:`SPEC_FILE` with them and
    the chain k or the tree ``options["tree"]``; ``speculation`` holds those :data:`SPEC_FILE` keys.

    Raises:
        ValueError: see :func:`build_config`, :func:`speculation_settings`.
    """
    aux, n, tree = source.aux_layer_ids, source.num_layers, options.get("tree")
    return {
        "config": build_config(source.config, dtype_name),
        "engine_aux_layer_ids": trtllm_aux_layer_ids(aux, n),
        "text_files": {SPEC_FILE: build_spec_yaml(str(out_dir), aux, n, k, tree)},
        "speculation": speculation_settings(k, tree),
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
