"""Byte accounting (dual-precision.md §3, §7): Qwen3-0.6B built from its numbers on the meta device."""

import pytest
import torch

from draftkit.quant import (
    QuantConfig,
    expected_tokens_per_round,
    expected_verified_ratio,
    gated_bytes_per_token,
    param_bytes,
    quantize_model,
    verified_bytes_per_token,
    weight_bytes,
)
from draftkit.testing import tiny_llama_config


@pytest.fixture(scope="module")
def qwen3_06b():
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _ratios(wb, e=0.16):
    return [gated_bytes_per_token(wb, e, c) / wb.high for c in ("i", "ii", "iii")]


def test_qwen3_bf16_head(qwen3_06b):
    wb = weight_bytes(qwen3_06b, QuantConfig(), scale_bytes=0)
    assert wb.quantized_params == 28 * 15_728_640  # 440.4 M decoder-linear weights
    assert round(wb.high / 1e6, 1) == 751.7  # 440.4 + 311.2 (+ norms)
    assert round(wb.low / 1e6, 1) == 531.5
    assert round(wb.high_plane / 1e6, 1) == 220.2
    assert round(wb.rho, 3) == 0.707
    assert [round(r, 3) for r in _ratios(wb)] == [0.867, 0.820, 0.754]
    # per-channel scales (2 bytes each) are negligible: same ratios within 1e-3
    with_scales = weight_bytes(qwen3_06b, QuantConfig())
    assert _ratios(with_scales) == pytest.approx([0.867, 0.820, 0.754], abs=1e-3)
    assert with_scales.high - wb.high == 28 * 12288 * 2  # one scale per output channel


def test_qwen3_all_quantized(qwen3_06b):
    wb = weight_bytes(qwen3_06b, QuantConfig(quantize_lm_head=True), scale_bytes=0)
    assert round(wb.high / 1e6, 1) == 596.1  # 440.4 + 155.6 (+ norms, one embedding row)
    assert round(wb.rho, 3) == 0.5
    assert [round(r, 3) for r in _ratios(wb)] == [0.660, 0.580, 0.580]


@pytest.mark.parametrize("group_size, rho, ratios", [
    (128, 0.710, [0.870, 0.823, 0.756]),
    (32, 0.717, [0.877, 0.832, 0.763]),
])
def test_qwen3_per_group_scale_bytes(qwen3_06b, group_size, rho, ratios):
    config = QuantConfig(group_size=group_size)
    bare = weight_bytes(qwen3_06b, config, scale_bytes=0)
    wb = weight_bytes(qwen3_06b, config)
    # every decoder-linear input width (1024, 2048, 3072) is a multiple of the group: one scale per g weights
    assert wb.scales == 28 * 15_728_640 // group_size  # 3,440,640 at 128; 13,762,560 at 32
    for field in ("high", "low", "other"):  # fp16 scales are read by both precisions
        assert getattr(wb, field) - getattr(bare, field) == 2 * wb.scales
    assert wb.high_plane == bare.high_plane  # the planes themselves are unchanged
    assert round(wb.high / 1e6, 1) == round(751.7 + 2 * wb.scales / 1e6, 1)  # 758.6 at 128, 779.2 at 32
    assert round(wb.rho, 3) == rho
    assert [round(r, 3) for r in _ratios(wb)] == ratios  # cost model ii's plane-L re-read includes the scales


def test_counts_on_a_quantized_model_equal_the_config_count():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())  # untied head: V*H at 2 bytes, embedding one row
    before = weight_bytes(model)
    quantize_model(model)
    after = weight_bytes(model)
    assert before == after
    h, v, layers = 64, 320, 8
    linears = layers * (h * h + 2 * h * 32 + h * h + 3 * h * 128)  # q, k+v (2 KV heads of 16), o, mlp
    assert after.quantized_params == linears
    norms = (2 * layers + 1) * h
    scales = layers * (h + 32 + 32 + h + 128 + 128 + h)
    assert after.high == linears + (v * h + h + norms + scales) * 2


def test_per_group_counts_with_a_shorter_last_group():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    config = QuantConfig(group_size=48)  # 64 inputs -> 2 groups (48 + 16); down_proj's 128 -> 3 (48 + 48 + 32)
    before = weight_bytes(model, config)
    quantize_model(model, config)
    after = weight_bytes(model, config)
    assert before == after == weight_bytes(model)  # quantized layers count their own groups
    h, layers = 64, 8
    scales = layers * (2 * (h + 32 + 32 + h + 128 + 128) + 3 * h)
    assert after.scales == scales
    assert after.high - weight_bytes(model, config, scale_bytes=0).high == 2 * scales


