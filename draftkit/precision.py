"""The precision policy: bfloat16 only where the device computes it fast, float32 otherwise.

``auto`` is the default dtype wherever draftkit computes (fit's head precision and ``model.target_dtype``,
``select-layers``, ``cache-hidden-states``, ``bench``, ``evaluate``, dual precision). Export dtype is a file
format and keeps its own default.

Why: on a CPU without native bf16 (AVX2 only, no AVX512-BF16 or AMX) oneDNN emulates a bf16 matmul at
~0.3 GFLOP/s against ~12-19 GFLOP/s in float32 (issue 11: 60x slower; a 14 s float32 training step took
199 s in bf16). On AVX512-BF16 cores the same matmul runs ~2x faster in bf16 than in float32.

The decision, once per process and device (cached, logged once with its reason):

1. CUDA: bfloat16 iff ``torch.cuda.is_bf16_supported()`` (native on compute capability >= 8.0).
2. CPU: float32 when oneDNN reports no bf16 support (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``,
   which honours ``ONEDNN_MAX_CPU_ISA``); otherwise a probe of a (128, 576) x (576, 576) matmul, the
   size of one SmolLM2-135M projection on a short batch (~10 ms in float32 on one core), timed in both
   dtypes: bfloat16 iff its time is not above float32's.
3. Any other device: float32.

A dtype set explicitly (recipe or flag) wins; an explicit bf16 on a device the policy would run in float32
logs a warning with the measured slowdown.

Shapes: the probe multiplies (M, K) by (K, N) with M=128, K=N=576.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "DTYPES",
    "PrecisionChoice",
    "as_torch_dtype",
    "auto_precision",
    "choose_precision",
    "default_device",
    "precision_record",
    "probe_bf16_slowdown",
    "resolve_dtype",
    "resolve_trainer_precision",
    "set_threads",
    "synchronize",
]

log = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float32", "float16")
"""Compute dtypes a command accepts; ``auto`` asks the policy."""

PROBE_SHAPE = (128, 576, 576)
"""(M, K, N) of the CPU probe matmul."""


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``auto`` means on one device, and why.

    Attributes:
        device: ``cpu``, ``cuda`` or another torch device type.
        dtype: ``bfloat16`` or ``float32``.
        reason: one line, e.g. ``cpu AVX2 without native bf16 -> float32``.
        bf16_slowdown: probe time of the bf16 matmul / float32 matmul (0.5 = bf16 twice as fast); None when
            not measured (CUDA, or a CPU oneDNN already reports without bf16 and no warning asked for it).
    """

    device: str
    dtype: str
    reason: str
    bf16_slowdown: float | None = None

    @property
    def lightning_precision(self) -> str:
        """Lightning ``trainer.precision`` of this choice: ``bf16-mixed`` or ``32-true``."""
        return "bf16-mixed" if self.dtype == "bfloat16" else "32-true"

    def as_dict(self) -> dict:
        """JSON-ready fields for reports and hparams."""
        return asdict(self)


def default_device() -> str:
    """``cuda`` when a CUDA device is available, else ``cpu``: where commands without a device option run."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str, option: str = "--device") -> str:
    """The device a command runs on: ``auto`` = :func:`default_device`; ``cpu``, ``cuda`` or ``cuda:N`` as given.

    Raises:
        ValueError: naming ``option`` on another value, or on a CUDA device when none is available.
    """
    if device == "auto":
        return default_device()
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"{option} must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{option} {device}: no CUDA device is available here (torch {torch.__version__}); "
                         "use --device cpu or auto")
    return device


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously; a timer read without this measures
    their launch, not their run). A no-op on the CPU and for None."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(threads: int | None, option: str = "--threads") -> None:
    """Set torch's CPU thread count for this process (``torch.set_num_threads``); None keeps torch's default.

    Raises:
        ValueError: naming ``option`` when ``threads`` is not a whole number >= 1 (torch raises a bare
            ``RuntimeError`` on 0 and negative counts).
    """
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{option} must be a whole number >= 1 (CPU threads; leave it out for torch's default, "
                         f"{torch.get_num_threads()} here), got {threads!r}")
    torch.set_num_threads(threads)


def probe_bf16_slowdown(repeats: int = 5, max_seconds: float = 0.3) -> float:
    """Measured CPU time of a bf16 probe matmul divided by its float32 time, on the current torch thread count.

    Measured on one AVX512-BF16 core: 0.43 (bf16 faster); on AVX2 (emulated with ``ATEN_CPU_CAPABILITY=avx2
    ONEDNN_MAX_CPU_ISA=AVX2``): 33. The two dtypes alternate and the best time of each is kept, since a
    shared machine's noise only adds time. Takes ~0.02 s with fast bf16, at most ~``max_seconds`` + 0.2 s
    without.

    Args:
        repeats: timed calls per dtype (at most).
        max_seconds: stop repeating once the timed calls have taken this long.

    Returns:
        float ratio t_bf16 / t_fp32.
    """
    m, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)  # (M, K), (K, N)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    for x, y in pairs.values():
        x @ y  # untimed: thread pool start, oneDNN primitive creation
    best = dict.fromkeys(pairs, float("inf"))
    spent = 0.0
    for _ in range(repeats):
        for dtype, (x, y) in pairs.items():
            t0 = time.perf_counter()
            x @ y
            dt = time.perf_counter() - t0
            best[dtype], spent = min(best[dtype], dt), spent + dt
        if spent > max_seconds:
            break
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def _onednn_bf16() -> bool:
    """oneDNN's own check of native bf16 on this CPU (False when unavailable)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def choose_precision(
    device: str,
    *,
    cuda_bf16: Callable[[], bool] | None = None,
    onednn_bf16: Callable[[], bool] = _onednn_bf16,
    probe: Callable[[], float] = probe_bf16_slowdown,
    capability: Callable[[], str] = torch.backends.cpu.get_cpu_capability,
) -> PrecisionChoice:
    """Decide ``auto`` on ``device`` (uncached; use :func:`auto_precision`). The checks are injectable for tests.

    Args:
        device: torch device type (``cpu``, ``cuda``, ``mps``, ...).
        cuda_bf16: CUDA's bf16 check (default ``torch.cuda.is_bf16_supported``).
        onednn_bf16: oneDNN's CPU bf16 check.
        probe: returns the bf16 / float32 time ratio of a CPU matmul (:func:`probe_bf16_slowdown`).
        capability: ATen's CPU capability name (``AVX2``, ``AVX512``, ...), for the reason only.

    Returns:
        :class:`PrecisionChoice`.
    """
    if device == "cuda":
        ok = (cuda_bf16 or torch.cuda.is_bf16_supported)()
        name = torch.cuda.get_device_name() if cuda_bf16 is None and torch.cuda.is_available() else "cuda device"
        dtype = "bfloat16" if ok else "float32"
        return PrecisionChoice(device, dtype, f"cuda {name} {'with' if ok else 'without'} bf16 -> {dtype}")
    if device != "cpu":
        return PrecisionChoice(device, "float32", f"{device}: bf16 speed unknown -> float32")
    cap = capability()
    if not onednn_bf16():
        return PrecisionChoice(device, "float32", f"cpu {cap} without native bf16 -> float32")
    ratio = probe()
    dtype = "bfloat16" if ratio <= 1.0 else "float32"
    return PrecisionChoice(device, dtype, f"cpu {cap}: bf16 matmul {ratio:.2f}x the float32 time -> {dtype}", ratio)


