"""Engine config fields at the conditions that write them (issue 56): each conditional key present exactly when
its condition holds, at the separating value (H == H_t, three aux states, the default id set, the +1 rules'
boundary at a lowest id of 1 and 2), and every written aux-id list read back to the HF ids it was written from."""

import dataclasses

import pytest

from draftkit.decoding.tree import TreeConfig
from draftkit.export import sglang, speculators, trtllm, vllm
from draftkit.heads.eagle3_llama import Eagle3Config
from draftkit.selection.layers import default_aux_layer_ids

BASE = Eagle3Config(hidden_size=32, target_hidden_size=32, num_aux_layers=3, intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96, draft_vocab_size=48)
N = 12  # target decoder layers: default ids [2, 6, 9]


def _cfg(**changes) -> Eagle3Config:
    return dataclasses.replace(BASE, **changes)


@pytest.mark.parametrize("h_t, aux", [(32, 3), (24, 3), (32, 4), (24, 2)])
def test_vllm_writes_target_width_and_aux_count_exactly_when_they_differ(h_t, aux):
    config = vllm.build_config(_cfg(target_hidden_size=h_t, num_aux_layers=aux), default_aux_layer_ids(N), N,
                               "bfloat16")
    assert config.get("target_hidden_size") == (h_t if h_t != 32 else None)
    assert config.get("num_aux_hidden_states") == (aux if aux != 3 else None)
    assert "eagle_aux_hidden_state_layer_ids" not in config  # the default set is omitted
    assert vllm.build_config(BASE, [1, 6, 9], N, "bfloat16")["eagle_aux_hidden_state_layer_ids"] == [1, 6, 9]


@pytest.mark.parametrize("h_t", [32, 24])
def test_sglang_and_trtllm_write_the_target_width_exactly_when_it_differs(h_t):
    cfg = _cfg(target_hidden_size=h_t)
    for config in (sglang.build_config(cfg, default_aux_layer_ids(N), N, "bfloat16", sglang.PLUS_ONE),
                   trtllm.build_config(cfg, "bfloat16")):
        assert config.get("target_hidden_size") == (h_t if h_t != 32 else None)


@pytest.mark.parametrize("aux", [2, 4])
def test_sglang_trtllm_and_speculators_refuse_a_head_of_other_than_3_aux_states(aux):
    """The loaders size fc for 3 aux states (SGLang llama_eagle3.py, TensorRT-LLM modeling_speculative.py,
    speculators eagle3/core.py):
    a head on 2 or 4 layers exported with exit 0 and an fc.weight the engine cannot load; vLLM reads
    num_aux_hidden_states (above)."""
    cfg = _cfg(num_aux_layers=aux)
    for engine, build in (("SGLang's llama_eagle3", lambda: sglang.build_config(
            cfg, default_aux_layer_ids(N), N, "bfloat16", sglang.PLUS_ONE)),
                          ("TensorRT-LLM's Eagle3DraftModel", lambda: trtllm.build_config(cfg, "bfloat16")),
                          ("speculators' Eagle3DraftModel", lambda: speculators.build_config(
                              cfg, default_aux_layer_ids(N), N, "bfloat16", "t", ["LlamaForCausalLM"], 3))):
        with pytest.raises(ValueError) as err:
            build()
        why = "(its config has no count)" if engine.startswith("speculators") else "(target_hidden_size x 3)"
        assert str(err.value) == (
            f"this head fuses {aux} target layers (model.aux_layer_ids), but {engine} builds fc for exactly 3 "
            f"{why}, so its fc.weight (32, {aux * 32}) would not load; export it --to vllm "
            "(num_aux_hidden_states is written), or train a head on 3 layers")


