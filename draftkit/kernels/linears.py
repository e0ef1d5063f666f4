"""Inference kernels for a loaded target: every ``nn.Linear`` weight packed once for oneDNN on a CPU where
that measured faster than the stock path, the stock path otherwise; CUDA keeps its own kernels.

Why: a CPU decode step or verify is a handful of rows through every linear layer, i.e. memory-bound
matrix-vector work. Stock float32 ``F.linear`` goes to MKL, whose cost on AVX512 cores grows about linearly
with rows for 1-3 rows (SmolLM2's 49152 x 576 LM head on one EPYC AVX512-BF16 core: 11.6 / 23.1 / 35.5 /
23.2 ms for 1 / 2 / 3 / 4 rows); the same weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied by ``torch.ops.mkldnn._linear_pointwise`` (the
kernel Inductor's CPU ``mkldnn_fusion`` pass emits, ``torch/_inductor/fx_passes/mkldnn_fusion.py``) took
9.0 / 9.5 / 7.9 / 6.3 ms, and in bfloat16 6.9 -> 3.6 ms for one row (measured for issue 35, one thread).

The decision, once per process, device and dtype (cached, logged once with its reason, like
:mod:`draftkit.precision`):

1. not a CPU (CUDA or any other device): ``stock`` (its own kernels; nothing is packed);
2. a CPU without oneDNN (or, for bfloat16, without native oneDNN bf16; float16 is never packed): ``stock``;
3. otherwise a probe: a (4096, 576) weight (one SmolLM2-135M MLP projection's size, 9.4 MB in float32, so
   it streams from memory as a real decode step does) times 1 and 3 rows, stock vs packed, best of a few
   alternating repeats on the current torch thread count: ``onednn`` iff the packed time is at most
   ``1 - PACK_MARGIN`` of the stock time (the packed copy costs memory, so a tie keeps stock). Weights under
   ``PACK_MIN_ELEMENTS`` stay stock whatever the probe says (oneDNN's fixed cost per call dominates there).

Sibling projections that read one input (:data:`FUSED_GROUPS`: q/k/v, gate/up) are packed as one weight and
run as one oneDNN call, each member returning its slice (7 calls a Llama layer become 4).

Packed weights have no backward (``_linear_pointwise`` registers no autograd kernel), so packing refuses a
model whose linear weights require grad, and a packed layer runs the stock path whenever autograd would
record it (grad enabled and the input or weight requires grad), under autocast, for another dtype or device,
and after its weight was replaced or changed in place. The packed copy is a second copy of every linear
weight (SmolLM2-135M: 538 MB in float32, 269 MB in bfloat16, its tied 49152 x 576 LM head included);
:meth:`PackedLinears.release` (or leaving the ``with`` block) drops it and restores the stock forward.

The same handle also switches a Hugging Face target's attention from transformers' ``sdpa`` to
:data:`DECODE_ATTENTION` (:mod:`draftkit.kernels.decode_attention`: grouped-query attention without
key/value copies) for every kernel option but ``stock``, on any device; release restores ``sdpa``.

Shapes: M rows (tokens), K in features, N out features.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftkit.kernels.decode_attention import DECODE_ATTENTION, AttentionSwitch, switch_attention

__all__ = [
    "FUSED_GROUPS",
    "KERNELS",
    "KernelChoice",
    "PackedLinears",
    "auto_kernels",
    "check_kernels",
    "choose_kernels",
    "pack_linears",
    "probe_packed_ratio",
]

log = logging.getLogger(__name__)

KERNELS = ("auto", "onednn", "stock")
"""Kernel options: ``auto`` asks the probe; ``onednn`` packs wherever oneDNN can; ``stock`` never packs."""

PROBE_SHAPE = (4096, 576)
"""(N, K) of the probe weight."""

PROBE_ROWS = (1, 3)
"""Row counts M the probe times (their times are summed): a decode step and stock MKL's worst small verify."""

PACK_MARGIN = 0.05
"""Pack only when the packed probe took at most 95 % of the stock time."""

