"""ProgressLog: one plain line per interval for a fit whose output is a file, where the progress bar draws nothing."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftkit import fit_progress as progress
from draftkit.fit_progress import ProgressLog
from draftkit.cli import DraftkitCLI

REPO = Path(__file__).resolve().parents[1]


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress.__name__]


def test_lines_give_the_rate_without_validation_time_and_the_eta(monkeypatch, caplog):
    clock = iter([100.0, 160.0, 170.0, 230.0, 300.0, 420.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    trainer = SimpleNamespace(is_global_zero=True, global_step=1, max_steps=100, callback_metrics={})
    cb = ProgressLog(every_s=60)
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        cb.on_train_batch_end(trainer, None, None, None, 0)  # t=100, step 1: the mark
        trainer.global_step, trainer.callback_metrics = 11, {"train/loss": torch.tensor(6.5)}
        cb.on_train_batch_end(trainer, None, None, None, 0)  # t=160: 60 s for 10 steps
        cb.on_validation_start(trainer, None)  # t=170
        cb.on_validation_end(trainer, None)  # t=230: 60 s of validation
        trainer.global_step = 21
        cb.on_train_batch_end(trainer, None, None, None, 0)  # t=300: 140 s - 60 s validation for 10 steps
        trainer.global_step = 21  # another micro-batch of the same optimizer step: no line
        cb.on_train_batch_end(trainer, None, None, None, 0)  # t=420
    assert _lines(caplog) == [
        "step 11/100 (11.0 %), train/loss 6.5000, 6.00 s/step, ETA 8 min",
        "step 21/100 (21.0 %), train/loss 6.5000, 8.00 s/step, ETA 10 min",
    ]


def test_a_run_without_a_step_limit_has_no_total_and_other_ranks_say_nothing(monkeypatch, caplog):
    clock = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, max_steps=-1, estimated_stepping_batches=float("inf"),
                              callback_metrics={})
    cb = ProgressLog(every_s=0)
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        cb.on_train_batch_end(trainer, None, None, None, 0)
        trainer.global_step = 4
        cb.on_train_batch_end(trainer, None, None, None, 0)
        ProgressLog(every_s=0).on_train_batch_end(SimpleNamespace(is_global_zero=False), None, None, None, 0)
    assert _lines(caplog) == ["step 4, 2.50 s/step"]
    with pytest.raises(ValueError, match="every_s must be >= 0 seconds, got -1"):
        ProgressLog(every_s=-1)


@pytest.mark.parametrize("terminal", [False, True])
def test_fit_adds_it_when_its_output_is_no_terminal(tmp_path, monkeypatch, terminal):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--trainer.default_root_dir", str(tmp_path),
                            "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
                            "--trainer.enable_progress_bar", "false"])
    assert sum(isinstance(cb, ProgressLog) for cb in cli.trainer.callbacks) == (0 if terminal else 1)
