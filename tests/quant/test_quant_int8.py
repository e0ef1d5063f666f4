"""Int8 codes, nibble split and slicing variants (dual-precision.md §1-2, §10)."""

import pytest
import torch

from draftkit.quant import (
    SLICINGS,
    merge_nibbles,
    quantize_int8,
    slice_codes,
    slicing_error,
    slicing_error_table,
    split_nibbles,
)


def test_nibble_identity_all_256_codes():
    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)  # every int8 code once
    h, l = split_nibbles(q)
    assert torch.equal(merge_nibbles(h, l), q.to(torch.int16))
    assert h.min() == -8 and h.max() == 7  # signed high nibble, floor(q / 16)
    assert l.min() == 0 and l.max() == 15  # unsigned low nibble
    assert torch.equal(h.to(torch.int16), torch.div(q.to(torch.int16), 16, rounding_mode="floor"))
    u = torch.arange(0, 256, dtype=torch.int16).to(torch.uint8)
    hu, lu = split_nibbles(u)
    assert torch.equal(merge_nibbles(hu, lu), u.to(torch.int16))


def test_slicing_levels_and_bias_signs():
    q = torch.arange(-127, 128, dtype=torch.int16).to(torch.int8)  # the codes symmetric int8 uses
    mid = slice_codes(q, "midpoint")
    assert sorted(set(mid.tolist())) == sorted([-v for v in range(8, 121, 16)] + list(range(8, 121, 16)))
    assert sorted(set(slice_codes(q, "truncate").tolist())) == list(range(-128, 113, 16))
    rnd = slice_codes(q, "round")
    assert rnd.min() == -128 and rnd.max() == 112 and (rnd % 16 == 0).all()
    assert (rnd - q.to(torch.int16)).abs().max() <= 15  # 120..127 clamp to 112
    # the mid-point keeps the exact split: the 8-bit code is 16*h + l from the same two planes
    h, l = split_nibbles(q)
    assert torch.equal(mid - 8 + l.to(torch.int16), q.to(torch.int16))


def test_quantize_error_at_most_half_step():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.rand(64, 1) * 3
    w[3] = 0.0  # an all-zero row stays exact
    for scheme in ("symmetric", "asymmetric"):
        quant = quantize_int8(w, scheme)
        assert quant.scale.shape == (64, 1)
        err = (quant.dequantize() - w).abs()
        assert (err <= quant.scale / 2 * (1 + 1e-5) + 1e-7).all(), scheme
        assert quant.dequantize()[3].abs().max() == 0.0
    sym = quantize_int8(w)
    assert sym.codes.dtype == torch.int8 and sym.codes.min() >= -127
    rows = torch.arange(64) != 3
    assert torch.allclose(sym.scale[rows, 0], w[rows].abs().amax(1) / 127) and sym.scale[3, 0] == 1.0
    assert (sym.codes.abs().amax(1)[rows] == 127).all()  # absmax maps to the edge code


def _group_reference(w, group_size, scheme):
    """Plain reference: quantize each group of columns on its own as a per-channel matrix."""
    parts = [quantize_int8(w[:, j:j + group_size], scheme) for j in range(0, w.shape[1], group_size)]
    codes = torch.cat([p.codes for p in parts], dim=1)
    scale = torch.cat([p.scale for p in parts], dim=1)
    w_hat = torch.cat([p.dequantize(dtype=torch.float64) for p in parts], dim=1)
    return codes, scale, w_hat