PACK_MIN_ELEMENTS = 2**16
"""Weights with fewer elements stay stock: oneDNN's fixed cost per call (~18 us against ~5 us for ``F.linear``
on one AVX512 core) outweighs the gain (the tiny test target's 8-layer forward took 1.5-1.7x its stock time
packed). SmolLM2-135M's smallest, a 192 x 576 K/V projection, has 110592."""

def check_kernels(kernels: str, options: tuple[str, ...] = KERNELS) -> None:
    """The one check of a ``--kernels`` value.

    Args:
        kernels: the value given.
        options: the values the caller takes (:data:`KERNELS`, or the decoding verbs'
            :data:`~draftkit.kernels.option.DECODE_KERNELS`).

    Raises:
        ValueError: naming ``--kernels`` and its options when ``kernels`` is not one of them.
    """
    if kernels not in options:
        raise ValueError(f"--kernels must be one of {', '.join(options)}, got {kernels!r}")


_ATTR = "_draftkit_packed"
"""Attribute of a packed model holding its :class:`PackedLinears`."""


@dataclass(frozen=True)
class KernelChoice:
    """Which linear kernel runs on one device and dtype, and why.

    Attributes:
        device: torch device type (``cpu``, ``cuda``, ...).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        kernel: ``onednn`` (packed weights) or ``stock`` (``F.linear``).
        reason: one line, e.g. ``cpu AVX512 float32: packed oneDNN linear 0.52x the stock time -> onednn``.
        packed_ratio: probe time packed / stock (0.5 = packed twice as fast); None when not measured.
    """

    device: str
    dtype: str
    kernel: str
    reason: str
    packed_ratio: float | None = None

    def as_dict(self) -> dict:
        """JSON-ready fields for reports."""
        return asdict(self)


def _dtype_name(dtype: str | torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _onednn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., K) x packed (N, K) [+ bias (N,)] -> (..., N) in x's dtype, oneDNN's kernel."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def probe_packed_ratio(dtype: str | torch.dtype = "float32", repeats: int = 5, max_seconds: float = 0.3) -> float:
    """Measured CPU time of the packed oneDNN linear divided by the stock ``F.linear`` time, on the probe.

    The probe multiplies (M, K) rows by the (N, K) = ``PROBE_SHAPE`` weight for each M in ``PROBE_ROWS``;
    the two kernels alternate and the best time of each is kept (a shared machine's noise only adds time).
    Takes ~0.02 s on one AVX512 core.

    Args:
        dtype: ``float32`` or ``bfloat16``.
        repeats: timed passes per kernel (at most).
        max_seconds: stop repeating once the timed passes have taken this long.

    Returns:
        float ratio t_packed / t_stock.
    """
    dtype = getattr(torch, _dtype_name(dtype))
    n, k = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # (N, K)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    rows = [torch.randn(m, k, generator=g).to(dtype) for m in PROBE_ROWS]  # (M, K) each
    kernels = {"stock": lambda x: F.linear(x, weight), "packed": lambda x: _packed_linear(x, packed, None)}
    with torch.no_grad():
        for fn in kernels.values():
            for x in rows:
                fn(x)  # untimed: primitive creation, caches
        best = dict.fromkeys(kernels, float("inf"))
        spent = 0.0
        for _ in range(repeats):
            for name, fn in kernels.items():
                t0 = time.perf_counter()
                for x in rows:
                    fn(x)
                dt = time.perf_counter() - t0
                best[name], spent = min(best[name], dt), spent + dt
            if spent > max_seconds:
                break
    return best["packed"] / max(best["stock"], 1e-9)


