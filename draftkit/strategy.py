"""Which Lightning strategies train a draft head, checked before any model is loaded.

draftkit trains one small head (fp32 master weights, bf16-mixed autocast on GPUs) next to a large frozen target
that only runs forward (bf16). The strategy that fits this is data parallelism with the target replicated:

- works: ``auto``, ``single_device``, ``ddp`` and its variants (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``,
  ``*_find_unused_parameters_*``) or any ``DDPStrategy`` / ``SingleDeviceStrategy`` subclass. DDP all-reduces only
  the head's gradients; 2-process CPU runs (gloo) equal 1-process runs with the same global batch
  (``tests/distributed/test_ddp.py``).
- refused: FSDP. Lightning's ``FSDPStrategy`` wraps the whole LightningModule as one flat-parameter unit: the bf16
  target and the fp32 head in one unit fail at set-up (torch FSDP ``ValueError: Must flatten tensors with uniform
  dtype but got torch.bfloat16 and torch.float32``), and with one dtype that unit would all-gather the whole target
  every step, where DDP keeps a resident copy on each GPU. Under FSDP, Muon receives 1-D flat shards and raises
  ``Muon only supports 2D parameters``.
- refused: DeepSpeed (never run with draftkit; its ZeRO stages partition parameters / optimizer state into flat
  shards, which Muon cannot use either), model-parallel and XLA strategies (never run), and strategy classes that
  are none of the above.

Memory per GPU under DDP for Llama-3.1-8B at 2,048 tokens (issue 32's estimate, activations measured on CPU, the
rest arithmetic): ~40-46 GB.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["check_strategy"]

_WORKING = (
    "use trainer.strategy ddp (the frozen target replicated in bf16 on every device, the head trained in fp32 "
    "master weights under bf16-mixed autocast, only its gradients all-reduced; recipes/llama3.1-8b-eagle3-8gpu.yaml "
    "does this)"
)
_MUON = (
    "; model.optim.optimizer muon also needs each hidden matrix whole (its Newton-Schulz step orthogonalises 2-D "
    "matrices; a sharded strategy hands it 1-D flat shards: 'Muon only supports 2D parameters')"
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
    if isinstance(strategy, str):
        return strategy, StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    class_path = _field(strategy, "class_path")
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
            why it does not train a draft head, and the fix (``trainer.strategy ddp``); with Muon under a sharded
            strategy the message says why Muon cannot run there either.
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
            "FSDP wraps the whole module as one flat-parameter unit, so the frozen bf16 target and the fp32 head "
            "fail to flatten together ('Must flatten tensors with uniform dtype'), and in one dtype it would "
            "all-gather the whole target every step"
        )
    elif issubclass(cls, DeepSpeedStrategy):
        why = "DeepSpeed has never been run with draftkit (its ZeRO stages partition the head into flat shards)"
    elif issubclass(cls, ModelParallelStrategy):
        why = "model parallelism needs a configure_model sharding plan that the draft head does not define"
    elif issubclass(cls, (XLAStrategy, SingleDeviceXLAStrategy)):
        why = "XLA devices have never been run with draftkit"
    elif issubclass(cls, (DDPStrategy, SingleDeviceStrategy)):
        return
    else:
        why = f"{cls.__module__}.{cls.__qualname__} is not a DDP or single-device strategy, the ones draftkit trains with"
    raise ValueError(
        f"trainer.strategy {name}: refused before loading the target: {why}; {_WORKING}"
        + (_MUON if muon and issubclass(cls, sharded) else "")
    )