def auto_precision(device: str = "cpu") -> PrecisionChoice:
    """:func:`choose_precision` on ``device``, decided once per process and logged once with its reason.

    Args:
        device: torch device type, or a device string such as ``cuda:0`` (the index is ignored).
    """
    return _decide(torch.device(device).type)


@functools.cache
def _decide(device: str) -> PrecisionChoice:
    choice = choose_precision(device)
    log.info("precision auto: %s", choice.reason)
    return choice


def _slowdown(choice: PrecisionChoice) -> float:
    """The bf16 / float32 time ratio on the choice's CPU, probing now if it was not measured."""
    return choice.bf16_slowdown if choice.bf16_slowdown is not None else probe_bf16_slowdown()


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu", option: str = "dtype") -> str:
    """The compute dtype name for a requested one: ``auto`` asks the policy; an explicit dtype wins.

    An explicit ``bfloat16`` on a device where ``auto`` would pick float32 logs a warning with the measured
    slowdown (CPU) so a user knows why the run is slow.

    Args:
        dtype: ``auto``, ``bfloat16``, ``float32``, ``float16`` or a torch dtype.
        device: torch device type the computation runs on.
        option: the option's name for messages (e.g. ``model.target_dtype``, ``--dtype``).

    Returns:
        ``bfloat16``, ``float32`` or ``float16``.

    Raises:
        ValueError: on any other dtype, naming ``option``.
    """
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"{option} must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return auto_precision(device).dtype
    if dtype == "bfloat16":
        _warn_if_slow_bf16(device, option, dtype)
    return dtype


@functools.cache
def _warn_if_slow_bf16(device: str, option: str, value: str) -> None:
    """Warn once per option that an explicit bf16 runs slowly on this CPU, with the measured slowdown."""
    choice = auto_precision(device)
    if choice.dtype == "bfloat16" or choice.device != "cpu":
        return
    log.warning(
        "%s=%s asks for bf16, but this CPU computes it slowly (%s): a bf16 matmul took %.1fx the float32 "
        "time here; leave it to auto or set float32", option, value, choice.reason, _slowdown(choice),
    )


def resolve_trainer_precision(precision: str | int | None, device: str = "cpu") -> str | int:
    """Lightning ``trainer.precision`` for a requested one: None (unset) or ``auto`` asks the policy.

    Args:
        precision: a Lightning precision (``bf16-mixed``, ``32-true``, ...), ``auto`` or None.
        device: torch device type the trainer runs on.

    Returns:
        The Lightning precision; explicit values are returned unchanged (a bf16 one on a CPU without fast bf16
        logs the warning of :func:`resolve_dtype`).
    """
    if precision is None or precision == "auto":
        return auto_precision(device).lightning_precision
    if "bf16" in str(precision):
        _warn_if_slow_bf16(device, "trainer.precision", str(precision))
    return precision


def as_torch_dtype(dtype: str | torch.dtype, device: str = "cpu", option: str = "dtype") -> torch.dtype:
    """:func:`resolve_dtype` as a torch dtype; other torch dtypes (``float64``, as a name or a dtype) pass through
    for exact reference computations."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return getattr(torch, resolve_dtype(name, device, option))


def precision_record(requested: str | torch.dtype, device: str = "cpu") -> dict:
    """The ``precision`` entry of a JSON report or hparams: what was asked, what ran, and the policy's choice.

    Args:
        requested: the dtype option as given (``auto`` or explicit) or a Lightning precision.
        device: torch device type the computation ran on.

    Returns:
        ``{"requested": str, "dtype": str, "auto": {device, dtype, reason, bf16_slowdown}}``; ``dtype`` is
        the resolved compute dtype (for a Lightning precision, its name unchanged).
    """
    requested = str(requested).removeprefix("torch.")
    resolved = resolve_dtype(requested, device) if requested in DTYPES else requested
    return {"requested": requested, "dtype": resolved, "auto": auto_precision(device).as_dict()}
