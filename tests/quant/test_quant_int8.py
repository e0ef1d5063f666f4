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
        err = (quant.dequantize() - w).abs()
        assert (err <= quant.scale[:, None] / 2 * (1 + 1e-5) + 1e-7).all(), scheme
        assert quant.dequantize()[3].abs().max() == 0.0
    sym = quantize_int8(w)
    assert sym.codes.dtype == torch.int8 and sym.codes.min() >= -127
    rows = torch.arange(64) != 3
    assert torch.allclose(sym.scale[rows], w[rows].abs().amax(1) / 127) and sym.scale[3] == 1.0
    assert (sym.codes.abs().amax(1)[rows] == 127).all()  # absmax maps to the edge code


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
