"""The decoding target's decoder stack compiled by ``torch.compile`` (the ``compiled`` kernel option): a handle
that holds the compiled forward and the LM head's packed copy, released together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from draftkit.kernels.linears import KernelChoice, PackedLinears, _dtype_name, pack_linears

__all__ = ["CompiledTarget", "compile_target"]

log = logging.getLogger(__name__)


@dataclass
class CompiledTarget:
    """A target whose decoder stack runs ``torch.compile``'d for decoding (a handle, like :class:`PackedLinears`).

    Attributes:
        choice: the kernel record (``kernel`` = ``compiled``).
        lm_head: the target's LM head packed by the ``auto`` decision (it runs outside the compiled graph); the
            handle also holds the target's switch to :data:`~draftkit.kernels.decode_attention.DECODE_ATTENTION`.
        compile_s: wall seconds the warm-up compile took (every graph decoding uses: prefill, one row, verify,
            tree verify).
        graphs: graphs compiled in the warm-up.
    """

    choice: KernelChoice
    lm_head: PackedLinears
    compile_s: float = 0.0
    graphs: int = 0
    target: nn.Module | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        """Whether the compiled forward is in use."""
        return self.target is not None

    def release(self) -> None:
        """Back to the eager forward; drops the compiled graphs (``torch._dynamo.reset``, which also frees the
        frozen weight copies Inductor holds) and the LM head's packed copy (idempotent)."""
        if self.target is not None:
            self.target.compiled_forward = None
            self.target = None
            torch._dynamo.reset()
        self.lm_head.release()

    def __enter__(self) -> CompiledTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def as_dict(self) -> dict:
        """The report entry: :meth:`PackedLinears.as_dict`'s keys (of the packed LM head) plus ``compile_s`` and
        ``graphs``, ``kernel`` = ``compiled``."""
        return {**self.lm_head.as_dict(), "kernel": "compiled", "reason": self.choice.reason,
                "compile_s": self.compile_s, "graphs": self.graphs}


def compile_target(target: nn.Module) -> CompiledTarget:
    """Decode with the target's decoder stack compiled by ``torch.compile`` (Inductor), then warm it up.

    The base model's ``forward`` is compiled with dynamic shapes (rows and cache length symbolic, one row
    specialised) and, on a CPU, Inductor's ``freezing`` (the weights become constants that Inductor packs for
    oneDNN itself: a second copy of the decoder weights while it is on). :class:`~draftkit.target.frozen.FrozenTarget`
    then runs it in every forward under inference mode (decoding's :class:`~draftkit.target.session.TargetSession`
    runs there), reading the aux states from the returned ``hidden_states`` (the same tensors its layer hooks
    capture; hooks would recompile); any other forward (training's, under ``no_grad``) keeps the eager path, so
    training never runs it. The LM head stays eager, packed by the ``auto`` decision (:func:`pack_linears`).

    The warm-up decodes a few random tokens through every shape class decoding uses (a prefill on an empty
    cache, one row, several rows, several rows with tree position ids and a 4-D mask), so that compiling
    happens here, logged with its time, and not inside a timed run. The graphs are those of torch's thread
    count at this call (Dynamo guards on it): set ``torch.set_num_threads`` first, as ``evaluate`` and
    ``bench decode`` do; a later change recompiles every shape class. On SmolLM2-135M (2 AVX512 cores) the
    compiled step took 0.69-0.80x the packed eager one on one loaded thread, but on two idle threads plain
    decoding ran at 0.83x (bf16) / 0.62x (float32) the packed eager speed, and compiling took 2.5-10 minutes per
    process and dtype (benchmarks/README.md, issue 35): measure before using it; ``auto`` never picks it.

    Args:
        target: a :class:`~draftkit.target.frozen.FrozenTarget`.

    Returns:
        :class:`CompiledTarget` (release it when decoding ends).

    Raises:
        ValueError: when a target parameter requires grad (the frozen constants would go stale under training).
    """
    from draftkit.target.session import TargetSession

    trainable = next((name for name, p in target.model.named_parameters() if p.requires_grad), None)
    if trainable is not None:
        raise ValueError(f"kernels=compiled: target parameter {trainable} requires grad; compile only a frozen "
                         "target for inference (model.requires_grad_(False))")
    weight = target.input_embeddings()
    device, dtype = weight.device.type, _dtype_name(weight.dtype)
    lm_head = pack_linears(target.model.get_output_embeddings(), "auto")
    lm_head.use_decode_attention(target.model)
    options = {"freezing": True} if device == "cpu" else {}
    target.compiled_forward = torch.compile(target.base.forward, dynamic=True, options=options)
    choice = KernelChoice(device, dtype, "compiled", f"{device} {dtype}: kernels=compiled requested -> the decoder "
                          f"stack compiled by torch.compile{' (freezing)' if options else ''}, LM head "
                          f"{lm_head.choice.kernel}")
    handle = CompiledTarget(choice, lm_head, target=target)
    log.info("kernels compiled: compiling the target's decoder forward for decoding (once per process and dtype; "
             "minutes on a CPU) ...")
    graphs0 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    session = TargetSession(target)
    dev = session.device
    ids = torch.arange(12, device=dev) % min(int(target.vocab_size), 1000)
    # a 3-node tree after 10 cached positions: root, its child, a sibling of the child
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=dev)
    tree_mask = torch.cat([torch.ones(3, 10, dtype=torch.bool, device=dev), tree], 1)  # (3, 10+3)
    # decoding's order: prefill, plain steps, a chain verify and its rollback, a tree verify and its accepted
    # path; the rollbacks leave the cache as decoding does (contiguous inference tensors, TargetSession.crop/keep)
    for what, run in (
        ("prefill", lambda: session.forward(ids[:8], logits_to_keep=1)),
        ("1 row", lambda: session.forward(ids[8:9])),
        ("3 rows", lambda: (session.forward(ids[9:12]), session.crop(10))),
        ("tree verify", lambda: (session.forward(
            ids[:3], position_ids=torch.tensor([10, 11, 11], device=dev), attn_mask=tree_mask),
            session.keep(torch.tensor([*range(10), 10, 12], device=dev)), session.forward(ids[3:6]))),
    ):
        t = time.perf_counter()
        run()
        log.info("kernels compiled: %s graph ready (%.1f s)", what, time.perf_counter() - t)
    handle.compile_s = time.perf_counter() - t0
    handle.graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs0
    log.info("kernels compiled: %d graphs in %.1f s (%s)", handle.graphs, handle.compile_s, choice.reason)
    return handle
