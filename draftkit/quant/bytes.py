"""Weight bytes read per forward and per generated token (dual-precision.md §3 and §7).

Batch-1 decoding is memory-bound, so each forward reads every weight once; KV-cache and activation bytes
are excluded. Notation (bytes of one forward): A = high precision (8-bit codes), a = low precision (the
high-nibble plane only), a_H = the high-nibble plane of all quantized weights, rho = a / A.

Counting rule per forward:
- a quantized linear: 1 byte per weight at high precision, 0.5 at low precision (plane H), plus its
  scales at ``scale_bytes`` each (fp16 by default): one per output channel, or one per output channel and
  group of ``group_size`` inputs (O * ceil(I / group_size)), and for the asymmetric scheme one zero point
  per scale, also at ``scale_bytes``. One stored scale (and zero point) serves both planes (the 4-bit
  level's scale is 16*s, its zero point the same), and every forward reads them at either precision, so they
  count in A, in a and in the plane-L re-read of cost model ii;
- every other parameter at ``float_bytes`` (16-bit by default), read in full, except the input embedding,
  of which a forward reads one row; a tied LM head that is not quantized is read in full (once).

Cost models of an escalated step, bytes per generated token at escalation rate e:
- ``i``:   a + e*A            (4-bit pass, then a full 8-bit re-run; the headline)
- ``ii``:  a + e*(A - a_H)    (bit-plane re-run reading only plane L and the unquantized weights; a lower bound)
- ``iii``: (1 - e)*a + e*A    (gate decided before the step: the lagged gate)

Verified speculation (k low drafts + one high verify per round): (k*a + A) / E[N], E[N] tokens per round.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from draftkit.quant.int8 import num_groups
from draftkit.quant.linear import NestedInt8Linear, QuantConfig, select_linears

__all__ = [
    "COST_MODELS",
    "WeightBytes",
    "param_bytes",
    "weight_bytes",
    "gated_bytes_per_token",
    "verified_bytes_per_token",
    "expected_tokens_per_round",
    "expected_verified_ratio",
]

COST_MODELS = ("i", "ii", "iii")
"""Cost models of an escalated step (dual-precision.md §3)."""


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes read by one forward.

    Attributes:
        high: A, bytes of a high-precision (8-bit) forward.
        low: a, bytes of a low-precision (4-bit) forward.
        high_plane: a_H, bytes of the high-nibble plane of all quantized weights.
        quantized_params: number of quantized weights.
        other: bytes read at both precisions that are not plane H or L (unquantized weights, scales and
            zero points).
        scales: number of quantization scales (per channel, or per channel and group), inside ``other``.
        zero_points: number of asymmetric zero points (one per scale of an asymmetric layer), inside ``other``.
    """

    high: float
    low: float
    high_plane: float
    quantized_params: int
    other: float
    scales: int = 0
    zero_points: int = 0

    @property
    def rho(self) -> float:
        """a / A."""
        return self.low / self.high

    def to_dict(self) -> dict:
        """The fields plus ``rho``, JSON-ready."""
        return {**asdict(self), "rho": self.rho}


