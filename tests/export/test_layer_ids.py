"""Aux-layer id conventions per engine (eagle3-format.md §6): worked examples, and a stub engine capture on real
Llama blocks that must reproduce HF ``hidden_states[ℓ]`` from each emitted list."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftkit.export import sglang, speculators, trtllm, vllm
from draftkit.selection.layers import default_aux_layer_ids

PLUS_ONE, COND = sglang.PLUS_ONE, sglang.PLUS_ONE_IF_FIRST_IS_ONE


# (target, N, draftkit = vLLM ids, SGLang / TRT-LLM / SpecForge ids) — the §6 worked-examples table
WORKED = [
    ("Qwen3-0.6B", 28, [2, 14, 25], [1, 13, 24]),
    ("SmolLM2-135M", 30, [2, 15, 27], [1, 14, 26]),
    ("Llama-3.1-8B", 32, [2, 16, 29], [1, 15, 28]),
    ("SmolLM2-135M selected", 30, [4, 13, 26], [3, 12, 25]),
]


@pytest.mark.parametrize("name,n,hf,output_of_layer", WORKED)
def test_worked_examples_table(name, n, hf, output_of_layer):
    assert vllm.vllm_aux_layer_ids(hf, n, omit_default=False) == hf
    assert speculators.speculators_aux_layer_ids(hf, n, omit_default=False) == hf
    assert sglang.sglang_aux_layer_ids(hf, n, PLUS_ONE, omit_default=False) == output_of_layer
    assert trtllm.trtllm_aux_layer_ids(hf, n, omit_default=False) == output_of_layer
    is_default = hf == default_aux_layer_ids(n)
    # what the exporter writes: nothing for the default set, the converted list otherwise
    assert vllm.vllm_aux_layer_ids(hf, n) == (None if is_default else hf)
    assert sglang.sglang_aux_layer_ids(hf, n) == (None if is_default else output_of_layer)
    assert trtllm.trtllm_aux_layer_ids(hf, n) == (None if is_default else output_of_layer)


def test_smollm2_selected_set_under_sglang_pr_25454():
    assert sglang.sglang_aux_layer_ids([4, 13, 26], 30, COND) == [4, 13, 26]  # lowest 4: written as-is
    assert sglang.sglang_aux_layer_ids([2, 13, 26], 30, COND) == [1, 12, 25]  # lowest 2: written ℓ - 1
    with pytest.raises(ValueError, match="cannot be expressed"):
        sglang.sglang_aux_layer_ids([1, 13, 26], 30, COND)
    assert sglang.sglang_aux_layer_ids([1, 13, 26], 30, PLUS_ONE) == [0, 12, 25]


def test_sglang_version_rule_is_pinned():
    assert sglang.sglang_aux_rule("0.5.23") == PLUS_ONE
    assert sglang.sglang_aux_rule("0.5.12.post1") == PLUS_ONE
    assert sglang.sglang_aux_rule("0.7.0", rule=COND) == COND
    with pytest.raises(ValueError, match="--sglang_aux_rule"):
        sglang.sglang_aux_rule("0.5.24")
    with pytest.raises(ValueError, match="unknown SGLang aux-id rule"):
        sglang.sglang_aux_rule("0.5.23", rule="minus_one")


def _capture_before(model, layers, input_ids):
    """Stub capture of vLLM/SGLang: the residual stream entering decoder block i, for i in ``layers``."""
    got, hooks = {}, []
    for i in layers:
        def pre(module, args, kwargs, i=i):
            got[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        hooks.append(model.model.layers[i].register_forward_pre_hook(pre, with_kwargs=True))
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return [got[i] for i in layers]


def _capture_output(model, layers, input_ids):
    """Stub capture of TensorRT-LLM / SpecForge: the output of decoder block j, for j in ``layers``."""
    got, hooks = {}, []
    for j in layers:
        def post(module, args, output, j=j):
            got[j] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        hooks.append(model.model.layers[j].register_forward_hook(post))
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return [got[j] for j in layers]


def _engine_capture(engine, written, n, model, input_ids, rule=PLUS_ONE):
    """Resolve a written list the way each engine does, then capture."""
    if engine in ("vllm", "speculators"):
        layers = written if written else default_aux_layer_ids(n)
        return _capture_before(model, layers, input_ids)
    if engine == "sglang":
        if not written:
            layers = default_aux_layer_ids(n)  # SGLang's None fallback, no +1
        elif rule == PLUS_ONE or written[0] == 1:
            layers = [i + 1 for i in written]
        else:
            layers = list(written)
        return _capture_before(model, layers, input_ids)
    layers = written if written else [i - 1 for i in default_aux_layer_ids(n)]  # TRT-LLM default, output-of-layer
    return _capture_output(model, layers, input_ids)


def _written(engine, ids, n, rule=PLUS_ONE):
    if engine == "vllm":
        return vllm.vllm_aux_layer_ids(ids, n)
    if engine == "speculators":
        return speculators.speculators_aux_layer_ids(ids, n)
    if engine == "sglang":
        return sglang.sglang_aux_layer_ids(ids, n, rule)
    return trtllm.trtllm_aux_layer_ids(ids, n)


@pytest.fixture(scope="module", params=[8, 30, 32])
def llama_n(request):
    n = request.param
    torch.manual_seed(n)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=n,
                      num_attention_heads=2, num_key_value_heads=1)
    return n, LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("engine,rule", [("vllm", PLUS_ONE), ("speculators", PLUS_ONE), ("sglang", PLUS_ONE),
                                         ("sglang", COND), ("trtllm", PLUS_ONE)])
def test_stub_engine_capture_reproduces_hidden_states(engine, rule, llama_n):
    n, model = llama_n
    input_ids = torch.arange(7)[None] % 64
    with torch.no_grad():
        hs = model(input_ids, output_hidden_states=True).hidden_states
        sets = [default_aux_layer_ids(n), [2, n // 2 + 1, n - 2], [3, n // 2, n - 1]]
        if not (engine == "sglang" and rule == COND):
            sets.append([1, n // 2, n - 3])
        for ids in sets:
            written = _written(engine, ids, n, rule)
            captured = _engine_capture(engine, written, n, model, input_ids, rule)
            assert len(captured) == len(ids)
            for ell, tensor in zip(ids, captured):
                torch.testing.assert_close(tensor, hs[ell], atol=0, rtol=0, msg=f"{engine} {ids} id {ell}")
        # the fc input width the head expects equals len(ids) * H_t
        assert torch.cat([hs[i] for i in sets[1]], -1).shape[-1] == 3 * model.config.hidden_size


def test_inverse_rules_round_trip():
    for n in (8, 28, 30, 32):
        for ids in (default_aux_layer_ids(n), [1, 3, n - 1], [3, n // 2, n - 2]):
            assert vllm.hf_aux_layer_ids(vllm.vllm_aux_layer_ids(ids, n), n) == ids
            assert speculators.hf_aux_layer_ids(speculators.speculators_aux_layer_ids(ids, n), n) == ids
            assert trtllm.hf_aux_layer_ids(trtllm.trtllm_aux_layer_ids(ids, n), n) == ids
            assert sglang.hf_aux_layer_ids(sglang.sglang_aux_layer_ids(ids, n), n) == ids
            if ids[0] != 1:
                assert sglang.hf_aux_layer_ids(sglang.sglang_aux_layer_ids(ids, n, COND), n, COND) == ids
