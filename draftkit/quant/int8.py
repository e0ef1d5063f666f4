"""Int8 codes, the bit-plane split q = 16*h + l, and the 4-bit slicing variants (dual-precision.md §1-2).

One stored int8 copy serves two precisions: the 8-bit model uses the code q, the 4-bit model a level built
from the high nibble h alone (effective scale 16*s). Everything here is pure torch on integer tensors.

Notable:
- symmetric per-output-channel int8 is the default; codes use [-127, 127] (-128 unused)
- the asymmetric option stores unsigned codes in [0, 255] with a per-row zero point; its nibbles are unsigned
- slicing variants: ``midpoint`` 16*h + 8 (default), ``truncate`` 16*h, ``round`` 16*clamp(floor((q+8)/16))
- ``native_int4_rtn`` is the non-nested reference (its own absmax/7 scale), used only for the error table

Shapes: O output channels (rows), I input features (columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "SLICINGS",
    "SCHEMES",
    "Int8Weight",
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
"""Int8 quantization schemes, both per output channel."""


@dataclass
class Int8Weight:
    """Per-channel int8 codes of a weight matrix: W_hat = scale * (codes - zero).

    Attributes:
        codes: (O, I) int8 for ``symmetric`` (values in [-127, 127]) or uint8 for ``asymmetric`` ([0, 255]).
        scale: (O,) float32, weight units per code step (LSB_8).
        zero: (O,) int16 zero point for ``asymmetric``, None for ``symmetric``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @property
    def scheme(self) -> str:
        return "symmetric" if self.zero is None else "asymmetric"

    def centered(self, codes: torch.Tensor | None = None) -> torch.Tensor:
        """(O, I) int16 integer grid value (codes - zero) of ``codes`` (default: the int8 codes)."""
        codes = self.codes if codes is None else codes
        out = codes.to(torch.int16)
        return out if self.zero is None else out - self.zero[:, None]  # (O, I)

    def dequantize(self, codes: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(O, I) ``scale * (codes - zero)`` in ``dtype``; ``codes`` defaults to the int8 codes."""
        return (self.scale[:, None].double() * self.centered(codes).double()).to(dtype)  # (O, I)


def quantize_int8(weight: torch.Tensor, scheme: str = "symmetric") -> Int8Weight:
    """Quantize a weight matrix to int8 per output channel (dual-precision.md §1).

    Symmetric: s_o = max_j |W_oj| / 127, q = clamp(round(W / s), -127, 127).
    Asymmetric: s = (max - min) / 255, z = round(-min / s), q = clamp(round(W / s) + z, 0, 255).
    All-zero rows get scale 1 (codes 0), so dequantization stays exact.

    Args:
        weight: (O, I) floating weight.
        scheme: ``symmetric`` or ``asymmetric``.

    Returns:
        :class:`Int8Weight`.

    Raises:
        ValueError: on an unknown scheme or a weight that is not 2-D.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown int8 scheme {scheme!r}; choose one of {SCHEMES}")
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    if scheme == "symmetric":
        scale = w.abs().amax(dim=1) / 127.0  # (O,)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)  # (O, I)
        return Int8Weight(codes, scale)
    lo, hi = w.amin(dim=1), w.amax(dim=1)  # (O,)
    scale = (hi - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)  # (O,)
    codes = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 255).to(torch.uint8)  # (O, I)
    return Int8Weight(codes, scale, zero.to(torch.int16))


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

    - ``truncate``: 16*h (biased by -7.5 LSB_8 on average);
    - ``midpoint``: 16*h + 8 = (q >> 4) * 16 + 8, levels ±8 ... ±120 for signed codes (default);
    - ``round``: 16*clamp(floor((q + 8) / 16)) with the nibble range of the codes (MatQuant-style
      round-to-nearest, arXiv 2502.06786; needs a signed low plane for the exact split).

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


def native_int4_rtn(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-nested symmetric int4 reference: s4 = max|W|/7, q4 = clamp(round(W/s4), -7, 7).

    Args:
        weight: (O, I) floating weight.

    Returns:
        (q4 (O, I) int8, s4 (O,) float32).
    """
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / 7.0  # (O,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(w / scale[:, None]), -7, 7).to(torch.int8), scale


def slicing_error(weight: torch.Tensor, variant: str, scheme: str = "symmetric") -> tuple[float, float]:
    """Relative MSE ||W_hat - W||^2 / ||W||^2 and mean code error of one 4-bit variant.

    Args:
        weight: (O, I) floating weight.
        variant: a slicing in :data:`SLICINGS`, or ``native_int4`` or ``int8``.
        scheme: int8 scheme for the nested variants.

    Returns:
        (relative MSE, mean of q_lo - q in LSB_8); the mean error is 0.0 for ``native_int4``.

    Raises:
        ValueError: on an unknown variant.
    """
    w = weight.detach().to(torch.float64)
    norm = float((w**2).sum())
    if variant == "native_int4":
        q4, s4 = native_int4_rtn(weight)
        w_hat = s4.double()[:, None] * q4.double()  # (O, I)
        return float(((w_hat - w) ** 2).sum()) / norm, 0.0
    quant = quantize_int8(weight, scheme)
    if variant == "int8":
        lo = quant.codes.to(torch.int16)
    elif variant in SLICINGS:
        lo = slice_codes(quant.codes, variant)
    else:
        raise ValueError(f"unknown variant {variant!r}; choose one of {SLICINGS + ('native_int4', 'int8')}")
    w_hat = quant.dequantize(lo, torch.float64)  # (O, I)
    mean_err = float((lo.double() - quant.codes.double()).mean())
    return float(((w_hat - w) ** 2).sum()) / norm, mean_err


def slicing_error_table(weight: torch.Tensor, scheme: str = "symmetric") -> dict[str, dict[str, float]]:
    """The table of dual-precision.md §2 for one weight: {variant: {"rel_mse", "mean_error_lsb8"}}."""
    table = {}
    for variant in (*SLICINGS, "native_int4", "int8"):
        mse, mean_err = slicing_error(weight, variant, scheme)
        table[variant] = {"rel_mse": mse, "mean_error_lsb8": mean_err}
    return table
