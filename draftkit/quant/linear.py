"""Nested int8/int4 linear layers with a cheap per-step precision switch (dual-precision.md §1-2).

Notable:
- each quantized ``nn.Linear`` is replaced by :class:`NestedInt8Linear`, which holds BOTH integer grids (the
  int8 codes and their 4-bit slice) as tensors of the compute dtype plus one fp32 scale per output channel,
  or per output channel and group of inputs; switching precision flips one attribute, nothing is reloaded
- compute is simulated on exact integer grids: y = (x @ q_sel^T) * s, the scale applied after the matmul;
  per group, y = sum_g (x_g @ q_sel,g^T) * s_g, one integer-grid matmul per group (integers up to 256 in
  magnitude are exact in bf16, fp16 and fp32, so both grids are exact)
- asymmetric codes keep their unsigned values q in [0, R] and a real zero point z per group; the zero term
  is a rank-1 correction, y = sum_g s_g * (x_g @ q_sel,g^T - z_g * sum_j x_gj) = sum_g s_g * x_g @ (q - z)^T,
  with the grid matmul in fp32 (at least) because the two terms cancel
- which modules are quantized is a :class:`QuantConfig`: every ``nn.Linear`` inside the decoder layers by
  default; the LM head stays in 16 bits unless ``quantize_lm_head`` is set (the input embedding is never
  quantized: a forward reads one row of it)

Shapes: B batch, T tokens, I input features, O output channels, G groups of w inputs (G*w >= I).
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from draftkit.quant.int8 import ASYM_NESTED_RANGE, SCHEMES, SLICINGS, num_groups, quantize_int8, slice_codes

__all__ = [
    "PRECISIONS",
    "QuantConfig",
    "NestedInt8Linear",
    "select_linears",
    "quantize_model",
    "nested_linears",
    "set_precision",
    "precision",
]

PRECISIONS = ("high", "low")
"""``high`` = the int8 codes (8 bits), ``low`` = their 4-bit slice."""


@dataclass
class QuantConfig:
    """Which linears are quantized, and how.

    Attributes:
        include: fnmatch patterns over module names (``model.named_modules()``); a matching ``nn.Linear``
            is quantized. The default selects every linear inside the decoder layers (q, k, v, o, gate,
            up, down for Llama-style targets).
        quantize_lm_head: also quantize the output projection (it is read in full every step; keeping it in
            16 bits is the reference default, and it sets rho = a/A, see ``draftkit.quant.bytes``).
        slicing: 4-bit slicing variant, one of ``midpoint`` (default), ``truncate``, ``round``; taken per
            group when ``group_size`` is set.
        scheme: int8 scheme, ``symmetric`` (default) or ``asymmetric`` (codes in [0, ``code_range``] and a
            real zero point per row or group, stored as fp16 and counted by ``draftkit.quant.bytes``).
        code_range: R, the largest asymmetric code (``asymmetric`` only): 240 (default) nests the 4-bit
            levels 16*k in the 8-bit codes, so a group already on a 16-level grid (a dequantized Q4_1 block)
            slices exactly with ``truncate`` or ``round``; 255 is the reference's full range (not nested).
        group_size: inputs per scale (e.g. 32, 64, 128; the last group of a row is shorter when it does not
            divide the input width), or None (default) for one scale per output channel. Each scale is
            stored (and counted by ``draftkit.quant.bytes``) as fp16.
    """

    include: tuple[str, ...] = ("*layers.*",)
    quantize_lm_head: bool = False
    slicing: str = "midpoint"
    scheme: str = "symmetric"
    group_size: int | None = None
    code_range: int = ASYM_NESTED_RANGE

    def __post_init__(self) -> None:
        if isinstance(self.include, str):
            self.include = (self.include,)
        self.include = tuple(self.include)
        if self.slicing not in SLICINGS:
            raise ValueError(f"QuantConfig.slicing: unknown {self.slicing!r}; choose one of {SLICINGS}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"QuantConfig.scheme: unknown {self.scheme!r}; choose one of {SCHEMES}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(
                f"QuantConfig.group_size must be >= 1 (inputs per scale) or None (per channel), got {self.group_size}"
            )
        if not 15 <= self.code_range <= 255:
            raise ValueError(f"QuantConfig.code_range must be in [15, 255] (largest uint8 code), got {self.code_range}")


class NestedInt8Linear(nn.Module):
    """A linear layer on two nested integer grids: int8 codes (``high``) and their 4-bit slice (``low``).

    y = sum_g (x_g @ q_sel,g^T - zero_g * sum_j x_gj) * scale_g + bias, with q_sel = the int8 codes or their
    4-bit slice by ``self.precision`` and g over the G groups of inputs (G = 1: one scale per output channel);
    the zero term is absent for symmetric codes. Both grids are stored as exact integers in the compute
    dtype, as (G, w, O) buffers ``codes_high_t`` and ``codes_low_t`` (inputs zero-padded to G*w); each
    group's matmul output is scaled in fp32 and the groups summed.

    Args:
        codes_high: (O, I) integer-valued tensor, the int8 codes (signed, or unsigned in [0, 255] with
            ``zero``), compute dtype.
        codes_low: (O, I) integer-valued tensor, their 4-bit level on the same grid, compute dtype.
        scale: (O, G) float32 scales, G = ceil(I / group_size) (1 when ``group_size`` is None).
        bias: (O,) or None.
        precision: initial precision, ``high`` or ``low``.
        group_size: inputs per scale, or None for per-channel.
        zero: (O, G) float32 real-valued zero points in code units (asymmetric codes), or None.

    Raises:
        ValueError: on mismatched shapes or an unknown precision.
    """

    def __init__(
        self,
        codes_high: torch.Tensor,
        codes_low: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        precision: str = "high",
        group_size: int | None = None,
        zero: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        groups = num_groups(codes_high.shape[-1], group_size)
        fits = codes_high.shape == codes_low.shape and codes_high.dim() == 2
        fits = fits and scale.shape == (len(codes_high), groups) and (zero is None or zero.shape == scale.shape)
        if not fits:
            zshape = None if zero is None else tuple(zero.shape)
            raise ValueError(
                f"NestedInt8Linear: codes {tuple(codes_high.shape)}/{tuple(codes_low.shape)}, scale "
                f"{tuple(scale.shape)} and zero {zshape} do not fit (O, I) and (O, G) with G = {groups} groups "
                f"of {group_size}"
            )
        self.out_features, self.in_features = codes_high.shape
        self.num_groups = groups
        self.group_width = self.in_features if groups == 1 else group_size  # w; G*w - I zeros pad the last group
        # stored (G, w, O): x_g @ q_t[g] is a contiguous gemv, ~1.6x faster than F.linear at batch 1 on CPU
        self.register_buffer("codes_high_t", self._grouped(codes_high))
        self.register_buffer("codes_low_t", self._grouped(codes_low))
        self.register_buffer("scale", scale.to(torch.float32).t().contiguous())  # (G, O)
        self.register_buffer("zero", None if zero is None else zero.to(torch.float32).t().contiguous())  # (G, O)
        self.register_buffer("bias", bias)
        self.precision = precision

    def _grouped(self, codes: torch.Tensor) -> torch.Tensor:
        """(O, I) -> (G, w, O), zero-padded inputs."""
        padded = F.pad(codes, (0, self.num_groups * self.group_width - self.in_features))  # (O, G*w)
        return padded.t().reshape(self.num_groups, self.group_width, self.out_features).contiguous()

    @property
    def precision(self) -> str:
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in PRECISIONS:
            raise ValueError(f"unknown precision {value!r}; choose one of {PRECISIONS}")
        self._precision = value

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        slicing: str = "midpoint",
        scheme: str = "symmetric",
        dtype: torch.dtype | None = None,
        group_size: int | None = None,
        code_range: int = ASYM_NESTED_RANGE,
    ) -> "NestedInt8Linear":
        """Quantize an ``nn.Linear`` (int8 per channel or per group) and keep both grids.

        Args:
            linear: the layer; its weight (O, I) is read once.
            slicing: 4-bit slicing variant (see ``draftkit.quant.int8.slice_codes``).
            scheme: ``symmetric`` or ``asymmetric``.
            dtype: compute dtype of the code tensors, default the weight's dtype.
            group_size: inputs per scale, or None for one scale per output channel.
            code_range: R, the largest asymmetric code (see ``draftkit.quant.int8.quantize_int8``).
        """
        quant = quantize_int8(linear.weight, scheme, group_size, code_range)
        dtype = dtype or linear.weight.dtype
        high = quant.codes.to(torch.int16).to(dtype)  # (O, I), exact integers
        low = slice_codes(quant.codes, slicing).to(dtype)  # (O, I)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(high, low, quant.scale, bias, group_size=group_size, zero=quant.zero)

    def codes(self, precision: str | None = None) -> torch.Tensor:
        """(O, I) integer grid of ``precision`` (default: the current one), compute dtype."""
        codes_t = self.codes_high_t if (precision or self._precision) == "high" else self.codes_low_t  # (G, w, O)
        return codes_t.reshape(-1, self.out_features)[: self.in_features].t()  # (O, I)

    @property
    def weight(self) -> torch.Tensor:
        """(O, I) dequantized weight of the current precision (for inspection; forward never builds it)."""
        codes = self.codes()  # (O, I)
        scale = self.scale.t().repeat_interleave(self.group_width, dim=1)[:, : self.in_features]  # (O, I)
        centered = codes.float()
        if self.zero is not None:
            centered = centered - self.zero.t().repeat_interleave(self.group_width, dim=1)[:, : self.in_features]
        return (centered * scale).to(codes.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., I) -> (..., O) in the dtype of ``x``."""
        acc = torch.promote_types(x.dtype, torch.float32)
        out_dtype = x.dtype
        if self.zero is not None:
            x = x.to(acc)  # x @ q and z * sum(x) cancel: a 16-bit matmul output would lose the difference
        codes_t = (self.codes_high_t if self._precision == "high" else self.codes_low_t).to(x.dtype)  # (G, w, O)
        if self.num_groups == 1:
            y = torch.matmul(x, codes_t[0]).to(acc)  # (..., O): integer-grid matmul
            if self.zero is not None:
                y = y - x.sum(dim=-1, keepdim=True).to(acc) * self.zero[0]  # (..., O): x @ (q - z)^T
            y = y * self.scale[0]  # then the scale
        else:
            lead = x.shape[:-1]
            xg = F.pad(x, (0, self.num_groups * self.group_width - self.in_features))  # (..., G*w)
            xg = xg.reshape(-1, self.num_groups, self.group_width).transpose(0, 1)  # (G, N, w)
            y = torch.bmm(xg, codes_t).to(acc)  # (G, N, O): one grid matmul per group
            if self.zero is not None:
                y = y - xg.sum(dim=-1, keepdim=True).to(acc) * self.zero[:, None, :]  # (G, N, O): x_g @ (q - z)^T
            y = (y * self.scale[:, None, :]).sum(dim=0).reshape(*lead, self.out_features)  # (..., O)
        if self.bias is not None:
            y = y + self.bias
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        groups = "per-channel" if self.num_groups == 1 else f"groups={self.num_groups}x{self.group_width}"
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        scheme = "symmetric" if self.zero is None else "asymmetric"
        return f"{shape}, {groups}, {scheme}, precision={self._precision}"


