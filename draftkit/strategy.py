"""Which Lightning strategies train a draft head, checked before any model is loaded.

draftkit trains one small head (fp32 master weights, bf16-mixed autocast on GPUs) next to a large frozen target
that only runs forward (bf16). Two forms fit this:

- works: data parallelism with the target replicated: ``auto``, ``single_device``, ``ddp`` and its variants
  (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``, ``*_find_unused_parameters_*``) or any ``DDPStrategy`` /
  ``SingleDeviceStrategy`` subclass. DDP all-reduces only the head's gradients; 2-process CPU runs (gloo) equal
  1-process runs with the same global batch (``tests/distributed/test_ddp.py``).
- works: ``fsdp_target`` (:class:`ShardedTargetStrategy`), for a target larger than one GPU: the frozen target
  sharded across the ranks with FSDP2, one unit per decoder layer (``draftkit.target.sharding``), each layer
  gathered for its forward and freed after; the head replicated with DDP as above, so Muon sees whole matrices
  and checkpoints are the same single file as under DDP (the head only; the target is never saved). 2-process CPU
  runs equal 1-process runs (``tests/distributed/test_ddp.py``). Refused with it: the
  ``LayerSelection`` callback (it runs the target on rank 0 alone; set ``model.aux_layer_ids`` instead).
- refused: Lightning's ``FSDPStrategy`` (FSDP1). It wraps the whole LightningModule as one flat-parameter unit:
  the bf16 target and the fp32 head in one unit fail at set-up (torch FSDP ``ValueError: Must flatten tensors
  with uniform dtype but got torch.bfloat16 and torch.float32``), in one dtype that unit would all-gather the
  whole target every step, and Muon would receive 1-D flat shards (``Muon only supports 2D parameters``).
- refused: ``ModelParallelStrategy`` (it needs a ``configure_model`` plan for the head and gathers the whole
  target into full-state checkpoints), DeepSpeed (never run with draftkit; its ZeRO stages partition the head
  into flat shards, which Muon cannot use either), XLA strategies (never run), and strategy classes that are
  none of the above.

Memory per GPU (``draftkit.models.memory.estimate_memory``, printed by ``fit`` before anything loads): under
DDP for Llama-3.1-8B at 2,048 tokens ~40 GB (issue 32: ~40-46 GB); a Llama-3.3-70B target (141 GB in bf16)
fits no single GPU, and ``fit`` refuses DDP for it and names ``fsdp_target``.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

__all__ = ["SHARDED_TARGET", "ShardedTargetStrategy", "check_strategy"]

SHARDED_TARGET = "fsdp_target"
"""The registered name of :class:`ShardedTargetStrategy` (``trainer.strategy: fsdp_target``)."""


class ShardedTargetStrategy(DDPStrategy):
    """DDP for the draft head beside a frozen target sharded across the same ranks with FSDP2.

    The strategy builds a 1-D device mesh over all ranks (:attr:`target_mesh`); ``Eagle3Module`` loads its target
    sharded over it (``draftkit.target.sharding.load_sharded_target``: FSDP2 ``fully_shard`` per decoder layer, the
    base model's remainder and the LM head, each rank reading only its rows). DDP then wraps the module with every
    parameter and buffer of the FSDP2 units left out (they are sharded and frozen: broadcasting rank 0's shards
    would overwrite the others'), so it all-reduces the head's gradients only, as plain ``ddp`` does. On one
    device it degenerates to one shard. Arguments are ``DDPStrategy``'s.
    """

    strategy_name = SHARDED_TARGET

    def setup_environment(self) -> None:
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        self.target_mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        """The mesh the target is sharded over (all ranks, data parallel)."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        sharded = [
            f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() if isinstance(module, FSDPModule)
            for name, _ in (*module.named_parameters(), *module.named_buffers())
        ]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sharded)
        return super()._setup_model(model)


if SHARDED_TARGET not in StrategyRegistry:
    StrategyRegistry.register(
        SHARDED_TARGET, ShardedTargetStrategy,
        description="draftkit: the frozen target sharded per decoder layer with FSDP2, the head replicated with DDP",
    )

_WORKING = (
    "use trainer.strategy ddp (the frozen target replicated in bf16 on every device, the head trained in fp32 "
    "master weights under bf16-mixed autocast, only its gradients all-reduced; recipes/llama3.1-8b-eagle3-8gpu.yaml "
    "does this) or, for a target larger than one GPU, trainer.strategy fsdp_target (the frozen target sharded per "
    "decoder layer with FSDP2 across the ranks, the head replicated with DDP; recipes/llama3.3-70b-eagle3-8gpu.yaml)"
)
_MUON = (
    "; model.optim.optimizer muon also needs each hidden matrix whole (its Newton-Schulz step orthogonalises 2-D "
    "matrices; a sharded strategy hands it 1-D flat shards: 'Muon only supports 2D parameters'), which both "
    "strategies above give it"
)


