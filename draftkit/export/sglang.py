"""SGLang export directory (eagle3-format.md §7.4).

The SGLang loader (``python/sglang/srt/models/llama_eagle3.py``, 0.5.23) reads the EAGLE-3.1 flags
``norm_before_fc`` (nested ``eagle_config`` first, then top level), ``fc_norm`` and ``norm_output`` (top level);
it does not read ``norm_before_residual`` (its residual is always the pre-norm feature), so heads trained with
that flag are refused. It reads the aux ids only from the nested
``eagle_config.eagle_aux_hidden_state_layer_ids`` (``model_runner_components/spec_aux_hidden_state.py``) and
hands them to ``LlamaForCausalLM.set_eagle3_layers_to_capture``, whose capture loop fires *before* decoder
layer i.

The +1 that ``set_eagle3_layers_to_capture`` adds to explicit ids is version dependent, so the exporter takes
the SGLang version and picks the rule from it (:func:`sglang_aux_rule`); both are written to the sidecar.

Launch (chain, k = 3): ``python -m sglang.launch_server --model-path <target> --speculative-algorithm EAGLE3
--speculative-draft-model-path <dir> --speculative-num-steps 3 --speculative-eagle-topk 1
--speculative-num-draft-tokens 4``. A tree (depth D, top-k K, N draft nodes) launches with
``--speculative-num-steps D --speculative-eagle-topk K --speculative-num-draft-tokens N+1`` (the root counted;
:func:`speculation_settings`).

Shapes: H draft hidden, H_t target hidden, N target layers.
"""

from __future__ import annotations

import shlex

from draftkit.decoding.tree import TreeConfig
from draftkit.export.common import llama_config_fields, norm_flags, require_three_aux_states
from draftkit.heads.checkpoint import HeadSource
from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.selection.layers import default_aux_layer_ids

__all__ = ["ENGINE", "ENGINE_VERSION", "LAYER_PREFIX", "PLUS_ONE", "PLUS_ONE_IF_FIRST_IS_ONE", "build_config",
           "build_files", "check_supported", "from_engine_ids", "hf_aux_layer_ids", "launch_command", "read_view",
           "sglang_aux_layer_ids", "sglang_aux_rule", "speculation_settings"]

ENGINE = "sglang"
ENGINE_VERSION = "0.5.23"
"""Default pinned SGLang release (newest on PyPI when this was written)."""
LAYER_PREFIX = "midlayer."

PLUS_ONE = "plus_one"
"""SGLang adds 1 to every explicit id (``layers_to_capture = [val + 1 for val in layer_ids]``)."""
PLUS_ONE_IF_FIRST_IS_ONE = "plus_one_if_first_is_one"
"""sglang PR #25454: +1 only when the first id is 1; any other list is used as-is."""

VERIFIED_PLUS_ONE_VERSIONS = ("0.5.12", "0.5.14", "0.5.16", "0.5.23")
"""Releases whose ``python/sglang/srt/models/llama.py::set_eagle3_layers_to_capture`` was read and adds +1
unconditionally (PR #25454's conditional rule reached only ``glm4_moe_lite.py`` in 0.5.23)."""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not piece[:1].isdigit():
            break
        parts.append(int(digits or 0))
    return tuple(parts)


def sglang_aux_rule(version: str, rule: str | None = None) -> str:
    """The id rule of an SGLang release for Llama-family targets.

    Args:
        version: the SGLang version the export is for, e.g. ``"0.5.23"``.
        rule: an explicit rule (:data:`PLUS_ONE` or :data:`PLUS_ONE_IF_FIRST_IS_ONE`) that overrides the table,
            for releases newer than the last verified one.

    Returns:
        :data:`PLUS_ONE` for releases up to the newest verified one (0.5.23), or ``rule`` when given.

    Raises:
        ValueError: for an unknown rule, or a release newer than 0.5.23 without an explicit rule (the +1 may
            have become conditional there; read ``set_eagle3_layers_to_capture`` in that release and pass
            ``--sglang_aux_rule``).
    """
    if rule is not None:
        if rule not in (PLUS_ONE, PLUS_ONE_IF_FIRST_IS_ONE):
            raise ValueError(f"unknown SGLang aux-id rule {rule!r}; use {PLUS_ONE!r} or {PLUS_ONE_IF_FIRST_IS_ONE!r}")
        return rule
    if _version_tuple(version) <= _version_tuple(VERIFIED_PLUS_ONE_VERSIONS[-1]):
        return PLUS_ONE
    raise ValueError(
        f"SGLang {version} is newer than the last release whose aux-id rule was checked "
        f"({VERIFIED_PLUS_ONE_VERSIONS[-1]}); read python/sglang/srt/models/llama.py::set_eagle3_layers_to_capture "
        f"in that release and pass --sglang_aux_rule {PLUS_ONE} or {PLUS_ONE_IF_FIRST_IS_ONE}"
    )


