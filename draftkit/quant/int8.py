"""Int8 codes, the bit-plane split q = 16*h + l, and the 4-bit slicing variants (dual-precision.md §1-2).

One stored int8 copy serves two precisions: the 8-bit model uses the code q, the 4-bit model a level built
from the high nibble h alone (effective scale 16*s). Everything here is pure torch on integer tensors.

Notable:
- symmetric int8 is the default; codes use [-127, 127] (-128 unused)
- granularity: one scale per output channel (``group_size`` None, the default), or per group of
  ``group_size`` consecutive inputs of a row (G = ceil(I / group_size) groups; a last, shorter group when
  group_size does not divide I), as every practical 4-bit scheme does (GPTQ, AWQ, llama.cpp's Q4 blocks)
- the 4-bit slice is elementwise on the codes, so with per-group codes it is taken per group: the 4-bit
  level of group g is 16*s_g times the slice of its codes
- the asymmetric option stores unsigned codes in [0, R] with a real-valued zero point per row (or group),
  the group's minimum: W_hat = s*(q - z) = s*q + min, the form of llama.cpp's Q4_1/Q4_K blocks (d*q + m). Its
  nibbles are unsigned. R = 240 (default, ``ASYM_NESTED_RANGE``) nests the 4-bit lattice in the 8-bit one:
  s = (max - min)/240 makes the 4-bit step 16*s = (max - min)/15, the step of a min/max 4-bit quantizer of
  the same group, and its 16 levels are exactly the codes 16*k (k = 0..15, the high nibble k). A group that
  already lies on a 16-level grid min + k*d with both ends used (a dequantized Q4_1 block) gets codes 16*k,
  so truncation and round slicing reproduce it exactly. R = 255 (the reference's full range) is not nested:
  the same group lands on codes 17*k, whose high nibble k reads back as 16*k
- slicing variants: ``midpoint`` 16*h + 8 (default), ``truncate`` 16*h, ``round`` 16*clamp(floor((q+8)/16))
- ``native_int4_rtn`` is the non-nested reference (its own absmax/7 scale), used only for the error table

Shapes: O output channels (rows), I input features (columns), G groups per row (1 = per channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "SLICINGS",
    "SCHEMES",
    "ASYM_NESTED_RANGE",
    "Int8Weight",
    "num_groups",
    "quantize_int8",
    "split_nibbles",
    "merge_nibbles",
    "slice_codes",
    "native_int4_rtn",
    "slicing_error",
    "slicing_error_table",
]

SLICINGS = ("midpoint", "truncate", "round")
"""4-bit slicing variants of an int8 code; ``midpoint`` is the default (dual-precision.md §2)."""

SCHEMES = ("symmetric", "asymmetric")
"""Int8 quantization schemes, each per output channel or per group of inputs."""

ASYM_NESTED_RANGE = 240
"""R = 15*16: asymmetric codes span [0, 240], so the 4-bit levels 16*k (k = 0..15) are a min/max 4-bit grid."""


def num_groups(in_features: int, group_size: int | None) -> int:
    """G = ceil(I / group_size), the scales per row; 1 for per-channel (``group_size`` None or >= I).

    Raises:
        ValueError: if ``group_size`` is not None and < 1.
    """
    if group_size is None:
        return 1
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (or None for one scale per output channel), got {group_size}")
    return -(-in_features // group_size)


def _group_width(in_features: int, group_size: int | None) -> int:
    """Inputs per group: ``group_size`` clipped to I (I for per-channel)."""
    return in_features if group_size is None else min(group_size, in_features)


def _per_column(values: torch.Tensor, in_features: int, group_size: int | None) -> torch.Tensor:
    """(O, G) per-group values -> (O, I), each repeated over its group's columns (the last may be shorter)."""
    return values.repeat_interleave(_group_width(in_features, group_size), dim=1)[:, :in_features]


def _group_extremes(w: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, I) -> (min, max) over each group of inputs, both (O, G); the padding never wins either."""
    n_in = w.shape[1]
    groups, size = num_groups(n_in, group_size), _group_width(n_in, group_size)
    pad = groups * size - n_in
    lo = F.pad(w, (0, pad), value=float("inf")).view(w.shape[0], groups, size).amin(dim=2)  # (O, G)
    hi = F.pad(w, (0, pad), value=float("-inf")).view(w.shape[0], groups, size).amax(dim=2)  # (O, G)
    return lo, hi


def _symmetric_codes(w: torch.Tensor, qmax: int, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest on [-qmax, qmax]: s = absmax/qmax per row or group (1 for all-zero ones).

    Returns:
        (codes (O, I) float32 integers, scale (O, G) float32).
    """
    lo, hi = _group_extremes(w, group_size)
    scale = torch.maximum(-lo, hi) / qmax  # (O, G)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(w / _per_column(scale, w.shape[1], group_size)), -qmax, qmax)  # (O, I)
    return codes, scale