def weight_bytes(
    model: nn.Module, config: QuantConfig | None = None, float_bytes: float = 2.0, scale_bytes: float = 2.0
) -> WeightBytes:
    """Count the weight bytes of one forward of ``model`` under ``config`` (see the module docstring).

    The model may live on the meta device: only shapes are read. It may be already quantized
    (``NestedInt8Linear`` layers count as selected) or not (the ``nn.Linear`` that ``config`` selects count).

    Args:
        model: a Hugging Face ``*ForCausalLM`` (or any module; without ``get_input_embeddings`` every
            parameter is read in full).
        config: module selection, ``group_size`` (scales per row) and ``scheme`` (asymmetric: a zero point per
            scale), default :class:`QuantConfig`; layers already quantized count their own groups and zero
            points.
        float_bytes: bytes per unquantized weight (2 = bf16/fp16).
        scale_bytes: bytes per scale and per zero point (2 = fp16; 0 reproduces the reference's "scales
            negligible").

    Returns:
        :class:`WeightBytes`.

    Raises:
        ValueError: if ``config`` selects no linear.
    """
    config = config or QuantConfig()
    selected = select_linears(model, config)
    if not selected:
        raise ValueError(
            f"target {type(model).__name__} has no quantizable linears for include={list(config.include)}"
        )
    quantized, scales, zeros, biases, seen = 0, 0, 0, 0, set()
    for module in selected.values():
        quantized += module.out_features * module.in_features
        nested = isinstance(module, NestedInt8Linear)
        groups = module.num_groups if nested else num_groups(module.in_features, config.group_size)
        scales += module.out_features * groups
        asymmetric = module.zero is not None if nested else config.scheme == "asymmetric"
        zeros += module.out_features * groups if asymmetric else 0
        biases += 0 if module.bias is None else module.bias.numel()
        seen.update(id(t) for t in module.parameters(recurse=False))
        seen.update(id(t) for t in module.buffers(recurse=False))
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None) if isinstance(head, nn.Linear) else None
    other = (scales + zeros) * scale_bytes + biases * float_bytes
    for param in model.parameters():  # tied parameters appear once
        if id(param) in seen:
            continue
        if embedding is not None and param is embedding.weight and param is not head_weight:
            other += param.shape[-1] * float_bytes  # one row per token
        else:
            other += param.numel() * float_bytes
    return WeightBytes(
        high=quantized * 1.0 + other,
        low=quantized * 0.5 + other,
        high_plane=quantized * 0.5,
        quantized_params=quantized,
        other=other,
        scales=scales,
        zero_points=zeros,
    )


def gated_bytes_per_token(wb: WeightBytes, escalation_rate: float, cost_model: str = "i") -> float:
    """Bytes per generated token of a gated run at escalation rate e under one cost model.

    Args:
        wb: bytes of one forward.
        escalation_rate: e in [0, 1], the fraction of steps re-run (or run) at high precision.
        cost_model: ``i``, ``ii`` or ``iii`` (module docstring).

    Raises:
        ValueError: on an unknown cost model or e outside [0, 1].
    """
    if not 0.0 <= escalation_rate <= 1.0:
        raise ValueError(f"escalation rate must be in [0, 1], got {escalation_rate}")
    e = escalation_rate
    if cost_model == "i":
        return wb.low + e * wb.high
    if cost_model == "ii":
        return wb.low + e * (wb.high - wb.high_plane)
    if cost_model == "iii":
        return (1.0 - e) * wb.low + e * wb.high
    raise ValueError(f"unknown cost model {cost_model!r}; choose one of {COST_MODELS}")


def verified_bytes_per_token(wb: WeightBytes, k: float, tokens_per_round: float) -> float:
    """(k*a + A) / E[N]: bytes per token of verified speculation with k drafts per round."""
    return (k * wb.low + wb.high) / tokens_per_round


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[N] = (1 - alpha^(k+1)) / (1 - alpha) for i.i.d. per-token agreement alpha (bonus token counted)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_verified_ratio(rho: float, alpha: float, k: int) -> float:
    """Verified speculation's bytes relative to all-high: (k*rho + 1)(1 - alpha) / (1 - alpha^(k+1))."""
    return (k * rho + 1.0) / expected_tokens_per_round(alpha, k)


def param_bytes(module: nn.Module, exclude: tuple[str, ...] = ()) -> int:
    """Bytes of ``module``'s parameters as stored (each shared tensor once), skipping names that start with ``exclude``.

    The plain count behind decoding's bytes-read figures (``TargetSession.weight_bytes``, a drafter's
    ``round_bytes``); :func:`weight_bytes` is the quantized model's count at each precision.

    Args:
        module: any module.
        exclude: parameter-name prefixes left out (e.g. ``("embed_tokens.",)``).

    Returns:
        Bytes (numel x element size, summed).
    """
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith(exclude))
