"""Callbacks (issue 36 survivors): LayerSelection hands the analysis a figure writer only when the logger has
one; AcceptanceLengthMonitor logs the per-position distribution metrics of its report."""

from __future__ import annotations

import csv
import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from draftkit.callbacks.acceptance import AcceptanceLengthMonitor
from draftkit.callbacks.layer_selection import LayerSelection
from draftkit.data.prompts import load_prompts
from draftkit.decoding.harness import evaluate_head
from draftkit.decoding.metrics import DISTRIBUTION_METRICS
from tests.callbacks.test_acceptance import TinyModule, tiny_parts  # noqa: F401 (fixture)
from tests.callbacks.test_layer_selection import RandomChat, StubModule, _one_thread, tiny_dir  # noqa: F401 (fixtures)


@pytest.mark.parametrize("logger", ["tensorboard", "csv", "none"])
def test_layer_selection_writer_only_from_a_logger_with_figures(logger, tiny_dir, tmp_path, monkeypatch):
    seen = []

    def analysis(model, batches, config, exclude, path, writer, meta, device):
        seen.append(writer)
        return {"chosen": [1, 3, 6]}

    monkeypatch.setattr("draftkit.analysis.report.run_layer_analysis", analysis)
    made = {"tensorboard": lambda: TensorBoardLogger(tmp_path, name="tb"), "csv": lambda: CSVLogger(tmp_path),
            "none": lambda: False}[logger]()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=1, accelerator="cpu", logger=made,
                         callbacks=[LayerSelection(k=3)], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = StubModule(str(tiny_dir))
    trainer.fit(module, datamodule=RandomChat(num=2))
    assert module.built_with == [1, 3, 6]
    assert len(seen) == 1
    if logger == "tensorboard":
        assert seen[0] is trainer.logger.experiment and hasattr(seen[0], "add_figure")
    else:  # CSVLogger's experiment has no add_figure: no writer, not a crash in log_figures
        assert seen[0] is None


def test_acceptance_monitor_logs_distribution_metrics_per_position(tmp_path, tiny_parts):
    module = TinyModule(*tiny_parts)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc"}) + "\n")
    monitor = AcceptanceLengthMonitor(every_n_train_steps=1, num_prompts=1, k=2, max_new_tokens=4, prompts=str(prompts))
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0, logger=CSVLogger(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[monitor])
    trainer.fit(module)
    expected = evaluate_head(module.head, module.target, module.tokenizer, load_prompts(str(prompts), 1), k=2,
                             max_new_tokens=4, baseline=False, prompt_lookup=False, warmup=False)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/accept_len")]
    assert len(rows) == 1
    logged = {name: float(v) for name, v in rows[0].items() if v}
    want = {f"val/{name}_pos{i}": x for name in DISTRIBUTION_METRICS
            for i, x in enumerate(expected[f"{name}_per_position"], 1) if x is not None}
    assert len(want) == 2 * len(DISTRIBUTION_METRICS)  # k = 2 positions, each metric measured at both
    assert {name: logged[name] for name in want} == pytest.approx(want, abs=1e-6)


def test_documented_defaults_and_the_k_boundary():
    """``draftkit.callbacks.acceptance`` / ``draftkit.callbacks.export``: the defaults that change what is
    measured or written, and k = 1 (the boundary of ``k < 1``) accepted, 0 refused."""
    from draftkit.callbacks.export import ExportOnCheckpoint

    m = AcceptanceLengthMonitor()
    assert (m.every_n_validations, m.every_n_train_steps, m.num_prompts, m.k, m.max_new_tokens, m.temperature,
            m.prompts, m.seed) == (1, None, 8, 5, 64, 0.0, "mt-bench", 0)
    e = ExportOnCheckpoint()
    assert (e.engines, e.dirpath, e.checkpoint, e.dtype, e.num_speculative_tokens, e.overwrite) == (
        ["vllm"], None, "final", "bfloat16", 3, True)
    assert ExportOnCheckpoint(num_speculative_tokens=1).num_speculative_tokens == 1
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        ExportOnCheckpoint(num_speculative_tokens=0)