@dataclass
class Int8Weight:
    """Int8 codes of a weight matrix, per channel or per group: W_hat_oj = scale_og * (codes_oj - zero_og),
    g the group of input j (g = j // group_size; one group per row for per-channel).

    Attributes:
        codes: (O, I) int8 for ``symmetric`` (values in [-127, 127]) or uint8 for ``asymmetric`` ([0, R]).
        scale: (O, G) float32, weight units per code step (LSB_8); G = 1 for per-channel.
        zero: (O, G) float32 real-valued zero point in code units for ``asymmetric`` (-min / scale, so that
            -scale * zero is the group minimum), None for ``symmetric``.
        group_size: inputs per scale (the last group of a row may be shorter), None for per-channel.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group_size: int | None = None

    @property
    def scheme(self) -> str:
        """``symmetric`` (no zero point) or ``asymmetric``."""
        return "symmetric" if self.zero is None else "asymmetric"

    def dequantize(self, codes: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(O, I) ``scale * (codes - zero)`` computed in float64, returned in ``dtype``.

        Args:
            codes: (O, I) integer codes on this weight's grid (default: the int8 codes; e.g. a 4-bit slice).
            dtype: output dtype.
        """
        codes = (self.codes if codes is None else codes).double()  # (O, I)
        n_in = codes.shape[1]
        if self.zero is not None:
            codes = codes - _per_column(self.zero.double(), n_in, self.group_size)  # (O, I)
        return (_per_column(self.scale.double(), n_in, self.group_size) * codes).to(dtype)


def quantize_int8(
    weight: torch.Tensor, scheme: str = "symmetric", group_size: int | None = None, code_range: int = ASYM_NESTED_RANGE
) -> Int8Weight:
    """Quantize a weight matrix to int8 per output channel or per group of inputs (dual-precision.md §1).

    Over each row (``group_size`` None) or each group of ``group_size`` consecutive inputs of a row:
    Symmetric: s = max |W| / 127, q = clamp(round(W / s), -127, 127).
    Asymmetric: s = (max - min) / R, z = -min / s (real-valued), q = clamp(round((W - min) / s), 0, R), so
    W_hat = s * (q - z) = s * q + min. R = 240 by default (nested 4-bit lattice, see the module docstring).

    The zero point is not rounded to an integer (reference §1 writes z = round(-min / s)): an integer zero
    point shifts a whole group by up to s/2, so the 8-bit model would not reproduce a group that already lies
    on a grid (a dequantized GGUF block), and where -min/s is near a half-integer, float noise puts some
    elements of one 4-bit level on 16*k - 1, which truncation drops a whole 4-bit step. It is stored as one
    fp16 value per group (counted by ``draftkit.quant.bytes``); the simulation keeps scale and zero in fp32,
    as it keeps the symmetric scale. All-zero or constant rows (groups) get scale 1, so dequantization stays
    exact. A ``group_size`` >= I is per-channel exactly.

    Args:
        weight: (O, I) floating weight.
        scheme: ``symmetric`` or ``asymmetric``.
        group_size: inputs per scale, >= 1, or None for one scale per output channel. The last group of a
            row is shorter when it does not divide I.
        code_range: R, the largest asymmetric code, in [15, 255] (ignored by ``symmetric``): 240 nests the
            4-bit levels 16*k exactly, 255 is the reference's full range.

    Returns:
        :class:`Int8Weight` with (O, G) scales, G = ceil(I / group_size) (1 for per-channel).

    Raises:
        ValueError: on an unknown scheme, a weight that is not 2-D, a group size < 1, or a code range outside
            [15, 255].
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown int8 scheme {scheme!r}; choose one of {SCHEMES}")
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    if not 15 <= code_range <= 255:
        raise ValueError(f"code_range R must be in [15, 255] (largest asymmetric uint8 code), got {code_range}")
    w = weight.detach().to(torch.float32)
    if scheme == "symmetric":
        codes, scale = _symmetric_codes(w, 127, group_size)
        return Int8Weight(codes.to(torch.int8), scale, None, group_size)
    lo, hi = _group_extremes(w, group_size)  # (O, G)
    scale = (hi - lo) / code_range
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    n_in = w.shape[1]
    offset = w - _per_column(lo, n_in, group_size)  # (O, I), >= 0
    codes = torch.clamp(torch.round(offset / _per_column(scale, n_in, group_size)), 0, code_range)  # (O, I)
    return Int8Weight(codes.to(torch.uint8), scale, -lo / scale, group_size)


def split_nibbles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-plane split of int8 codes: q = 16*h + l.

    For int8 codes h = q >> 4 is an arithmetic shift (floor(q/16), in [-8, 7], the signed high nibble) and
    l = q & 0xF in [0, 15] (the unsigned low nibble); for uint8 codes both nibbles are unsigned.

    Args:
        codes: int8 or uint8 tensor.

    Returns:
        (h, l), both of the input dtype and shape.

    Raises:
        TypeError: if the codes are not int8 or uint8.
    """
    if codes.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"expected int8 or uint8 codes, got {codes.dtype}")
    return codes >> 4, codes & 0xF