def select_linears(model: nn.Module, config: QuantConfig | None = None) -> dict[str, nn.Module]:
    """The modules ``config`` selects: ``nn.Linear`` (or already nested) layers matching ``include``,
    plus the LM head when ``quantize_lm_head`` is set.

    Works on a meta-device model (nothing is read), so byte accounting can use a config alone.

    Returns:
        {module name: module}, in ``named_modules`` order.
    """
    config = config or QuantConfig()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    selected = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, NestedInt8Linear)):
            continue
        if module is head:
            if config.quantize_lm_head:
                selected[name] = module
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.include):
            selected[name] = module
    return selected


def quantize_model(model: nn.Module, config: QuantConfig | None = None) -> dict[str, NestedInt8Linear]:
    """Replace the selected linears of ``model`` in place by :class:`NestedInt8Linear` (precision ``high``).

    A tied LM head, when quantized, stops sharing its weight with the input embedding (which stays float).

    Args:
        model: a torch module, typically a Hugging Face ``*ForCausalLM``.
        config: selection and scheme; default :class:`QuantConfig`.

    Returns:
        {module name: nested layer}.

    Raises:
        ValueError: if nothing is selected (a target with no quantizable linears).
    """
    config = config or QuantConfig()
    selected = select_linears(model, config)
    if not selected:
        raise ValueError(
            f"target {type(model).__name__} has no quantizable linears: no nn.Linear matches include="
            f"{list(config.include)} (quantize_lm_head={config.quantize_lm_head}); pass patterns that match "
            f"its module names, e.g. '*layers.*'"
        )
    out = {}
    for name, module in selected.items():
        nested = module if isinstance(module, NestedInt8Linear) else NestedInt8Linear.from_linear(
            module, config.slicing, config.scheme, group_size=config.group_size, code_range=config.code_range
        )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, nested)
        out[name] = nested
    return out


def nested_linears(model: nn.Module) -> list[NestedInt8Linear]:
    """Every :class:`NestedInt8Linear` in ``model``."""
    return [m for m in model.modules() if isinstance(m, NestedInt8Linear)]


def set_precision(target: nn.Module | Iterable[NestedInt8Linear], value: str) -> None:
    """Switch every nested layer of ``target`` (a model, or an iterable of layers) to ``high`` or ``low``.

    Raises:
        ValueError: on an unknown precision.
    """
    if value not in PRECISIONS:
        raise ValueError(f"unknown precision {value!r}; choose one of {PRECISIONS}")
    layers = nested_linears(target) if isinstance(target, nn.Module) else target
    for layer in layers:
        layer.precision = value


@contextlib.contextmanager
def precision(target: nn.Module | Iterable[NestedInt8Linear], value: str) -> Iterator[None]:
    """Context manager: run the block at ``value`` precision, then restore each layer's previous one."""
    layers = nested_linears(target) if isinstance(target, nn.Module) else list(target)
    before = [layer.precision for layer in layers]
    set_precision(layers, value)
    try:
        yield
    finally:
        for layer, prev in zip(layers, before):
            layer.precision = prev