def sglang_aux_layer_ids(
    aux_layer_ids: list[int], num_layers: int, rule: str = PLUS_ONE, omit_default: bool = True
) -> list[int] | None:
    """Aux ids as SGLang's nested ``eagle_config.eagle_aux_hidden_state_layer_ids``.

    SGLang captures the input of decoder layer i for each i in ``layers_to_capture``; the written ids become
    ``layers_to_capture`` after the version's rule.

    Rule (:data:`PLUS_ONE`, every release up to 0.5.23): write ℓ − 1 (output-of-layer form); SGLang adds 1 back
    and captures the input of layer ℓ = HF ``hidden_states[ℓ]``.

    Rule (:data:`PLUS_ONE_IF_FIRST_IS_ONE`, sglang PR #25454): SGLang adds 1 only when the first id is 1. A set
    whose lowest ℓ is 2 is written ℓ − 1 (first id 1, +1 applied); a set whose lowest ℓ is 3 or more is written
    ℓ unchanged (used as-is); a set whose lowest ℓ is 1 cannot be expressed (ℓ − 1 starts at 0, used as-is =
    the embedding; ℓ starts at 1, shifted to 2).

    The default set ``[2, N//2, N-3]`` is omitted (None) under both rules: SGLang's default is that set,
    capture-before, without any +1.

    Args:
        aux_layer_ids: HF ``hidden_states`` indices, ascending, in 1..N-1.
        num_layers: N.
        rule: :data:`PLUS_ONE` or :data:`PLUS_ONE_IF_FIRST_IS_ONE` (see :func:`sglang_aux_rule`).
        omit_default: return None for the default set (what the exporter writes); False gives its explicit form.

    Returns:
        The ids to write, or None to omit ``eagle_config``.

    Raises:
        ValueError: if the rule cannot express the set (lowest id 1 under PR #25454), or the rule is unknown.
    """
    ids = sorted(int(i) for i in aux_layer_ids)
    if omit_default and ids == default_aux_layer_ids(num_layers):
        return None
    if rule == PLUS_ONE:
        return [i - 1 for i in ids]
    if rule == PLUS_ONE_IF_FIRST_IS_ONE:
        if ids[0] == 1:
            raise ValueError(
                f"aux layer ids {ids} (HF hidden_states indices) cannot be expressed for SGLang with the "
                "PR #25454 rule: a set whose lowest id is 1 is read either as the embedding or shifted by one; "
                "retrain with a lowest id >= 2 or target an SGLang release with the unconditional +1"
            )
        return [i - 1 for i in ids] if ids[0] == 2 else ids
    raise ValueError(f"unknown SGLang aux-id rule {rule!r}")


def hf_aux_layer_ids(written: list[int] | None, num_layers: int, rule: str = PLUS_ONE) -> list[int]:
    """Inverse of :func:`sglang_aux_layer_ids`: the HF ids SGLang captures for a written list.

    This is SGLang's own resolution: default ``[2, N//2, N-3]`` when absent, else the rule applied to the list.
    """
    if not written:
        return default_aux_layer_ids(num_layers)
    ids = [int(i) for i in written]
    if rule == PLUS_ONE or (rule == PLUS_ONE_IF_FIRST_IS_ONE and ids[0] == 1):
        return [i + 1 for i in ids]
    return ids


def check_supported(cfg: Eagle3Config) -> None:
    """Refuse heads SGLang would compute differently.

    Raises:
        ValueError: if the head fuses other than 3 aux states (``python/sglang/srt/models/llama_eagle3.py``
            sizes ``fc`` as ``target_hidden_size * 3``: its weight would not load), or uses
            ``norm_before_residual`` (SGLang 0.5.23 reads the EAGLE-3.1 flags, not this one).
    """
    require_three_aux_states(cfg, "SGLang's llama_eagle3")
    if cfg.norm_before_residual:
        raise ValueError(
            "this head was trained with norm_before_residual=true, which SGLang's llama_eagle3 loader does not "
            "implement (it always uses the standard norm placement); export it --to vllm or --to speculators"
        )