def choose_kernels(
    device: str,
    dtype: str | torch.dtype,
    *,
    onednn: Callable[[], bool] = _onednn_available,
    onednn_bf16: Callable[[], bool] = _onednn_bf16,
    probe: Callable[[str], float] = probe_packed_ratio,
    capability: Callable[[], str] = torch.backends.cpu.get_cpu_capability,
) -> KernelChoice:
    """Decide the linear kernel for ``device`` and ``dtype`` (uncached; use :func:`auto_kernels`). The checks
    are injectable for tests.

    Args:
        device: torch device type.
        dtype: compute dtype of the model's linear weights (name or torch dtype).
        onednn: whether this torch has oneDNN and its packed linear op.
        onednn_bf16: oneDNN's native bf16 check (honours ``ONEDNN_MAX_CPU_ISA``).
        probe: dtype name -> packed / stock time ratio (:func:`probe_packed_ratio`).
        capability: ATen's CPU capability name, for the reason only.

    Returns:
        :class:`KernelChoice`.
    """
    dtype = _dtype_name(dtype)
    if device != "cpu":
        return KernelChoice(device, dtype, "stock", f"{device}: keeps its own kernels -> stock")
    cap = capability()
    if dtype not in ("float32", "bfloat16"):
        return KernelChoice(device, dtype, "stock", f"cpu {cap} {dtype}: not packed -> stock")
    if not onednn():
        return KernelChoice(device, dtype, "stock", f"cpu {cap}: torch without oneDNN -> stock")
    if dtype == "bfloat16" and not onednn_bf16():
        return KernelChoice(device, dtype, "stock", f"cpu {cap} without native oneDNN bf16 -> stock")
    ratio = probe(dtype)
    kernel = "onednn" if ratio <= 1 - PACK_MARGIN else "stock"
    return KernelChoice(
        device, dtype, kernel, f"cpu {cap} {dtype}: packed oneDNN linear {ratio:.2f}x the stock time -> {kernel}", ratio
    )


@functools.cache
def _decide(device: str, dtype: str) -> KernelChoice:
    choice = choose_kernels(device, dtype)
    log.info("kernels auto: %s", choice.reason)
    return choice


def auto_kernels(device: str | torch.device, dtype: str | torch.dtype) -> KernelChoice:
    """:func:`choose_kernels`, decided once per process, device type and dtype, and logged once with its reason.

    Args:
        device: torch device or device string (the index is ignored).
        dtype: compute dtype (name or torch dtype).
    """
    return _decide(torch.device(device).type, _dtype_name(dtype))


