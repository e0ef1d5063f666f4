"""``TargetHandle``: the frozen target of one training run, owned in one place.

The training module, the hidden-state cache writer (``data.hidden_states_cache: auto`` and
``cache-hidden-states``) and the callbacks that read the target (``LayerSelection``, ``AcceptanceLengthMonitor``)
all reach the full target through the module's handle (``Eagle3Module.target_handle``, behind
``load_target_model``/``release_target_model``): it resolves ``target_dtype: auto`` for the trainer's device,
loads the model once (sharded across the ranks under ``trainer.strategy fsdp_target``) and drops it when only
the LM head is needed.

Shapes: none (loading).
"""

from __future__ import annotations

from draftkit.precision import DTYPES, default_device, resolve_dtype

__all__ = ["TargetHandle"]


class TargetHandle:
    """The frozen target a training run shares: its reference, its dtype and, once loaded, the model.

    Args:
        ref: target reference (local dir, hub id, ``pypi:...`` or a ``.gguf`` file; ``model.target``).
        dtype: ``auto`` (resolved for the trainer's device by :meth:`resolve_dtype`), ``bfloat16``, ``float32``
            or ``float16`` (``model.target_dtype``).

    Raises:
        ValueError: on another dtype, naming ``model.target_dtype``.
    """

    def __init__(self, ref: str, dtype: str = "auto") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"model.target_dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.ref = ref
        self.dtype = dtype
        self._model = None  # (HF model, tokenizer) once loaded

    @property
    def loaded(self) -> bool:
        """Whether the full target is held (between :meth:`load` and :meth:`release`)."""
        return self._model is not None

    def resolve_dtype(self, trainer=None) -> str:
        """Resolve ``auto`` for the trainer's device (no trainer: the default device), in place; return the dtype
        name (``bfloat16``, ``float32`` or ``float16``)."""
        device = trainer.strategy.root_device.type if trainer is not None else default_device()
        self.dtype = resolve_dtype(self.dtype, device, "model.target_dtype")
        return self.dtype

    def sharded(self, trainer=None) -> bool:
        """Whether the trainer's strategy shards the target across the ranks (``fsdp_target``): each rank then
        holds a shard, and a forward needs every rank."""
        from draftkit.target.sharding import target_mesh

        return target_mesh(trainer) is not None

    def load(self, trainer=None):
        """(HF model, tokenizer) of the frozen target in the resolved dtype, loaded once; under ``trainer.strategy
        fsdp_target`` sharded across the ranks (``draftkit.target.sharding``), so every rank must call it."""
        if self._model is None:
            from draftkit.target.frozen import load_target
            from draftkit.target.sharding import load_sharded_target, target_mesh

            mesh = target_mesh(trainer)  # trainer.strategy fsdp_target: each rank loads only its shard
            dtype = self.resolve_dtype(trainer)
            self._model = (load_target(self.ref, dtype) if mesh is None else
                           load_sharded_target(self.ref, dtype, mesh, trainer.strategy.root_device))
        return self._model

    def training_target(self, aux_layer_ids: list[int] | None, cache=None, trainer=None):
        """What the training loss reads of the target on ``aux_layer_ids`` (HF ``hidden_states`` indices; None =
        the default rule): online the full model as a ``FrozenTarget`` (:meth:`load`); offline (a hidden-state
        cache) only its config, input embedding and LM head (``TargetLMHead``), checked against the cache.

        Args:
            aux_layer_ids: the aux layers the head reads.
            cache: the datamodule's ``HiddenStateCache``, or None (online).
            trainer: the Lightning trainer (device, sharding), or None.

        Raises:
            ValueError: when the cache was built for another target, target config, target dtype or aux layers
                (``HiddenStateCache.check`` names the field).
        """
        dtype = self.resolve_dtype(trainer)
        if cache is None:
            from draftkit.target.frozen import FrozenTarget

            return FrozenTarget(self.load(trainer)[0], aux_layer_ids)
        from draftkit.target.frozen import config_fingerprint
        from draftkit.target.lm_head import load_target_lm_head

        lm_head = load_target_lm_head(self.ref, dtype, aux_layer_ids)
        cache.check({"target": self.ref, "target_config": config_fingerprint(lm_head.config), "target_dtype": dtype,
                     "aux_layer_ids": list(lm_head.aux_layer_ids)})
        return lm_head

    def release(self) -> None:
        """Drop the full target :meth:`load` holds (after the offline cache is written, training needs only its LM
        head: ~16 GB per GPU freed for an 8B bf16 target); a later :meth:`load` loads it again."""
        self._model = None
