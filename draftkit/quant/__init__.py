"""Simulated nested int8/int4 weights: per-channel or per-group int8 codes (symmetric, or asymmetric with the
4-bit lattice nested in the codes), bit planes q = 16*h + l, slicing variants, a precision switch per layer, and
weight-byte accounting (dual-precision.md §1-3). Pure torch."""

from draftkit.quant.bytes import (
    COST_MODELS,
    WeightBytes,
    expected_tokens_per_round,
    expected_verified_ratio,
    gated_bytes_per_token,
    param_bytes,
    verified_bytes_per_token,
    weight_bytes,
)
from draftkit.quant.int8 import (
    ASYM_NESTED_RANGE,
    SCHEMES,
    SLICINGS,
    Int8Weight,
    merge_nibbles,
    native_int4_rtn,
    num_groups,
    quantize_int8,
    slice_codes,
    slicing_error,
    slicing_error_table,
    split_nibbles,
)
from draftkit.quant.linear import (
    PRECISIONS,
    NestedInt8Linear,
    QuantConfig,
    nested_linears,
    precision,
    quantize_model,
    select_linears,
    set_precision,
)

__all__ = [
    "ASYM_NESTED_RANGE",
    "COST_MODELS",
    "PRECISIONS",
    "SCHEMES",
    "SLICINGS",
    "Int8Weight",
    "NestedInt8Linear",
    "QuantConfig",
    "WeightBytes",
    "expected_tokens_per_round",
    "expected_verified_ratio",
    "gated_bytes_per_token",
    "merge_nibbles",
    "native_int4_rtn",
    "nested_linears",
    "num_groups",
    "param_bytes",
    "precision",
    "quantize_int8",
    "quantize_model",
    "select_linears",
    "set_precision",
    "slice_codes",
    "slicing_error",
    "slicing_error_table",
    "split_nibbles",
    "verified_bytes_per_token",
    "weight_bytes",
]