@dataclass
class PackedLinears:
    """The packed copy of a model's linear weights (a handle; use as a context manager or call :meth:`release`).

    Attributes:
        choice: the kernel decision it follows (``stock``: nothing was packed).
        modules: the ``nn.Linear`` modules whose forward runs the packed kernel.
        fused_groups: groups of sibling linears packed as one weight (:data:`FUSED_GROUPS`).
        packed_bytes: bytes of the packed copy (0 when nothing is packed).
        weight_bytes: bytes of those modules' own weights (what the copy duplicates).
        attention: the switch of the model's attention to
            :data:`~draftkit.kernels.decode_attention.DECODE_ATTENTION` (its own handle,
            :class:`~draftkit.kernels.decode_attention.AttentionSwitch`; inactive when the attention was left as
            it was), released with the packed copy.
    """

    choice: KernelChoice
    modules: list[nn.Linear] = field(default_factory=list)
    fused_groups: int = 0
    packed_bytes: int = 0
    weight_bytes: int = 0
    model: nn.Module | None = field(default=None, repr=False)
    attention: AttentionSwitch = field(default_factory=AttentionSwitch)

    @property
    def active(self) -> bool:
        """Whether packed weights are in use."""
        return bool(self.modules)

    def use_decode_attention(self, model: nn.Module) -> None:
        """Hold :func:`~draftkit.kernels.decode_attention.switch_attention` of ``model`` until :meth:`release`."""
        self.attention.release()
        self.attention = switch_attention(model)

    def release(self) -> None:
        """Drop the packed copy, restore every module's stock forward and the model's attention (idempotent)."""
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules = []
        self.packed_bytes = self.fused_groups = 0
        if self.model is not None and getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)
        self.model = None
        self.attention.release()

    def __enter__(self) -> PackedLinears:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def as_dict(self) -> dict:
        """The report entry: ``{kernel, reason, packed_ratio, packed_linears, packed_bytes, weight_bytes,
        attention}`` (``attention``: :data:`DECODE_ATTENTION` while it replaces the model's, else None)."""
        return {
            "kernel": self.choice.kernel,
            "reason": self.choice.reason,
            "packed_ratio": self.choice.packed_ratio,
            "packed_linears": len(self.modules),
            "fused_groups": self.fused_groups,
            "packed_bytes": self.packed_bytes,
            "weight_bytes": self.weight_bytes,
            "attention": DECODE_ATTENTION if self.attention.active else None,
        }


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears (children of one module, by these names) that read the same input in every transformers
decoder family draftkit targets: packed as one weight, one oneDNN call per group. On SmolLM2-135M (2 AVX512-BF16
threads, one row) fusing them took a layer's q/k/v/gate/up from 4.26 to 3.04 ms in bfloat16 and 6.1 to 5.0 ms in
float32 over the 30 layers (oneDNN's fixed cost per call; 7 calls a layer become 4)."""


def _packed_forwards(modules: list[nn.Linear], packed: torch.Tensor, bias: torch.Tensor | None) -> list[Callable]:
    """Forwards for a group of linears packed as one (out_features stacked in order; a group of one is a plain
    packed linear): each runs ``packed`` while every member's weight and bias are the ones packed (same tensor,
    same version, neither requiring grad), else ``F.linear`` on its own parameters. A single linear adds its
    live bias; a group adds ``bias``, the members' biases concatenated when packing (like the weights, a change
    made through ``.data`` is not seen: replace the parameter or repack).

    In a group, the first member called with an input x computes every member's rows (one oneDNN call) and holds
    them until each sibling has taken its slice (a view of the fused (..., sum N) output) for the same x, then
    drops them, so nothing outlives the group's calls. A member called again, or with another input, or with x
    changed in place (its version counter; inference tensors keep none, so an in-place change under inference
    mode between sibling calls is not seen, which no transformers layer does), recomputes.
    """
    params = [m._parameters for m in modules]  # read on every call: a replaced weight is seen
    packed_params = [(p["weight"], p["bias"]) for p in params]
    versions = [_versions(*wb) for wb in packed_params]
    sizes = [m.out_features for m in modules]
    last: dict = {}  # the group's pending input: {"x", "version", "outs", "left": members still to serve}

    def valid() -> bool:
        return all(p["weight"] is w and p["bias"] is b and not (w.requires_grad or (b is not None and b.requires_grad))
                   and _versions(w, b) == ver for p, (w, b), ver in zip(params, packed_params, versions))

    def forward_of(i: int) -> Callable:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if (not valid() or x.dtype != packed.dtype or not x.is_cpu or x.dim() < 2
                    or (x.requires_grad and torch.is_grad_enabled()) or torch.is_autocast_enabled("cpu")):
                return F.linear(x, params[i]["weight"], params[i]["bias"])
            if len(modules) == 1:
                return _packed_linear(x, packed, params[i]["bias"])
            version = None if x.is_inference() else x._version  # inference tensors keep no version
            if last.get("x") is not x or last["version"] != version or i not in last["left"]:
                last.update(x=x, version=version, outs=_packed_linear(x, packed, bias).split(sizes, -1),
                            left=set(range(len(modules))))
            out = last["outs"][i]
            last["left"].discard(i)
            if not last["left"]:
                last.clear()
            return out

        return forward

    return [forward_of(i) for i in range(len(modules))]


def _versions(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return weight._version, None if bias is None else bias._version


def _linear_groups(model: nn.Module, packable: Callable[[nn.Linear], bool]) -> list[list[nn.Linear]]:
    """The packable linears of ``model`` in groups: each complete :data:`FUSED_GROUPS` set of siblings with one
    in_features and bias layout, every other packable linear alone."""
    groups, grouped = [], set()
    for parent in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if (all(type(m) is nn.Linear and packable(m) for m in members)
                    and len({(m.in_features, m.bias is None) for m in members}) == 1):
                groups.append(members)
                grouped.update(map(id, members))
    singles = [[m] for m in model.modules() if type(m) is nn.Linear and id(m) not in grouped and packable(m)]
    return groups + singles


def pack_linears(model: nn.Module, kernel: str = "auto", min_elements: int | None = None) -> PackedLinears:
    """Pack every ``nn.Linear`` weight of an inference model for oneDNN once, when the kernel choice says so.

    Packing is once per model: a second call returns the first handle while it is active. Module names,
    parameters and ``state_dict`` stay as they are; each packed module gets an instance ``forward``.

    Args:
        model: a module whose linear layers all have frozen weights (``requires_grad_(False)``), e.g. a loaded
            target.
        kernel: ``auto`` (:func:`auto_kernels` on the weights' device and dtype), ``onednn`` (pack on any CPU
            oneDNN supports for that dtype; a no-op off the CPU) or ``stock`` (pack nothing). Every option but
            ``stock`` also switches a transformers model's ``sdpa`` attention to :data:`DECODE_ATTENTION`.
        min_elements: weights with fewer elements stay stock (None: ``PACK_MIN_ELEMENTS``, read at the call).

    Returns:
        :class:`PackedLinears` (inactive when nothing was packed; it may still hold the attention switch, so
        release it in every case).

    Raises:
        ValueError: on another ``kernel``; when a linear weight or bias requires grad (packed weights have no
            backward: freeze the model first); on ``onednn`` for a CPU dtype oneDNN cannot pack here.
    """
    check_kernels(kernel)
    existing = getattr(model, _ATTR, None)
    if existing is not None and existing.active:
        return existing
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, m in linears:
        for pname, p in m.named_parameters():
            if p.requires_grad:
                raise ValueError(
                    f"cannot pack {name or 'linear'}.{pname} for oneDNN: it requires grad and packed weights have no "
                    "backward; pack only a frozen model for inference (model.requires_grad_(False))"
                )
    if not linears:
        return PackedLinears(KernelChoice("cpu", "float32", "stock", "no nn.Linear to pack -> stock"))
    weight = linears[0][1].weight
    device, dtype = weight.device.type, _dtype_name(weight.dtype)
    if kernel == "auto":
        choice = auto_kernels(device, dtype)
    elif kernel == "stock" or device != "cpu":
        choice = KernelChoice(device, dtype, "stock", f"kernels={kernel} on {device} -> stock")
    else:
        checked = choose_kernels(device, dtype, probe=lambda _dtype: 0.0)  # every check but the probe
        if checked.kernel != "onednn":
            raise ValueError(f"kernels=onednn cannot run here ({checked.reason.removesuffix(' -> stock')}); "
                             "use auto or stock")
        choice = KernelChoice(device, dtype, "onednn", f"cpu {torch.backends.cpu.get_cpu_capability()} {dtype}: "
                              "kernels=onednn requested -> onednn")
    handle = PackedLinears(choice)
    if kernel != "stock":
        handle.use_decode_attention(model)
    min_elements = PACK_MIN_ELEMENTS if min_elements is None else min_elements
    if choice.kernel != "onednn":
        return handle

    def packable(m: nn.Linear) -> bool:
        return m.weight.device.type == "cpu" and m.weight.dtype == weight.dtype and m.weight.numel() >= min_elements

    with torch.no_grad():
        for group in _linear_groups(model, packable):
            w = torch.cat([m.weight.detach() for m in group]) if len(group) > 1 else group[0].weight.detach()
            bias = None if group[0].bias is None or len(group) == 1 else torch.cat([m.bias.detach() for m in group])
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            for m, forward in zip(group, _packed_forwards(group, packed, bias)):
                m.forward = forward
            handle.modules += group
            handle.fused_groups += len(group) > 1
            handle.packed_bytes += packed.nbytes + (0 if bias is None else bias.nbytes)
            handle.weight_bytes += w.nbytes
    if not handle.modules:
        return handle
    handle.model = model
    setattr(model, _ATTR, handle)
    log.info("kernels: %d linear weights packed for oneDNN (%.1f MB copy; %s)",
             len(handle.modules), handle.packed_bytes / 1e6, choice.reason)
    return handle
