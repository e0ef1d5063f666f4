"""ExportOnCheckpoint: write serving-engine export directories when ``fit`` ends.

The callback saves the trained head through ``trainer.save_checkpoint`` (so the LightningModule's own
``on_save_checkpoint`` adds the ``draftkit`` metadata) or picks the best/last checkpoint of the
``ModelCheckpoint`` callback, then runs ``draftkit.export.export_checkpoint`` once per engine into
``<dirpath>/{vllm,vllm-speculators,sglang,trtllm}``.

Shapes: none (files only).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from draftkit.export import ENGINES, EXPORT_DTYPES, export_checkpoint

__all__ = ["ExportOnCheckpoint"]

log = logging.getLogger(__name__)

def engine_dir(engine: str) -> str:
    """Sub-directory of an engine under ``dirpath`` (the ``checkpoints/<run>/export/`` layout): the engine
    module's ``EXPORT_DIR``, else its name."""
    return getattr(ENGINES[engine], "EXPORT_DIR", engine)


class ExportOnCheckpoint(Callback):
    """Exports the trained head for serving engines at the end of ``fit``.

    Args:
        engines: engine layouts to write, names of the registry ``draftkit.export.ENGINES`` (``vllm``,
            ``speculators``, ``sglang``, ``trtllm``, and any registered engine).
        dirpath: export root; None means ``<trainer.default_root_dir>/export``. Each engine gets a
            sub-directory (``vllm``, ``vllm-speculators``, ``sglang``, ``trtllm``).
        checkpoint: which weights to export: ``final`` (the weights at the end of fit), ``best`` or ``last``
            (the ``ModelCheckpoint`` files; falls back to ``final`` when there is none).
        dtype: weight dtype of the export (``bfloat16`` default).
        num_speculative_tokens: k written into the speculators/TensorRT-LLM configs and launch lines.
        overwrite: replace existing export directories (a re-run of the same recipe).

    Raises:
        ValueError: on an unknown engine, dtype or checkpoint choice, an empty engine list, or k < 1; at the start
            of fit (:meth:`on_fit_start`), for an engine that cannot take this run's head.
    """

    def __init__(
        self,
        engines: list[str] | tuple[str, ...] = ("vllm",),
        dirpath: str | None = None,
        checkpoint: str = "final",
        dtype: str = "bfloat16",
        num_speculative_tokens: int = 3,
        overwrite: bool = True,
    ) -> None:
        engines = list(engines)
        bad = [e for e in engines if e not in ENGINES]
        if not engines or bad:
            raise ValueError(f"ExportOnCheckpoint engines must be a non-empty subset of {list(ENGINES)}, got {engines}")
        if checkpoint not in ("final", "best", "last"):
            raise ValueError(f"ExportOnCheckpoint checkpoint must be 'final', 'best' or 'last', got {checkpoint!r}")
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"ExportOnCheckpoint dtype must be one of {list(EXPORT_DTYPES)}, got {dtype!r}")
        if num_speculative_tokens < 1:
            raise ValueError(f"ExportOnCheckpoint num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.engines = engines
        self.dirpath = dirpath
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.num_speculative_tokens = num_speculative_tokens
        self.overwrite = overwrite
        self.exported: dict[str, Path] = {}

    def _root(self, trainer: Trainer) -> Path:
        return Path(self.dirpath if self.dirpath is not None else os.path.join(trainer.default_root_dir, "export"))

    def _existing_checkpoint(self, trainer: Trainer) -> str | None:
        cb = trainer.checkpoint_callback
        if self.checkpoint == "final" or cb is None:
            return None
        path = getattr(cb, "best_model_path" if self.checkpoint == "best" else "last_model_path", "")
        return path if path and os.path.isfile(path) else None

    @contextmanager
    def _saved_weights(self, trainer: Trainer, name: str):
        """The module's weights saved through ``trainer.save_checkpoint`` (collective: every rank takes part) into
        a temporary folder under the export root, removed afterwards; yields (folder, checkpoint path)."""
        root = self._root(trainer)
        root.mkdir(parents=True, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(prefix=".export-ckpt-", dir=root) if trainer.is_global_zero else None
        tmp_dir = trainer.strategy.broadcast(tmp_dir)
        source = os.path.join(tmp_dir, name)
        trainer.save_checkpoint(source, weights_only=True)
        try:
            yield Path(tmp_dir), source
        finally:
            if trainer.is_global_zero:
                shutil.rmtree(tmp_dir, ignore_errors=True)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Export the run's starting head once per engine into a temporary folder (then removed), so that an
        engine that cannot take this head (llama.cpp for a target that is no GGUF or a head with EAGLE-3.1 output
        norms, SGLang or TensorRT-LLM for other than 3 aux states, ...) stops the run before training rather than
        after it, when its export would fail.

        Raises:
            ValueError: naming the engine, the export's own reason and what to change, on every rank.
        """
        with self._saved_weights(trainer, "start.ckpt") as (tmp_dir, source):
            error = None
            if trainer.is_global_zero:
                for engine in self.engines:
                    try:
                        export_checkpoint(source, engine, tmp_dir / engine, dtype=self.dtype,
                                          num_speculative_tokens=self.num_speculative_tokens)
                    except (ValueError, OSError) as exc:
                        error = (f"ExportOnCheckpoint: engines [{engine}] cannot take this run's head, so its export "
                                 f"at the end of training would fail ({exc}); remove {engine} from the callback's "
                                 "engines and export the checkpoint with `draftkit export` instead")
                        break
            error = trainer.strategy.broadcast(error)
        if error is not None:
            if trainer.is_global_zero and not any(self._root(trainer).iterdir()):
                self._root(trainer).rmdir()  # this check made it: a run stopped in set-up leaves nothing behind
            raise ValueError(error)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        root = self._root(trainer)
        source = self._existing_checkpoint(trainer)
        if source is None and self.checkpoint != "final":
            log.warning("ExportOnCheckpoint: no %s checkpoint file; exporting the final weights", self.checkpoint)
        with nullcontext((None, source)) if source else self._saved_weights(trainer, "final.ckpt") as (_, source):
            if trainer.is_global_zero:
                for engine in self.engines:
                    out = export_checkpoint(
                        source, engine, root / engine_dir(engine), dtype=self.dtype, overwrite=self.overwrite,
                        num_speculative_tokens=self.num_speculative_tokens,
                    )
                    self.exported[engine] = out
                    log.info("ExportOnCheckpoint: %s -> %s", engine, out)
            trainer.strategy.barrier("ExportOnCheckpoint")
