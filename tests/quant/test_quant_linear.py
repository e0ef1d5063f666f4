"""NestedInt8Linear: exact integer-grid compute, precision switch, module selection (dual-precision.md §1)."""

import pytest
import torch
from torch import nn

from draftkit.quant import (
    NestedInt8Linear,
    QuantConfig,
    nested_linears,
    precision,
    quantize_int8,
    quantize_model,
    select_linears,
    set_precision,
    slice_codes,
)
from draftkit.testing import tiny_llama_config


@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
def test_matmul_matches_fp64_reference(scheme):
    torch.manual_seed(0)
    lin = nn.Linear(48, 24, bias=True)
    x = torch.randn(3, 5, 48)
    layer = NestedInt8Linear.from_linear(lin, "midpoint", scheme)
    quant = quantize_int8(lin.weight, scheme)
    for prec, codes in (("high", quant.codes), ("low", slice_codes(quant.codes, "midpoint"))):
        layer.precision = prec
        w_ref = quant.dequantize(codes, torch.float64)  # (O, I) scale * (codes - zero)
        ref = x.double() @ w_ref.T + lin.bias.double()  # (3, 5, O)
        torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    # both grids are exact integers in the stored dtype
    assert torch.equal(layer.codes_high_t, layer.codes_high_t.round())
    assert torch.equal(layer.codes("low").to(torch.int16), quant.centered(slice_codes(quant.codes)))


def test_bf16_codes_are_exact():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16).to(torch.bfloat16)
    layer = NestedInt8Linear.from_linear(lin)
    q = quantize_int8(lin.weight).codes
    assert layer.codes_high_t.dtype == torch.bfloat16
    assert torch.equal(layer.codes("high").to(torch.int16), q.to(torch.int16))
    assert torch.equal(layer.codes("low").to(torch.int16), slice_codes(q))


@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("slicing", ["midpoint", "round"])
@pytest.mark.parametrize("group_size", [16, 20])  # 48 inputs: 3 groups; 3 groups, the last of 8
def test_per_group_matmul_matches_fp64_reference(scheme, slicing, group_size):
    torch.manual_seed(0)
    lin = nn.Linear(48, 24, bias=True)
    x = torch.randn(3, 5, 48)
    layer = NestedInt8Linear.from_linear(lin, slicing, scheme, group_size=group_size)
    quant = quantize_int8(lin.weight, scheme, group_size)
    assert layer.num_groups == 3 and layer.scale.shape == (3, 24)
    for prec, codes in (("high", quant.codes), ("low", slice_codes(quant.codes, slicing))):
        layer.precision = prec
        assert torch.equal(layer.codes().to(torch.int16), quant.centered(codes))  # exact grids, per group
        w_ref = quant.dequantize(codes, torch.float64)  # (O, I), each group with its own scale
        ref = x.double() @ w_ref.T + lin.bias.double()  # (3, 5, O)
        torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.weight.double(), w_ref, rtol=1e-6, atol=1e-7)


def test_group_size_of_the_input_width_equals_per_channel_exactly():
    torch.manual_seed(0)
    lin = nn.Linear(48, 24, bias=True)
    x = torch.randn(2, 7, 48)
    per_channel = NestedInt8Linear.from_linear(lin, "round")
    for group_size in (48, 64):
        grouped = NestedInt8Linear.from_linear(lin, "round", group_size=group_size)
        assert grouped.num_groups == 1
        for prec in ("high", "low"):
            per_channel.precision = grouped.precision = prec
            assert torch.equal(grouped(x), per_channel(x))  # bit for bit


def _tiny_model(**overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def test_default_selection_is_decoder_linears_only():
    model = _tiny_model()
    names = list(select_linears(model))
    assert len(names) == 8 * 7  # q, k, v, o, gate, up, down in each of 8 layers
    assert all(".layers." in n for n in names) and "lm_head" not in names
    assert "lm_head" in select_linears(model, QuantConfig(quantize_lm_head=True))
    only_mlp = select_linears(model, QuantConfig(include=("*.mlp.*",)))
    assert len(only_mlp) == 8 * 3


def test_precision_switch_changes_logits_and_restores():
    model = _tiny_model()
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model(model)
        high = model(ids).logits
        with precision(model, "low"):
            low = model(ids).logits
        again = model(ids).logits
    assert torch.equal(high, again)  # the context manager restored 8 bits
    assert (high - ref).abs().max() < 0.05 * ref.abs().max()  # int8 is close to float
    assert (low - high).abs().max() > (high - ref).abs().max()  # 4 bits is further
    assert all(m.precision == "high" for m in nested_linears(model))
    set_precision(model, "low")
    assert all(m.precision == "low" for m in nested_linears(model))
    with pytest.raises(ValueError, match="unknown precision"):
        set_precision(model, "int2")


def test_no_quantizable_linears_is_an_error():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))
    with pytest.raises(ValueError, match="no quantizable linears"):
        quantize_model(model)
    with pytest.raises(ValueError, match="no quantizable linears"):
        quantize_model(_tiny_model(), QuantConfig(include=("*.nothing.*",)))


def test_quantize_model_per_group_switches_precision():
    model = _tiny_model()
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    with torch.no_grad():
        ref = model(ids).logits
        layers = quantize_model(model, QuantConfig(group_size=32))
        high = model(ids).logits
        with precision(model, "low"):
            low = model(ids).logits
    assert {m.num_groups for m in layers.values()} == {2, 4}  # 64 inputs, and 128 for down_proj
    assert (high - ref).abs().max() < 0.05 * ref.abs().max()
    assert (low - high).abs().max() > (high - ref).abs().max()


def test_config_validation():
    with pytest.raises(ValueError, match="group_size"):
        QuantConfig(group_size=0)
    with pytest.raises(ValueError, match="slicing"):
        QuantConfig(slicing="floor")
    with pytest.raises(ValueError, match="scheme"):
        QuantConfig(scheme="nf4")
    assert QuantConfig(include="*.mlp.*").include == ("*.mlp.*",)
