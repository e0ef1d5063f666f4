"""``LayerSelection``: choose the aux layers by entropy and CKA before the draft head is built (layer-analysis.md §8).

Hook points assumed of the LightningModule (``draftkit.models.eagle3.Eagle3Module`` provides them):

- ``load_target_model() -> (hf_model, tokenizer)``, cached, so the module's own ``setup`` reuses the model
  (or an attribute ``target_model`` holding the HF model; then the tokenizer is optional);
- ``set_aux_layer_ids(ids)``, which must be called before the head exists (else ``hparams.aux_layer_ids``
  is set);
- Lightning calls callback ``setup`` after the datamodule's ``setup`` and before the module's, so
  ``trainer.datamodule.train_dataloader()`` already yields ``input_ids`` / ``attention_mask`` /
  ``loss_mask`` batches.

Shapes: B batch, T tokens.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

from lightning.pytorch import Callback
from typing_extensions import override

from draftkit.analysis.collect import LayerAnalysisConfig
from draftkit.selection.layers import validate_aux_layer_ids
from draftkit.target.tokens import ids_to_skip

__all__ = ["LayerSelection"]

log = logging.getLogger(__name__)


class LayerSelection(Callback):
    """Runs the layer analysis in ``setup("fit")`` and sets ``model.aux_layer_ids`` to the chosen set.

    The report goes to ``<trainer.default_root_dir>/<report>`` (default ``analysis/layers.json``), with the
    CKA heatmap and the entropy curve beside it and in the TensorBoard logger (tags ``analysis/cka``,
    ``analysis/entropy``). When that report already exists (a resumed run), its ``chosen`` ids are reused
    and nothing is recomputed, so a checkpoint and its layers always agree.

    Args:
        num_tokens: candidate rows to scan (assistant positions; see ``LayerAnalysisConfig.num_tokens``).
        k: aux layers to choose.
        entropy_quantile: drop rows below this quantile of the entropy keys (None = off).
        entropy_threshold: or: drop rows below this many nats (None = off).
        one_per_block: one layer per CKA depth block.
        options: the other analysis options; ``num_tokens``, ``k``, ``entropy_quantile``,
            ``entropy_threshold`` and ``one_per_block`` given here override theirs.
        report: report path relative to ``trainer.default_root_dir``.
        reuse_report: reuse an existing report's choice instead of recomputing.
        max_batches: stop after this many loader batches even if ``num_tokens`` is not reached (None = no cap).

    Raises:
        ValueError: on invalid options (see ``LayerAnalysisConfig``).
    """

    def __init__(
        self,
        num_tokens: int = 100_000,
        k: int = 3,
        entropy_quantile: float | None = None,
        entropy_threshold: float | None = None,
        one_per_block: bool = False,
        options: LayerAnalysisConfig | None = None,
        report: str = "analysis/layers.json",
        reuse_report: bool = True,
        max_batches: int | None = None,
    ) -> None:
        self.config = LayerAnalysisConfig.merged(
            options, num_tokens=num_tokens, k=k, entropy_quantile=entropy_quantile,
            entropy_threshold=entropy_threshold, one_per_block=one_per_block,
        )
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be >= 1 or null, got {max_batches}")
        self.report_name = report
        self.reuse_report = reuse_report
        self.max_batches = max_batches
        self.chosen: list[int] | None = None
        self.report: dict | None = None

    @staticmethod
    def _target(pl_module):
        model = getattr(pl_module, "target_model", None)
        tokenizer = None
        if model is None:
            if not hasattr(pl_module, "load_target_model"):
                raise ValueError(
                    f"LayerSelection needs {type(pl_module).__name__}.load_target_model() -> (hf_model, tokenizer) "
                    "or a target_model attribute"
                )
            model, tokenizer = pl_module.load_target_model()
        return model, tokenizer

    @staticmethod
    def _apply(pl_module, ids: list[int]) -> None:
        if hasattr(pl_module, "set_aux_layer_ids"):
            pl_module.set_aux_layer_ids(ids)
        else:
            pl_module.hparams.aux_layer_ids = list(ids)

    def _compute(self, trainer, pl_module, path: Path) -> list[int]:
        from draftkit.analysis.report import run_layer_analysis

        model, tokenizer = self._target(pl_module)
        num_layers = model.config.num_hidden_layers
        if self.config.k > num_layers - 1:
            raise ValueError(f"LayerSelection k={self.config.k} exceeds the {num_layers - 1} candidate layers")
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "train_dataloader"):
            raise ValueError("LayerSelection needs a datamodule with train_dataloader() (trainer.fit(..., datamodule=...))")
        batches = dm.train_dataloader()
        if self.max_batches is not None:
            batches = itertools.islice(batches, self.max_batches)
        exclude = ids_to_skip(tokenizer)
        device = trainer.strategy.root_device
        start_device = next(model.parameters()).device
        writer = getattr(trainer.logger, "experiment", None) if trainer.logger is not None else None
        if writer is not None and not hasattr(writer, "add_figure"):
            writer = None
        hparams = getattr(pl_module, "hparams", None) or {}
        meta = {"target": hparams.get("target"), "device": str(device), "source": "LayerSelection callback"}
        model.to(device)
        try:
            report = run_layer_analysis(model, batches, self.config, exclude, path, writer, meta, device=device)
        finally:
            model.to(start_device)
        self.report = report
        return report["chosen"]

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        path = Path(trainer.default_root_dir) / self.report_name
        ids = None
        if trainer.is_global_zero:
            if self.reuse_report and path.exists():
                self.report = json.loads(path.read_text())
                ids = list(self.report["chosen"])
                log.info("LayerSelection: reusing %s from %s", ids, path)
            else:
                ids = self._compute(trainer, pl_module, path)
        ids = trainer.strategy.broadcast(ids, src=0)
        model, _ = self._target(pl_module)
        ids = validate_aux_layer_ids(ids, model.config.num_hidden_layers, option="LayerSelection chosen ids")
        before = getattr(pl_module.hparams, "aux_layer_ids", None) if hasattr(pl_module, "hparams") else None
        if before is not None and list(before) != ids:
            log.warning("LayerSelection replaces model.aux_layer_ids=%s with %s", list(before), ids)
        self._apply(pl_module, ids)
        self.chosen = ids
        log.info("LayerSelection: aux layers %s (report %s)", ids, path)

    def state_dict(self) -> dict:
        return {"chosen": self.chosen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.chosen = state_dict.get("chosen")
