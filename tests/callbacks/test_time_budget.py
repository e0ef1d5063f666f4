"""TimeBudget on a fake clock: the schedule ends exactly at its end, a final validation runs, the best checkpoint
is written, and a resumed run keeps the planned horizon."""

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from draftkit.callbacks.time_budget import TimeBudget, process_seconds
from draftkit.cli import DraftkitCLI

REPO = Path(__file__).resolve().parents[2]


class FakeClock(Callback):
    """A clock that moves only when the run does: ``train_s`` per training batch, ``val_s`` per validation batch."""

    def __init__(self, start: float, train_s: float, val_s: float) -> None:
        self.now, self.train_s, self.val_s = start, train_s, val_s

    def __call__(self) -> float:
        return self.now

    def on_train_batch_start(self, *args) -> None:
        self.now += self.train_s

    def on_validation_batch_start(self, *args) -> None:
        self.now += self.val_s


def _recipe(tmp_path: Path, **trainer) -> Path:
    cfg = {"trainer": {
        "default_root_dir": str(tmp_path), "max_steps": -1, "max_time": "00:00:10:00", "val_check_interval": 4,
        "enable_progress_bar": False, "num_sanity_val_steps": 2,
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
        "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
            "dirpath": str(tmp_path / "ckpt"), "filename": "best-{step}", "monitor": "val/tau_sim", "mode": "max",
            "save_last": True}}],
        **trainer,
    }}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(tmp_path: Path, clock: FakeClock, budget: TimeBudget, *extra: str, ckpt_path=None) -> DraftkitCLI:
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_recipe(tmp_path)), *extra], run=False)
    cli.trainer.callbacks[:0] = [clock, budget]  # before ModelCheckpoint: the stop is decided first
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return cli


def test_schedule_ends_exactly_at_the_budget_on_a_fake_clock(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    clock = FakeClock(start=60.0, train_s=10.0, val_s=2.0)  # 60 s of set-up before training
    budget = TimeBudget(measure_steps=2, skip_steps=1, margin_s=30.0, clock=clock, started_at=0.0)
    cli = _fit(tmp_path, clock, budget)
    model, trainer = cli.model, cli.trainer
    # sanity check: 2 val batches at 2 s -> 2 s/batch, a validation = 2 batches (limit_val_batches) = 4 s;
    # steps 2-3 timed: 10 s/step; at step 3: elapsed 60 + 4 + 3*10 = 94 s of 600 s;
    # H = 3 + floor((600 - 94 - 4 - 30) / (10 + 4/4)) = 3 + 42 = 45
    assert (budget.budget_s, budget.val_batch_s, budget.step_s) == (600.0, 2.0, 10.0)
    assert model.lr_horizon == 45 and trainer.global_step == 45
    cfg = model.optim
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=1e-12)
    # validations every 4 batches of each 14-batch epoch (logged at step - 1: 3, 7, 11, 17, ...), the last
    # regular one after step 40, then the final one at step 45, and the best checkpoint
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    val_steps = sorted({int(r["step"]) for r in rows if r.get("val/tau_sim")})
    assert val_steps == [3, 7, 11, 17, 21, 25, 31, 35, 39, 44]
    assert clock.now == 60 + 4 + 45 * 10 + 10 * 4 <= 600 - 30  # set-up, sanity check, steps, validations
    best = torch.load(trainer.checkpoint_callback.best_model_path, map_location="cpu", weights_only=False)
    assert best["draftkit"]["lr_horizon"] == 45 and 0 < best["global_step"] <= 45
    assert 0 < best["draftkit"]["tokens_trained"] <= model.tokens_trained


def test_resume_keeps_the_planned_horizon(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    first = tmp_path / "first"
    clock = FakeClock(start=60.0, train_s=10.0, val_s=2.0)
    run = _fit(first, clock, TimeBudget(measure_steps=2, skip_steps=1, clock=clock, started_at=0.0))
    ckpt = run.trainer.checkpoint_callback.best_model_path
    assert 3 < torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] < 45
    # the resumed run is much faster: it must not re-plan, only finish the saved horizon
    fast = FakeClock(start=0.0, train_s=0.1, val_s=0.1)
    second = tmp_path / "second"
    budget = TimeBudget(measure_steps=2, skip_steps=1, clock=fast, started_at=0.0)
    cli = _fit(second, fast, budget, ckpt_path=str(ckpt))
    assert cli.model.lr_horizon == 45 and cli.trainer.global_step == 45 and budget.step_s is None
    cfg = cli.model.optim
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=1e-12)


def test_max_steps_caps_the_horizon_and_no_budget_means_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    clock = FakeClock(start=0.0, train_s=1.0, val_s=0.0)
    cli = _fit(tmp_path / "cap", clock, TimeBudget(measure_steps=2, skip_steps=0, clock=clock, started_at=0.0),
               "--trainer.max_steps=7")
    assert cli.model.lr_horizon == 7 and cli.trainer.global_step == 7
    budget = TimeBudget(measure_steps=2, skip_steps=0, clock=clock, started_at=0.0)
    cli = _fit(tmp_path / "steps", clock, budget, "--trainer.max_steps=5", "--trainer.max_time=null")
    assert budget.budget_s is None and cli.model.lr_horizon is None and cli.trainer.global_step == 5


def test_arguments_and_process_clock():
    with pytest.raises(ValueError, match="measure_steps >= 1"):
        TimeBudget(measure_steps=0)
    assert 0.0 < process_seconds() < 24 * 3600 and math.isfinite(process_seconds())


def test_recipe_with_budget_fits_and_summarises(tmp_path, monkeypatch, caplog):
    """TimeBudget from YAML on the real clock, capped by max_steps; the end summary names steps, tokens,
    precision and its reason, and the budget."""
    import logging

    monkeypatch.chdir(REPO)
    recipe = yaml.safe_load(_recipe(tmp_path).read_text())
    recipe["trainer"]["max_steps"] = 6
    recipe["trainer"]["callbacks"].append({"class_path": "draftkit.callbacks.time_budget.TimeBudget",
                                           "init_args": {"measure_steps": 2, "skip_steps": 1}})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    with caplog.at_level(logging.INFO):
        cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(tmp_path / "r.yaml")])
    assert cli.model.lr_horizon == 6 and cli.trainer.global_step == 6
    text = caplog.text
    assert f"trained: 6 optimizer steps (6 in this run, " in text
    assert f"{cli.model.tokens_trained:,} tokens" in text and cli.model.tokens_trained > 0
    auto = cli.precision["auto"]["reason"]
    assert f"precision: head 32-true, target float32 (requested 32-true/float32; auto on this machine: {auto})" in text
    assert "of the 600 s budget since process start" in text and "schedule horizon 6" in text
