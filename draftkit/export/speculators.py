"""vLLM speculators-format export directory (eagle3-format.md §7.3).

``vllm serve <dir>`` auto-detects this layout (vllm ``transformers_utils/configs/speculators/{base,algos}.py``;
speculators ``src/speculators/models/eagle3/config.py``): the verifier and k come from ``speculators_config``,
the decoder layer shape from ``transformer_layer_config``. Weights use ``layers.0.*``.

All four norm flags are written: vLLM's translator reads a missing ``norm_before_residual`` as **true**
(vllm PRs #38111, #46488), which would load fine and quietly lower acceptance.

Shapes: H draft hidden, H_t target hidden, N target layers.
"""

from __future__ import annotations

import shlex

from draftkit.decoding.tree import TreeConfig
from draftkit.export.common import llama_config_fields, norm_flags, require_three_aux_states
from draftkit.export.speculation import chain_only_note
from draftkit.heads.checkpoint import HeadSource
from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.selection.layers import default_aux_layer_ids

__all__ = ["ENGINE", "ENGINE_VERSION", "EXPORT_DIR", "LAYER_PREFIX", "build_config", "build_files", "from_engine_ids",
           "hf_aux_layer_ids", "launch_command", "read_view", "speculators_aux_layer_ids"]

ENGINE = "speculators"
ENGINE_VERSION = "0.9.0"
"""``speculators_version`` written into the config (the speculators release whose Eagle3 config this follows)."""
LAYER_PREFIX = "layers.0."
EXPORT_DIR = "vllm-speculators"
"""Sub-directory name under a run's ``export/`` (``ExportOnCheckpoint``)."""


def speculators_aux_layer_ids(aux_layer_ids: list[int], num_layers: int, omit_default: bool = True) -> list[int] | None:
    """Aux ids as the speculators config's top-level ``eagle_aux_hidden_state_layer_ids``.

    Rule: speculators and vLLM read these ids capture-before (id j = input of decoder layer j = HF
    ``hidden_states[j]``), so they are written unchanged; the default ``[2, N//2, N-3]`` is omitted (None).

    Args:
        aux_layer_ids: HF ``hidden_states`` indices, ascending, in 1..N-1.
        num_layers: N.
        omit_default: return None for the default set (what the exporter writes); False gives its explicit form.

    Returns:
        The ids to write, or None to omit the key.
    """
    ids = [int(i) for i in aux_layer_ids]
    return None if omit_default and ids == default_aux_layer_ids(num_layers) else ids


def hf_aux_layer_ids(written: list[int] | None, num_layers: int) -> list[int]:
    """Inverse of :func:`speculators_aux_layer_ids` (default when absent)."""
    return default_aux_layer_ids(num_layers) if not written else [int(i) for i in written]


def build_config(
    cfg: Eagle3Config,
    aux_layer_ids: list[int],
    num_layers: int,
    dtype_name: str,
    verifier: str,
    verifier_architectures: list[str],
    num_speculative_tokens: int,
) -> dict:
    """``config.json`` of the speculators directory (§7.3).

    Args:
        cfg: the head shape.
        aux_layer_ids: HF ``hidden_states`` indices.
        num_layers: N.
        dtype_name: the weight dtype name.
        verifier: the target's ``name_or_path`` that ``vllm serve <dir>`` loads.
        verifier_architectures: the target's ``architectures``.
        num_speculative_tokens: k, draft tokens per round.

    Returns:
        The config dict.

    Raises:
        ValueError: for a head fusing other than 3 aux states: speculators' ``Eagle3DraftModel``
            (``src/speculators/models/eagle3/core.py``) builds ``fc`` for 3 and its config carries no count.
    """
    require_three_aux_states(cfg, "speculators' Eagle3DraftModel", "(its config has no count)")
    layer = llama_config_fields(cfg, dtype_name)
    layer["architectures"] = ["LlamaForCausalLM"]
    layer.pop("draft_vocab_size")
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": ENGINE_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
        **norm_flags(cfg),
    }
    ids = speculators_aux_layer_ids(aux_layer_ids, num_layers)
    if ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    config["torch_dtype"] = dtype_name
    config["transformer_layer_config"] = layer
    config["speculators_config"] = {
        "algorithm": "eagle3",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
             "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
    }
    return config


def launch_command(source: HeadSource, out_dir: str, k: int, tree: TreeConfig | None = None) -> str:
    """``vllm serve <dir>``: verifier and k (a tree's depth) are read from the directory's ``speculators_config``."""
    return shlex.join(["vllm", "serve", str(out_dir)])


def build_files(source: HeadSource, out_dir: str, dtype_name: str, k: int, options: dict) -> dict:
    """The engine's files (registry protocol): config.json with the verifier (``options["verifier"]``, default
    the target's serving name, ``HeadSource.serving_name``) and k; for a tree (``options["tree"]``) k is its
    depth, and ``speculation`` says that vLLM serves the chain."""
    archs = list(getattr(source.target_config, "architectures", None) or ["LlamaForCausalLM"])
    config = build_config(
        source.config, source.aux_layer_ids, source.num_layers, dtype_name,
        verifier=options.get("verifier") or source.serving_name, verifier_architectures=archs, num_speculative_tokens=k,
    )
    note = chain_only_note(options.get("tree"))
    return {"config": config,
            "engine_aux_layer_ids": speculators_aux_layer_ids(source.aux_layer_ids, source.num_layers),
            "speculation": {"speculative_tokens": int(k), **({"note": note} if note else {})}}


def read_view(directory, config: dict, sidecar: dict) -> tuple[dict, dict, list[int] | None]:
    """(``transformer_layer_config``, top-level EAGLE fields, written aux ids) (registry protocol)."""
    return dict(config["transformer_layer_config"]), config, config.get("eagle_aux_hidden_state_layer_ids")


def from_engine_ids(written: list[int] | None, num_layers: int, sidecar: dict) -> list[int]:
    """HF ids of the written ids (registry protocol): :func:`hf_aux_layer_ids`."""
    return hf_aux_layer_ids(written, num_layers)