def build_config(cfg: Eagle3Config, aux_layer_ids: list[int], num_layers: int, dtype_name: str, rule: str) -> dict:
    """``config.json`` of the SGLang directory (§7.4): §7.2 fields without the top-level aux key.

    Non-default ids go only into the nested ``eagle_config`` (SGLang ignores the top-level key); rope is kept
    as top-level ``rope_theta``/``rope_scaling`` (mirrored from ``rope_parameters``); all four norm flags are
    still written (all false) so the directory documents itself.

    Args:
        cfg: the head shape.
        aux_layer_ids: HF ``hidden_states`` indices.
        num_layers: N.
        dtype_name: the weight dtype name.
        rule: the SGLang aux-id rule.

    Raises:
        ValueError: see :func:`check_supported` and :func:`sglang_aux_layer_ids`.
    """
    check_supported(cfg)
    config = llama_config_fields(cfg, dtype_name)
    config.update(norm_flags(cfg))
    if cfg.hidden_size != cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    ids = sglang_aux_layer_ids(aux_layer_ids, num_layers, rule)
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    return config


def speculation_settings(k: int, tree: TreeConfig | None = None) -> dict:
    """SGLang's EAGLE settings for a chain of k drafts or a tree (D, K, N).

    ``--speculative-num-steps`` is the depth D (draft passes), ``--speculative-eagle-topk`` the top-k K, and
    ``--speculative-num-draft-tokens`` counts the verified tokens *including* the root: SGLang
    (``python/sglang/srt/speculative/eagle_utils.py::organize_draft_results``) keeps the best
    ``num_draft_tokens - 1`` of the K + (D-1) K^2 candidates by cumulative score, the EAGLE-2 rule draftkit's
    ``decoding.tree`` uses, so it is N + 1 (a chain: k + 1).

    Args:
        k: the chain's drafts (used when ``tree`` is None or a chain).
        tree: a tree topology, or None.

    Returns:
        ``{"speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"}``.
    """
    steps, topk, nodes = (k, 1, k) if tree is None or tree.is_chain else (tree.depth, tree.topk, tree.num_nodes)
    return {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": nodes + 1}


def launch_command(source: HeadSource, out_dir: str, k: int, tree: TreeConfig | None = None) -> str:
    """The ``sglang.launch_server`` command for a chain of k draft tokens (topk 1, k + 1 draft tokens) or a tree
    (steps D, topk K, N + 1 draft tokens; :func:`speculation_settings`)."""
    s = speculation_settings(k, tree)
    return shlex.join([
        "python", "-m", "sglang.launch_server", "--model-path", source.serving_name, "--speculative-algorithm",
        "EAGLE3", "--speculative-draft-model-path", str(out_dir), "--speculative-num-steps",
        str(s["speculative_num_steps"]), "--speculative-eagle-topk", str(s["speculative_eagle_topk"]),
        "--speculative-num-draft-tokens", str(s["speculative_num_draft_tokens"]),
    ])


def build_files(source: HeadSource, out_dir: str, dtype_name: str, k: int, options: dict) -> dict:
    """The engine's files (registry protocol): config.json for the release ``options["sglang_version"]``
    (default :data:`ENGINE_VERSION`) and its aux-id rule (``options["sglang_aux_rule"]`` overrides), both
    recorded in the sidecar; ``speculation`` holds the launch settings of ``options["tree"]`` (or the chain k).

    Raises:
        ValueError: see :func:`sglang_aux_rule`, :func:`build_config`.
    """
    version = options.get("sglang_version") or ENGINE_VERSION
    rule = sglang_aux_rule(version, options.get("sglang_aux_rule"))
    return {
        "config": build_config(source.config, source.aux_layer_ids, source.num_layers, dtype_name, rule),
        "engine_aux_layer_ids": sglang_aux_layer_ids(source.aux_layer_ids, source.num_layers, rule),
        "engine_version": version,
        "sidecar": {"engine_aux_rule": rule},
        "speculation": speculation_settings(k, options.get("tree")),
    }


def read_view(directory, config: dict, sidecar: dict) -> tuple[dict, dict, list[int] | None]:
    """(config, config, ``eagle_config.eagle_aux_hidden_state_layer_ids``) (registry protocol)."""
    return config, config, (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def from_engine_ids(written: list[int] | None, num_layers: int, sidecar: dict) -> list[int]:
    """HF ids of the written ids under the sidecar's ``engine_aux_rule`` (registry protocol)."""
    return hf_aux_layer_ids(written, num_layers, sidecar["engine_aux_rule"])