def merge_nibbles(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_nibbles`: 16*h + l as int16."""
    return high.to(torch.int16) * 16 + low.to(torch.int16)


def slice_codes(codes: torch.Tensor, slicing: str = "midpoint") -> torch.Tensor:
    """4-bit level q_lo of each int8 code, on the int8 grid (effective 4-bit scale 16*s).

    - ``truncate``: 16*h (biased by -7.5 LSB_8 on average on spread-out codes);
    - ``midpoint``: 16*h + 8 = (q >> 4) * 16 + 8, levels ±8 ... ±120 for signed codes (default);
    - ``round``: 16*clamp(floor((q + 8) / 16)) with the nibble range of the codes (MatQuant-style
      round-to-nearest, arXiv 2502.06786; needs a signed low plane for the exact split).

    Asymmetric codes with R = 240 (:data:`ASYM_NESTED_RANGE`): the 4-bit lattice is {0, 16, ..., 240}.
    ``round`` is the nearest lattice point, i.e. the group's min/max 4-bit quantizer up to double rounding;
    ``truncate`` and ``round`` are exact on codes 16*k (a group already on a 16-level grid); ``midpoint``
    puts such a group half a 4-bit step (+8 LSB_8) high, and nibble 15 (code 240 only) at 248 > R.

    Args:
        codes: int8 (symmetric) or uint8 (asymmetric) codes.
        slicing: one of :data:`SLICINGS`.

    Returns:
        int16 tensor of the input shape.

    Raises:
        ValueError: on an unknown slicing variant.
    """
    if slicing not in SLICINGS:
        raise ValueError(f"unknown slicing {slicing!r}; choose one of {SLICINGS}")
    high, _ = split_nibbles(codes)
    high = high.to(torch.int16)
    if slicing == "truncate":
        return high * 16
    if slicing == "midpoint":
        return high * 16 + 8
    lo, hi = (-8, 7) if codes.dtype == torch.int8 else (0, 15)
    rounded = torch.div(codes.to(torch.int16) + 8, 16, rounding_mode="floor")
    return torch.clamp(rounded, lo, hi) * 16


def native_int4_rtn(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-nested symmetric int4 reference: s4 = max|W|/7 per row or group, q4 = clamp(round(W/s4), -7, 7).

    Args:
        weight: (O, I) floating weight.
        group_size: inputs per scale, or None for one per output channel.

    Returns:
        (q4 (O, I) int8, s4 (O, G) float32).
    """
    codes, scale = _symmetric_codes(weight.detach().to(torch.float32), 7, group_size)
    return codes.to(torch.int8), scale


def slicing_error(
    weight: torch.Tensor, variant: str, scheme: str = "symmetric", group_size: int | None = None
) -> tuple[float, float]:
    """Relative MSE ||W_hat - W||^2 / ||W||^2 and mean code error of one 4-bit variant.

    Args:
        weight: (O, I) floating weight.
        variant: a slicing in :data:`SLICINGS`, or ``native_int4`` or ``int8``.
        scheme: int8 scheme for the nested variants.
        group_size: inputs per scale (all variants), or None for per-channel.

    Returns:
        (relative MSE, mean of q_lo - q in LSB_8); the mean error is 0.0 for ``native_int4``.

    Raises:
        ValueError: on an unknown variant.
    """
    w = weight.detach().to(torch.float64)
    norm = float((w**2).sum())
    if variant == "native_int4":
        q4, s4 = native_int4_rtn(weight, group_size)
        w_hat = _per_column(s4.double(), q4.shape[1], group_size) * q4.double()  # (O, I)
        return float(((w_hat - w) ** 2).sum()) / norm, 0.0
    quant = quantize_int8(weight, scheme, group_size)
    if variant == "int8":
        lo = quant.codes.to(torch.int16)
    elif variant in SLICINGS:
        lo = slice_codes(quant.codes, variant)
    else:
        raise ValueError(f"unknown variant {variant!r}; choose one of {SLICINGS + ('native_int4', 'int8')}")
    w_hat = quant.dequantize(lo, torch.float64)  # (O, I)
    mean_err = float((lo.double() - quant.codes.double()).mean())
    return float(((w_hat - w) ** 2).sum()) / norm, mean_err


def slicing_error_table(
    weight: torch.Tensor, scheme: str = "symmetric", group_size: int | None = None
) -> dict[str, dict[str, float]]:
    """The table of dual-precision.md §2 for one weight: {variant: {"rel_mse", "mean_error_lsb8"}}."""
    table = {}
    for variant in (*SLICINGS, "native_int4", "int8"):
        mse, mean_err = slicing_error(weight, variant, scheme, group_size)
        table[variant] = {"rel_mse": mse, "mean_error_lsb8": mean_err}
    return table