@pytest.mark.parametrize("flag", [False, True])
def test_trtllm_nests_norm_before_fc_exactly_when_set(flag):
    config = trtllm.build_config(_cfg(norm_before_fc=flag), "float16")
    assert config.get("eagle_config") == ({"norm_before_fc": True} if flag else None)
    assert config["norm_before_fc"] is flag and config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("ids, plus_one, first_is_one", [
    ([2, 6, 9], None, None),                 # the default: omitted under both rules
    ([1, 6, 9], [0, 5, 8], "raises"),        # lowest id 1: not expressible under the conditional rule
    ([2, 5, 9], [1, 4, 8], [1, 4, 8]),       # lowest id 2: written - 1, +1 applied back
    ([3, 6, 9], [2, 5, 8], [3, 6, 9]),       # lowest id 3: as-is under the conditional rule
])
def test_sglang_ids_at_each_rule_boundary_and_read_back(ids, plus_one, first_is_one):
    assert sglang.sglang_aux_layer_ids(ids, N, sglang.PLUS_ONE) == plus_one
    if first_is_one == "raises":
        with pytest.raises(ValueError, match="cannot be expressed"):
            sglang.sglang_aux_layer_ids(ids, N, sglang.PLUS_ONE_IF_FIRST_IS_ONE)
    else:
        assert sglang.sglang_aux_layer_ids(ids, N, sglang.PLUS_ONE_IF_FIRST_IS_ONE) == first_is_one
        assert sglang.hf_aux_layer_ids(first_is_one, N, sglang.PLUS_ONE_IF_FIRST_IS_ONE) == ids
    assert sglang.hf_aux_layer_ids(plus_one, N, sglang.PLUS_ONE) == ids
    config = sglang.build_config(BASE, ids, N, "bfloat16", sglang.PLUS_ONE)
    assert config.get("eagle_config") == (None if plus_one is None else {"eagle_aux_hidden_state_layer_ids": plus_one})
    assert "eagle_aux_hidden_state_layer_ids" not in config  # SGLang reads only the nested key


@pytest.mark.parametrize("ids", [[2, 6, 9], [1, 6, 9], [3, 4, 11], [1, 2, 3, 11]])
def test_every_engine_reads_back_the_ids_it_wrote(ids):
    for written, back in (
        (vllm.vllm_aux_layer_ids(ids, N), lambda w: vllm.hf_aux_layer_ids(w, N)),
        (trtllm.trtllm_aux_layer_ids(ids, N), lambda w: trtllm.hf_aux_layer_ids(w, N)),
        (speculators.speculators_aux_layer_ids(ids, N), lambda w: speculators.hf_aux_layer_ids(w, N)),
    ):
        assert back(written) == ids
    assert trtllm.trtllm_aux_layer_ids([1, 6, 9], N) == [0, 5, 8]


def test_sglang_rule_table_boundary_is_the_last_verified_release():
    last = sglang.VERIFIED_PLUS_ONE_VERSIONS[-1]
    assert sglang.sglang_aux_rule(last) == sglang.PLUS_ONE
    major, minor, patch = (int(x) for x in last.split(".")[:3])
    with pytest.raises(ValueError, match="newer than the last release"):
        sglang.sglang_aux_rule(f"{major}.{minor}.{patch + 1}")
    assert sglang.sglang_aux_rule(f"{major}.{minor}.{patch + 1}", sglang.PLUS_ONE_IF_FIRST_IS_ONE) == \
        sglang.PLUS_ONE_IF_FIRST_IS_ONE


@pytest.mark.parametrize("tree, keys", [
    (None, {"max_draft_len": 4}),
    (TreeConfig(3, 1, 3), {"max_draft_len": 4}),  # a chain tree: the chain's k
    (TreeConfig(3, 2, 3), {"max_draft_len": 3, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2,
                           "max_total_draft_tokens": 3}),  # N = D: the lower bound
    (TreeConfig(3, 2, 6), {"max_draft_len": 3, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2,
                           "max_total_draft_tokens": 6}),  # N = K D: the upper bound
])
def test_trtllm_tree_keys_at_the_bounds(tree, keys):
    assert trtllm.speculation_settings(4, tree) == keys


def test_trtllm_refuses_a_tree_just_outside_the_bounds():
    with pytest.raises(ValueError, match="3 <= N <= 6, got N = 7"):
        trtllm.speculation_settings(4, TreeConfig(3, 2, 7))
    with pytest.raises(ValueError, match="3 <= N <= 6, got N = 2"):
        trtllm.speculation_settings(4, TreeConfig(3, 2, 2))


def test_rope_scaling_is_omitted_only_for_plain_default_rope():
    """rope_scaling None exactly when the type is default and nothing else is set: a default type with another
    field (here partial_rotary_factor) keeps its dict, the legacy ``type`` key counts as the type (issue 56)."""
    from draftkit.export.common import rope_legacy_fields

    assert rope_legacy_fields({"rope_parameters": {"rope_theta": 1e4, "type": "default"}}) == (1e4, None)
    extra = {"rope_type": "default", "partial_rotary_factor": 0.5}
    assert rope_legacy_fields({"rope_parameters": {"rope_theta": 1e4, **extra}}) == (1e4, extra)
    assert rope_legacy_fields({"rope_theta": 2e4, "rope_scaling": {"type": "linear", "factor": 2.0}}) == (
        2e4, {"type": "linear", "factor": 2.0})