def _field(node: Any, name: str) -> Any:
    """``node.name`` for a jsonargparse Namespace, a dataclass or a dict; None when absent."""
    if isinstance(node, dict):
        return node.get(name)
    return getattr(node, name, None)


def _strategy_class(strategy: Any) -> tuple[str, type | None]:
    """(the name as written, the Strategy class) of a recipe's ``trainer.strategy``: a registered name
    (``ddp``), a ``{class_path, init_args}`` node, or a Strategy instance. The class is None for ``auto``/unset
    and for a name or class path Lightning cannot resolve (Lightning then reports it itself)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if strategy is None or strategy == "auto":
        return "auto", None
    if isinstance(strategy, str) and (strategy in StrategyRegistry or "." not in strategy):
        return strategy, StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    class_path = strategy if isinstance(strategy, str) else _field(strategy, "class_path")  # a class path
    if isinstance(class_path, str):
        module, _, name = class_path.rpartition(".")
        try:
            return class_path, getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return class_path, None
    return type(strategy).__name__, type(strategy)


def check_strategy(config: Any) -> None:
    """Refuse a strategy (and optimizer) combination that cannot train, before any model is loaded.

    Args:
        config: the parsed recipe of ``fit``/``validate``/``bench train`` (jsonargparse Namespace with ``trainer``
            and ``model``; ``load_recipe`` returns one). Reads ``trainer.strategy`` and
            ``model.optim.optimizer``.

    Raises:
        ValueError: for FSDP, DeepSpeed, model-parallel, XLA or an unknown strategy class, naming the strategy,
            why it does not train a draft head, and the fix (``trainer.strategy ddp``, or ``fsdp_target`` for a
            target larger than one GPU); with Muon under a sharded strategy the message says why Muon cannot run
            there either and that both fixes keep its matrices whole.
    """
    from lightning.pytorch.strategies import (
        DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy,
        SingleDeviceXLAStrategy, XLAStrategy,
    )

    name, cls = _strategy_class(_field(_field(config, "trainer"), "strategy"))
    if cls is None:
        return
    muon = _field(_field(_field(config, "model"), "optim"), "optimizer") == "muon"
    sharded = (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)
    if issubclass(cls, FSDPStrategy):
        why = (
            "Lightning's FSDP (FSDP1) wraps the whole module as one flat-parameter unit, so the frozen bf16 target "
            "and the fp32 head fail to flatten together ('Must flatten tensors with uniform dtype'), and in one "
            "dtype it would all-gather the whole target every step"
        )
    elif issubclass(cls, DeepSpeedStrategy):
        why = "DeepSpeed has never been run with draftkit (its ZeRO stages partition the head into flat shards)"
    elif issubclass(cls, ModelParallelStrategy):
        why = (
            "ModelParallelStrategy needs a configure_model plan for the head (none is defined: the head is small and "
            "replicated) and would gather the whole target into every full-state checkpoint"
        )
    elif issubclass(cls, (XLAStrategy, SingleDeviceXLAStrategy)):
        why = "XLA devices have never been run with draftkit"
    elif issubclass(cls, ShardedTargetStrategy):
        callbacks = _field(_field(config, "trainer"), "callbacks") or []
        named = [str(_field(cb, "class_path") or type(cb).__name__) for cb in callbacks]
        if not any(name.endswith("LayerSelection") for name in named):
            return
        why = (
            "the LayerSelection callback runs the target on rank 0 alone, while each forward of a sharded target "
            "gathers its layers from every rank (rank 0 would wait forever)"
        )
        raise ValueError(
            f"trainer.strategy {name}: refused before loading the target: {why}; choose the aux layers first "
            "(LayerSelection or `python -m draftkit select-layers` under trainer.strategy ddp, on a target that "
            "fits one GPU, or from its report) and set model.aux_layer_ids, or drop the callback"
        )
    elif issubclass(cls, (DDPStrategy, SingleDeviceStrategy)):
        return
    else:
        why = f"{cls.__module__}.{cls.__qualname__} is not a DDP or single-device strategy, the ones draftkit trains with"
    raise ValueError(
        f"trainer.strategy {name}: refused before loading the target: {why}; {_WORKING}"
        + (_MUON if muon and issubclass(cls, sharded) else "")
    )
