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
    assert torch.equal(layer.codes("low").to(torch.int16), slice_codes(quant.codes))


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
        assert torch.equal(layer.codes().to(torch.int16), codes.to(torch.int16))  # exact grids, per group
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
    with pytest.raises(ValueError, match="code_range"):
        QuantConfig(scheme="asymmetric", code_range=300)
    assert QuantConfig(include="*.mlp.*").include == ("*.mlp.*",)


def test_asymmetric_bf16_compute_keeps_the_zero_term_exact():
    torch.manual_seed(0)
    lin = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        lin.weight[:8].add_(1.0)  # groups off zero: zero points far outside [0, 240]
    quant = quantize_int8(lin.weight, "asymmetric", 32)
    assert quant.zero.min() < -1000
    layer = NestedInt8Linear.from_linear(lin, "round", "asymmetric", dtype=torch.bfloat16, group_size=32)
    fp32 = NestedInt8Linear.from_linear(lin, "round", "asymmetric", dtype=torch.float32, group_size=32)
    assert layer.codes_high_t.dtype == torch.bfloat16 and torch.equal(layer.codes_high_t, layer.codes_high_t.round())
    xb = torch.randn(4, 64).to(torch.bfloat16)
    for prec in ("high", "low"):
        layer.precision = fp32.precision = prec
        out = layer(xb)
        assert out.dtype == torch.bfloat16
        # x @ q and z * sum(x) cancel, so they are formed in fp32: one bf16 rounding, of the output only
        assert torch.equal(out, fp32(xb.float()).to(torch.bfloat16))
    ref = xb.double() @ quant.dequantize(fp32.codes("low").to(torch.int16), torch.float64).T  # (4, O)
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-5)


def test_asymmetric_layer_on_a_4bit_source_has_identical_precisions(q4_1_blocks):
    w, _ = q4_1_blocks(24, 3)
    lin = nn.Linear(96, 24, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(2, 5, 96)
    ref = x.double() @ w.double().T  # (2, 5, O)
    for slicing in ("truncate", "round"):
        layer = NestedInt8Linear.from_linear(lin, slicing, "asymmetric", group_size=32)
        assert torch.equal(layer.codes_low_t, layer.codes_high_t)  # one grid: the 4-bit model is the 8-bit one
        with precision([layer], "low"):
            low = layer(x)
        assert torch.equal(low, layer(x))
        torch.testing.assert_close(low.double(), ref, rtol=1e-5, atol=1e-5)  # and both are the source weight
    symmetric = NestedInt8Linear.from_linear(lin, "round", group_size=32)
    assert not torch.equal(symmetric.codes_low_t, symmetric.codes_high_t)


def test_asymmetric_model_on_a_4bit_grid_runs_identically_at_both_precisions():
    model = _tiny_model()
    with torch.no_grad():  # snap every decoder linear to 16-level grids per 32 inputs, as a Q4_1 GGUF holds it
        for layer in select_linears(model).values():
            quant = quantize_int8(layer.weight, "asymmetric", 32)
            layer.weight.copy_(quant.dequantize(slice_codes(quant.codes, "round")))
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model(model, QuantConfig(scheme="asymmetric", group_size=32, slicing="truncate"))
        high = model(ids).logits
        with precision(model, "low"):
            low = model(ids).logits
    assert torch.equal(low, high)  # the 4-bit slice carries everything: nothing to escalate
    torch.testing.assert_close(high, ref, rtol=1e-4, atol=1e-4)