def test_cost_models_and_bounds():
    from draftkit.quant.bytes import WeightBytes

    wb = WeightBytes(high=100.0, low=70.0, high_plane=40.0, quantized_params=80, other=30.0)
    assert gated_bytes_per_token(wb, 0.0, "i") == 70.0
    assert gated_bytes_per_token(wb, 1.0, "i") == 170.0  # every step pays both passes
    assert gated_bytes_per_token(wb, 1.0, "iii") == 100.0
    assert gated_bytes_per_token(wb, 0.5, "ii") == 70.0 + 0.5 * 60.0
    with pytest.raises(ValueError, match="cost model"):
        gated_bytes_per_token(wb, 0.1, "iv")
    with pytest.raises(ValueError, match="escalation rate"):
        gated_bytes_per_token(wb, 1.5)
    assert verified_bytes_per_token(wb, 3, 4.0) == (3 * 70 + 100) / 4


@pytest.mark.parametrize(
    "rho, alpha, row",
    [
        (0.707, 0.90, [0.898, 0.891, 0.908, 0.935, 1.005]),
        (0.707, 0.95, [0.875, 0.846, 0.841, 0.846, 0.869]),
        (0.707, 0.98, [0.862, 0.821, 0.804, 0.797, 0.795]),
        (0.5, 0.95, [0.769, 0.701, 0.674, 0.663, 0.663]),
    ],
)
def test_verified_ratio_table(rho, alpha, row):
    assert [round(expected_verified_ratio(rho, alpha, k), 3) for k in (1, 2, 3, 4, 6)] == row


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_round(1.0, 3) == 4.0


def test_qwen3_asymmetric_counts_a_zero_point_per_scale(qwen3_06b):
    sym = weight_bytes(qwen3_06b, QuantConfig(group_size=32))
    wb = weight_bytes(qwen3_06b, QuantConfig(group_size=32, scheme="asymmetric"))
    assert wb.scales == sym.scales == 13_762_560 and wb.zero_points == wb.scales and sym.zero_points == 0
    for field in ("high", "low", "other"):  # an fp16 zero point per group, read by both precisions
        assert getattr(wb, field) - getattr(sym, field) == 2 * wb.zero_points
    assert wb.high_plane == sym.high_plane
    assert round(wb.high / 1e6, 1) == 806.7  # 779.2 + 27.5 MB of zero points
    assert round(wb.rho, 3) == 0.727
    assert [round(r, 3) for r in _ratios(wb)] == [0.887, 0.843, 0.771]


def test_asymmetric_counts_on_a_quantized_model_equal_the_config_count():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    config = QuantConfig(group_size=32, scheme="asymmetric", quantize_lm_head=True)
    before = weight_bytes(model, config)
    quantize_model(model, config)
    after = weight_bytes(model, QuantConfig(quantize_lm_head=True))  # the nested layers carry their own zero points
    assert after == before and after.zero_points == after.scales > 0


def test_param_bytes_counts_stored_bytes_once_and_skips_prefixes():
    """The plain count behind decoding's bytes read: numel x element size, a tied tensor once, prefixes left out."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    assert param_bytes(m) == (12 + 3 + 6) * 4
    assert param_bytes(m, exclude=("0.",)) == 6 * 4
    assert param_bytes(m.to(torch.bfloat16)) == (12 + 3 + 6) * 2
    tied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
    tied["head"].weight = tied["embed"].weight
    assert param_bytes(tied) == 40 * 4


def test_biases_are_read_at_both_precisions():
    """Quantized linears with and without a bias, plus a norm: every term by hand (the bias of a quantized
    linear is read in float at both precisions; issue 56)."""
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(6, 4, bias=True), nn.Linear(4, 3, bias=False)])
            self.norm = nn.LayerNorm(3)

    wb = weight_bytes(Tiny())
    quantized, scales, biases, norm = 6 * 4 + 4 * 3, 4 + 3, 4, 3 + 3
    assert wb.quantized_params == quantized and wb.scales == scales
    assert wb.other == (scales + biases + norm) * 2
    assert wb.high == quantized + wb.other and wb.low == quantized / 2 + wb.other
    quantize_model(model := Tiny())
    assert weight_bytes(model) == wb  # the quantized module counts the same bias
