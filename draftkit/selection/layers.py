"""Aux-layer ids: HF ``hidden_states`` indices (eagle3-format.md §6).

Convention, used everywhere in draftkit except ``draftkit/export``: id k = ``hidden_states[k]`` = the
input of decoder layer k = the output of layer k-1 (the raw residual stream). 0 is the embedding output
and N is HF's *normed* final state; both are rejected.

Worked example, SmolLM2-135M (N = 30): the default ``[2, N//2, N-3] = [2, 15, 27]`` captures the inputs of
decoder layers 2, 15 and 27, i.e. ``model.layers[1]``, ``model.layers[14]`` and ``model.layers[26]`` outputs;
SGLang/TRT-LLM write the same set as ``[1, 14, 26]``.
"""

from __future__ import annotations

__all__ = ["default_aux_layer_ids", "validate_aux_layer_ids"]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE3 rule ``[2, N//2, N-3]`` for a target with N decoder layers."""
    return [2, num_layers // 2, num_layers - 3]


def validate_aux_layer_ids(layer_ids: list[int] | None, num_layers: int, option: str = "model.aux_layer_ids") -> list[int]:
    """Resolve and check aux-layer ids.

    Args:
        layer_ids: HF ``hidden_states`` indices, or None for the default rule.
        num_layers: N, the target's decoder layers.
        option: the recipe option named in errors.

    Returns:
        The ids, ascending.

    Raises:
        ValueError: on ids outside 1..N-1, repeated ids, an empty list, or a default rule that collapses
            (N < 6), naming the option and the valid range.
    """
    ids = default_aux_layer_ids(num_layers) if layer_ids is None else [int(i) for i in layer_ids]
    if not ids:
        raise ValueError(f"{option} is empty; give at least one HF hidden_states index in 1..{num_layers - 1}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{option}={ids} repeats a layer; each id must appear once")
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ValueError(
            f"{option}={ids}: ids {bad} are out of range; valid HF hidden_states indices are 1..{num_layers - 1} "
            f"for a {num_layers}-layer target (0 is the embedding, {num_layers} is the normed final state)"
        )
    return sorted(ids)
