"""The ``--kernels`` option of every verb that takes it (``evaluate``, ``bench decode``, ``evaluate-dual-precision``,
``generate``): one check of its value and one handle that applies the choice to a loaded target (and a draft head)
and releases it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from draftkit.kernels.compile import CompiledTarget, compile_target
from draftkit.kernels.linears import KERNELS, PackedLinears, check_kernels, pack_linears
from draftkit.target.frozen import FrozenTarget

__all__ = ["DECODE_KERNELS", "Kernels", "use_kernels"]

DECODE_KERNELS = KERNELS + ("compiled",)
"""Kernel options of the decoding commands (``evaluate``, ``bench decode``): :data:`KERNELS` plus ``compiled``
(:func:`~draftkit.kernels.compile.compile_target`; never chosen by ``auto``)."""


@dataclass
class Kernels:
    """The kernels one ``--kernels`` choice put on a target and a draft head (a handle: use it as a context
    manager or call :meth:`release`).

    Attributes:
        target: the target's handle: :class:`~draftkit.kernels.linears.PackedLinears` (which also holds the
            switch to decode attention) or :class:`~draftkit.kernels.compile.CompiledTarget`.
        head: the draft head's :class:`~draftkit.kernels.linears.PackedLinears`, or None without a head.
    """

    target: PackedLinears | CompiledTarget
    head: PackedLinears | None = None

    def release(self) -> None:
        """Back to the stock kernels and attention on both (idempotent)."""
        self.target.release()
        if self.head is not None:
            self.head.release()

    def __enter__(self) -> Kernels:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def use_kernels(kernels: str, target: nn.Module, head: nn.Module | None = None,
                options: tuple[str, ...] = DECODE_KERNELS) -> Kernels:
    """Apply a ``--kernels`` choice to a loaded target and, optionally, a draft head, each by its own device and
    dtype (the head is frozen first: ``requires_grad_(False)``): :func:`~draftkit.kernels.linears.pack_linears`
    over both, or with ``compiled`` :func:`~draftkit.kernels.compile.compile_target` for the target and the
    ``auto`` packing for the head.

    A packed head costs 0.68-0.87x the eager draft round on an AVX512 CPU; ``torch.compile`` of the head step
    saved at most 5 % there, so the head is never compiled (benchmarks/README.md, issue 35).

    Args:
        kernels: the option's value.
        target: a :class:`~draftkit.target.frozen.FrozenTarget` (its ``model`` is packed), or for the options in
            :data:`KERNELS` the transformers model itself.
        head: the draft head, or None.
        options: the values the verb takes: :data:`DECODE_KERNELS` (decoding) or :data:`KERNELS`.

    Returns:
        :class:`Kernels`; release it when decoding ends (``with use_kernels(...) as kernels:``).

    Raises:
        ValueError: on a value outside ``options`` (:func:`~draftkit.kernels.linears.check_kernels`); as
            :func:`~draftkit.kernels.linears.pack_linears` and :func:`~draftkit.kernels.compile.compile_target`
            (a target weight that requires grad).
    """
    check_kernels(kernels, options)
    if head is not None:
        head = head.requires_grad_(False)
    if kernels == "compiled":
        handle = compile_target(target)
        return Kernels(handle, None if head is None else pack_linears(head, "auto"))
    handle = pack_linears(target.model if isinstance(target, FrozenTarget) else target, kernels)
    return Kernels(handle, None if head is None else pack_linears(head, kernels))