@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("group_size", [32, 40, 128])  # 96 inputs: 3 groups, 3 groups (last of 16), 1 group
def test_per_group_round_trip_equals_groupwise_reference(scheme, group_size):
    torch.manual_seed(0)
    w = torch.randn(16, 96) * torch.logspace(-2, 1, 96)  # input columns of very different magnitude
    w[5, 40:80] = 0.0  # an all-zero group (group_size 40) stays exact with scale 1
    quant = quantize_int8(w, scheme, group_size)
    codes, scale, w_hat = _group_reference(w, group_size, scheme)
    groups = -(-96 // group_size)
    assert quant.scale.shape == (16, groups) and quant.group_size == group_size
    assert torch.equal(quant.codes, codes) and torch.equal(quant.scale, scale)
    torch.testing.assert_close(quant.dequantize(dtype=torch.float64), w_hat, rtol=0, atol=0)
    per_col = quant.scale.repeat_interleave(group_size, dim=1)[:, :96]  # (O, I) scale of each weight
    assert ((quant.dequantize() - w).abs() <= per_col / 2 * (1 + 1e-5) + 1e-7).all()  # half a step per group
    if scheme == "symmetric" and group_size == 40:
        assert quant.scale[5, 1] == 1.0 and quant.dequantize()[5, 40:80].abs().max() == 0.0


def test_per_group_is_finer_than_per_channel():
    torch.manual_seed(0)
    w = torch.randn(64, 512) * torch.logspace(-2, 0, 512)  # column outliers: per-channel scales waste codes
    errors = [slicing_error(w, "midpoint", group_size=g)[0] for g in (None, 128, 64, 32)]
    assert errors == sorted(errors, reverse=True)  # smaller groups, smaller 4-bit error
    assert errors[-1] < 0.5 * errors[0]


@pytest.mark.parametrize("slicing", SLICINGS)
def test_nibble_identity_and_slice_per_group(slicing):
    torch.manual_seed(0)
    w = torch.randn(8, 100) * torch.logspace(-1, 1, 100)
    quant = quantize_int8(w, "symmetric", 32)  # 4 groups, the last of 4 inputs
    h, l = split_nibbles(quant.codes)
    assert torch.equal(merge_nibbles(h, l), quant.codes.to(torch.int16))  # q = 16 h + l within every group
    low = slice_codes(quant.codes, slicing)
    for g in range(4):  # the 4-bit level of group g is 16 s_g times its nibble level, from plane H alone
        cols = slice(32 * g, 32 * (g + 1))
        ref = quantize_int8(w[:, cols], "symmetric")  # the group quantized on its own
        expected = ref.dequantize(slice_codes(ref.codes, slicing), torch.float64)
        torch.testing.assert_close(quant.dequantize(low, torch.float64)[:, cols], expected, rtol=0, atol=0)
    if slicing == "midpoint":
        assert torch.equal(low, h.to(torch.int16) * 16 + 8)


@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
def test_group_size_of_the_input_width_is_per_channel(scheme):
    torch.manual_seed(0)
    w = torch.randn(24, 48)
    per_channel = quantize_int8(w, scheme)
    for group_size in (48, 1000):
        grouped = quantize_int8(w, scheme, group_size)
        assert torch.equal(grouped.codes, per_channel.codes) and torch.equal(grouped.scale, per_channel.scale)
        if scheme == "asymmetric":
            assert torch.equal(grouped.zero, per_channel.zero)
    with pytest.raises(ValueError, match="group_size"):
        quantize_int8(w, scheme, 0)


def test_slicing_error_table_matches_reference():
    # dual-precision.md §2: N(0, 1) weights, rows of 1024 inputs
    torch.manual_seed(0)
    w = torch.randn(1024, 1024)
    table = slicing_error_table(w)
    expected = {"truncate": 0.058, "midpoint": 0.016, "round": 0.016, "native_int4": 0.020}
    for variant, mse in expected.items():
        assert round(table[variant]["rel_mse"], 3) == mse, (variant, table[variant])
    assert 5e-5 < table["int8"]["rel_mse"] < 7e-5  # 6e-5
    assert table["truncate"]["mean_error_lsb8"] == pytest.approx(-7.5, abs=0.05)
    assert table["midpoint"]["mean_error_lsb8"] == pytest.approx(0.5, abs=0.05)
    assert table["round"]["mean_error_lsb8"] == pytest.approx(0.5, abs=0.05)
    # stable ratios: truncation ~3.6x the mid-point error, native int4 ~1.27x
    assert table["truncate"]["rel_mse"] / table["midpoint"]["rel_mse"] == pytest.approx(3.6, abs=0.1)
    assert table["native_int4"]["rel_mse"] / table["midpoint"]["rel_mse"] == pytest.approx(1.27, abs=0.03)


@pytest.mark.parametrize("n_in, expected", [(256, 0.013), (3072, 0.019)])
def test_midpoint_error_grows_with_row_length(n_in, expected):
    torch.manual_seed(1)
    mse, _ = slicing_error(torch.randn(256, n_in), "midpoint")
    assert round(mse, 3) == expected


def test_unknown_variants_are_rejected():
    with pytest.raises(ValueError, match="unknown slicing"):
        slice_codes(torch.zeros(2, dtype=torch.int8), "floor")
    with pytest.raises(ValueError, match="unknown int8 scheme"):
        quantize_int8(torch.zeros(2, 2), "nf4")
    with pytest.raises(TypeError):
        split_nibbles(torch.zeros(2, dtype=torch.int32))
    assert SLICINGS[0] == "midpoint"



def test_asymmetric_nested_grid_slices_a_4bit_block_exactly(q4_1_blocks):
    w, k = q4_1_blocks(6, 3)
    quant = quantize_int8(w, "asymmetric", 32)  # R = 240
    assert quant.codes.dtype == torch.uint8 and quant.zero.shape == (6, 3)
    assert torch.equal(quant.codes.to(torch.int64), 16 * k)  # the 16 levels land on codes 16*k
    torch.testing.assert_close(quant.dequantize(dtype=torch.float64), w.double(), rtol=0, atol=1e-7)
    for slicing in ("truncate", "round"):  # the 4-bit slice is the 8-bit code itself, hence the block
        low = slice_codes(quant.codes, slicing)
        assert torch.equal(low, quant.codes.to(torch.int16)), slicing
    mid = slice_codes(quant.codes, "midpoint")
    assert torch.equal(mid - 8, quant.codes.to(torch.int16))  # half a 4-bit step high on an aligned block
    # R = 255 (the reference's full range) is not nested: codes 17*k, high nibble k, truncation reads 16*k
    full = quantize_int8(w, "asymmetric", 32, code_range=255)
    assert torch.equal(full.codes.to(torch.int64), 17 * k)
    assert torch.equal(slice_codes(full.codes, "truncate").to(torch.int64), 16 * k)
    # symmetric absmax codes re-quantize the same block onto a misaligned 4-bit grid
    sym = quantize_int8(w, "symmetric", 32)
    err = (sym.dequantize(slice_codes(sym.codes, "round"), torch.float64) - w.double()).abs()
    assert err.max() > 0.1 * w.abs().max()


def test_asymmetric_per_channel_matches_the_formula():
    torch.manual_seed(0)
    w = torch.randn(12, 40) * 0.1 + torch.randn(12, 1) * 0.05  # rows with an offset
    w[2] = 0.0  # all-zero row: scale 1, zero 0, exact
    w[3] = 0.25  # constant row: scale 1, exact through the zero point
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale = torch.where(hi > lo, (hi - lo) / 240, torch.ones_like(hi))  # (O, 1)
    codes = torch.clamp(torch.round((w - lo) / scale), 0, 240)  # (O, I)
    for group_size in (None, 40, 64):  # group size >= the input width is per-channel
        quant = quantize_int8(w, "asymmetric", group_size)
        assert torch.equal(quant.scale, scale) and torch.equal(quant.zero, -lo / scale)
        assert torch.equal(quant.codes, codes.to(torch.uint8))
        torch.testing.assert_close(quant.dequantize(dtype=torch.float64), (scale * codes + lo).double())
    assert quant.dequantize()[2].abs().max() == 0.0 and torch.equal(quant.dequantize()[3], w[3])
    with pytest.raises(ValueError, match="code_range"):
        quantize_int8(w, "asymmetric", 32, code_range=256)


@pytest.mark.parametrize("slicing", SLICINGS)
def test_asymmetric_nibble_identity_and_slice_per_group(slicing):
    torch.manual_seed(0)
    w = torch.randn(8, 100) * torch.logspace(-1, 1, 100) + 0.3  # groups off zero
    quant = quantize_int8(w, "asymmetric", 32)  # 4 groups, the last of 4 inputs
    assert quant.codes.max() <= 240
    h, l = split_nibbles(quant.codes)
    assert torch.equal(merge_nibbles(h, l), quant.codes.to(torch.int16))  # q = 16 h + l, unsigned nibbles
    assert h.min() >= 0 and h.max() <= 15 and l.min() >= 0
    low = slice_codes(quant.codes, slicing)
    for g in range(4):  # the 4-bit level of group g uses its own scale and zero point
        cols = slice(32 * g, 32 * (g + 1))
        ref = quantize_int8(w[:, cols], "asymmetric")
        expected = ref.dequantize(slice_codes(ref.codes, slicing), torch.float64)
        torch.testing.assert_close(quant.dequantize(low, torch.float64)[:, cols], expected, rtol=0, atol=0)
    if slicing == "round":  # nearest point of the lattice {0, 16, ..., 240}: at most half a 4-bit step off
        assert (low - quant.codes.to(torch.int16)).abs().max() <= 8 and low.max() <= 240


# quantize_int8 of a weight that requires grad (a module's parameter) (issue 36).


def test_quantize_a_parameter_detaches_it():
    w = torch.nn.Parameter(torch.tensor([[0.5, -1.0, 0.25, 1.0]]))
    q = quantize_int8(w, "symmetric")
    tensors = [v for v in vars(q).values() if isinstance(v, torch.Tensor)]
    assert tensors and not any(t.requires_grad for t in tensors)
    plain = quantize_int8(w.detach().clone(), "symmetric")
    assert all(torch.equal(a, b) for a, b in zip(tensors, [v for v in vars(plain).values() if isinstance(v, torch.Tensor)]))
