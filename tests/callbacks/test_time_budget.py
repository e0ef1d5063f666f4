"""TimeBudget on a fake clock: the schedule ends exactly at its end, a final validation runs, the best checkpoint
is written, a resumed run counts the time spent before it and re-plans, and validations re-plan it when steps slow down or speed
up, with a continuous LR."""

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from draftkit.callbacks.time_budget import TimeBudget, process_seconds
from draftkit.cli import DraftkitCLI

REPO = Path(__file__).resolve().parents[2]


class FakeClock(Callback):
    """A clock that moves only when the run does: ``train_s`` per training batch, ``val_s`` per validation batch;
    ``changes`` maps an optimizer step to the ``train_s`` of the batches after it (a machine that slows down or
    frees up)."""

    def __init__(self, start: float, train_s: float, val_s: float, changes: dict[int, float] | None = None) -> None:
        self.now, self.train_s, self.val_s = start, train_s, val_s
        self.changes = dict(changes or {})

    def __call__(self) -> float:
        return self.now

    def on_train_batch_start(self, trainer, *args) -> None:
        for step in [s for s in self.changes if trainer.global_step >= s]:
            self.train_s = self.changes.pop(step)
        self.now += self.train_s

    def on_validation_batch_start(self, *args) -> None:
        self.now += self.val_s


def _recipe(tmp_path: Path, **trainer) -> Path:
    cfg = {"trainer": {
        "default_root_dir": str(tmp_path), "max_steps": -1, "max_time": "00:00:10:00", "val_check_interval": 4,
        "check_val_every_n_epoch": 1,  # validations every 4 batches of each epoch (the figures below count them so)
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


class PlanRecorder(Callback):
    """Records, after each optimizer step s, the LR then set (the one step s + 1 uses) and the plan
    (``lr_horizon``, ``lr_anchor``) in force, and after each real validation the plan it left."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock
        self.lrs: dict[int, float] = {}
        self.plans: dict[int, tuple] = {}
        self.after_val: dict[int, tuple] = {}
        self.clock_at_val: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]
        self.plans[trainer.global_step] = (pl_module.lr_horizon, pl_module.lr_anchor)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.after_val[trainer.global_step] = (pl_module.lr_horizon, pl_module.lr_anchor)
            if self.clock is not None:
                self.clock_at_val[trainer.global_step] = self.clock.now

    def replans(self) -> list[int]:
        """Steps at whose validation the plan changed."""
        return [s for s, plan in self.after_val.items() if plan != self.plans[s]]


def _lr_with(model, plan: tuple, step: int) -> float:
    """The LR ``model``'s schedule gives after ``step`` optimizer steps under ``plan`` = (lr_horizon, lr_anchor)."""
    kept = model.lr_horizon, model.lr_anchor
    model.lr_horizon, model.lr_anchor = plan
    try:
        return model.optim.lr * model.lr_factor(step)
    finally:
        model.lr_horizon, model.lr_anchor = kept


def _fit(tmp_path: Path, clock: FakeClock, budget: TimeBudget, *extra: str, ckpt_path=None,
         callbacks: tuple = ()) -> DraftkitCLI:
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_recipe(tmp_path)), *extra], run=False)
    # before ModelCheckpoint (Lightning moves checkpoint callbacks last anyway): the stop and the re-plan are
    # decided first, so the checkpoint of a validation holds the plan it made
    cli.trainer.callbacks[:0] = [clock, budget, *callbacks]
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
    # the plan counts a validation every 4 steps, the run has 3 per 14-step epoch: the validations re-plan,
    # keeping 45 until the one after step 32 (412 s used): 32 + floor((600 - 412 - 4 - 30) / 11) = 46
    # (before re-planning existed the run ended at 45 with 30 s unused)
    assert model.lr_horizon == 46 and trainer.global_step == 46 and budget.replans == 1
    cfg = model.optim
    assert trainer.optimizers[0].param_groups[0]["lr"] == cfg.lr * cfg.min_lr_ratio
    # validations every 4 batches of each 14-batch epoch (logged at step - 1: 3, 7, 11, 17, ...), the last
    # regular one after step 40, then the final one at step 46 (a regular one too), and the best checkpoint
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    val_steps = sorted({int(r["step"]) for r in rows if r.get("val/tau_sim")})
    assert val_steps == [3, 7, 11, 17, 21, 25, 31, 35, 39, 45]
    assert clock.now == 60 + 4 + 46 * 10 + 10 * 4 <= 600 - 30  # set-up, sanity check, steps, validations
    best = torch.load(trainer.checkpoint_callback.best_model_path, map_location="cpu", weights_only=False)
    assert best["draftkit"]["lr_horizon"] == (45 if best["global_step"] < 32 else 46) and 0 < best["global_step"] <= 46
    assert 0 < best["draftkit"]["tokens_trained"] <= model.tokens_trained


def _spent(ckpt, seconds: float, out: Path) -> str:
    """A copy of ``ckpt`` whose Lightning ``Timer`` says ``seconds`` of training were spent (on the fake clock)."""
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved["callbacks"]["Timer"]["time_elapsed"]["train"] = seconds
    torch.save(saved, out)
    return str(out)


@pytest.mark.parametrize("train_s", [10.0, 5.0], ids=["same-speed", "faster"])
def test_a_resumed_run_counts_the_spent_time_and_replans(tmp_path, monkeypatch, train_s):
    """Resumed from a checkpoint whose Timer holds the training time spent, a run counts it against the budget
    and keeps re-planning: on a machine as fast as the first it ends where the uninterrupted run ended (step
    46, see the first test); on a faster one it plans more steps; both end with the LR at its floor inside the
    budget (the old resume ignored the spent time: it ran on to its checkpointed horizon, or would have planned
    a fresh 600 s)."""
    monkeypatch.chdir(REPO)
    clock = FakeClock(start=60.0, train_s=10.0, val_s=2.0)
    rec = PlanRecorder(clock)
    every = ModelCheckpoint(dirpath=tmp_path / "every", filename="v-{step}", monitor="val/loss", save_top_k=-1)
    _fit(tmp_path / "first", clock, TimeBudget(measure_steps=2, skip_steps=1, clock=clock, started_at=0.0),
         callbacks=(rec, every))
    g = 18
    # the resumed process spends 60 s of set-up of its own before training (Lightning runs no sanity check
    # when it resumes mid-epoch)
    spent = rec.clock_at_val[g] - 60.0
    ckpt = _spent(tmp_path / "every" / f"v-step={g}.ckpt", spent, tmp_path / "spent.ckpt")
    again = FakeClock(start=60.0, train_s=train_s, val_s=2.0)
    budget = TimeBudget(measure_steps=2, skip_steps=1, clock=again, started_at=0.0)
    cli = _fit(tmp_path / "second", again, budget, ckpt_path=ckpt)
    assert budget.spent_before == spent and budget.budget_s == 600.0
    assert spent + again.now <= 600 - 30  # the budget, counted over both runs
    cfg = cli.model.optim
    assert cli.trainer.global_step == cli.model.lr_horizon
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == cfg.lr * cfg.min_lr_ratio
    if train_s == 10.0:
        assert cli.trainer.global_step == 46
    else:
        assert budget.replans >= 1 and budget.step_s == 5.0 and cli.trainer.global_step > 46


@pytest.mark.parametrize("after", [14.0, 6.0], ids=["slow-down", "speed-up"])
def test_validation_replans_the_horizon_when_steps_change_speed(tmp_path, monkeypatch, after):
    """Steps take 10 s until step 8, then ``after`` s: the validation after step 12 re-measures s/step over steps
    9-12 (its own 4 s left out) and moves H down (slow-down) or up (speed-up); the run ends at the new H, LR at
    its floor, within the budget."""
    monkeypatch.chdir(REPO)
    clock = FakeClock(start=60.0, train_s=10.0, val_s=2.0, changes={8: after})
    budget = TimeBudget(measure_steps=2, skip_steps=1, margin_s=30.0, clock=clock, started_at=0.0)
    rec = PlanRecorder()
    cli = _fit(tmp_path, clock, budget, callbacks=(rec,))
    model, trainer = cli.model, cli.trainer
    # first plan at step 3: 45 (see the first test); the validation after step 4 has too few steps to re-plan,
    # the one after step 8 re-plans to the same 45 (no anchor); after step 12 (4 steps at `after` s, the
    # validation 4 s): used 60 + 4 + 8*10 + 2*4 + 4*after + 4 s, H = 12 + floor((600 - used - 4 - 30) / (after + 1))
    assert rec.plans[3] == (45, None) and rec.after_val[8] == (45, None)
    used = 60 + 4 + 8 * 10 + 2 * 4 + 4 * after + 4
    replanned = 12 + math.floor((600 - used - 4 - 30) / (after + 1))
    assert replanned == (35 if after > 10 else 67)
    assert rec.replans()[0] == 12 and rec.after_val[12][0] == replanned and budget.step_s == after
    assert (model.lr_horizon < 45) if after > 10 else (model.lr_horizon > 45)
    # the run ends at its (last) horizon, LR exactly at the floor, within the budget
    cfg = model.optim
    assert trainer.global_step == model.lr_horizon and budget.horizon == model.lr_horizon
    assert trainer.optimizers[0].param_groups[0]["lr"] == rec.lrs[model.lr_horizon] == cfg.lr * cfg.min_lr_ratio
    assert clock.now <= 600 - 30
    assert all(rec.lrs[s] > cfg.lr * cfg.min_lr_ratio for s in rec.lrs if 3 <= s < model.lr_horizon)


def test_replan_keeps_the_lr_continuous(tmp_path, monkeypatch):
    """At each re-plan step r the new formula gives exactly the LR the old one set after step r (the LR step
    r + 1 trains with); from r + 1 on the new plan is in force; the LR never rises after the warmup."""
    monkeypatch.chdir(REPO)
    clock = FakeClock(start=60.0, train_s=10.0, val_s=2.0, changes={8: 14.0, 20: 8.0})
    rec = PlanRecorder()
    cli = _fit(tmp_path, clock, TimeBudget(measure_steps=2, skip_steps=1, clock=clock, started_at=0.0),
               callbacks=(rec,))
    model = cli.model
    replans = rec.replans()
    assert len(replans) >= 2 and {12, 22} <= set(replans)  # down after the slow-down, up after the speed-up
    for r in replans:
        new = rec.after_val[r]
        assert new[1][1] == r  # anchored where it re-planned (after the warmup)
        assert _lr_with(model, new, r) == rec.lrs[r] == _lr_with(model, rec.plans[r], r)
        assert rec.plans[r + 1] == new and rec.lrs[r + 1] == _lr_with(model, new, r + 1)
    lrs = [rec.lrs[s] for s in sorted(rec.lrs) if s >= 3]
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))


def test_resume_after_a_replan_keeps_it(tmp_path, monkeypatch):
    """A checkpoint written by the validation that re-planned holds that plan (horizon and anchor); a run resumed
    from it on a machine as fast, with the spent time in its Timer, sets exactly the uninterrupted run's LR after
    every step (its re-plans land where the first run's did) and ends at the same step at the floor."""
    monkeypatch.chdir(REPO)
    clock = FakeClock(start=60.0, train_s=10.0, val_s=2.0, changes={8: 14.0})
    rec = PlanRecorder(clock)
    every = ModelCheckpoint(dirpath=tmp_path / "every", filename="v-{step}", monitor="val/loss", save_top_k=-1)
    _fit(tmp_path / "first", clock, TimeBudget(measure_steps=2, skip_steps=1, clock=clock, started_at=0.0),
         callbacks=(rec, every))
    r = rec.replans()[0]
    plan = rec.after_val[r]
    assert plan[1] is not None
    saved = torch.load(tmp_path / "every" / f"v-step={r}.ckpt", map_location="cpu", weights_only=False)
    assert (saved["draftkit"]["lr_horizon"], tuple(saved["draftkit"]["lr_anchor"])) == plan
    ckpt = _spent(tmp_path / "every" / f"v-step={r}.ckpt", rec.clock_at_val[r] - 60.0, tmp_path / "spent.ckpt")
    again = FakeClock(start=60.0, train_s=14.0, val_s=2.0)
    resumed = PlanRecorder(again)
    cli = _fit(tmp_path / "second", again, TimeBudget(measure_steps=2, skip_steps=1, clock=again, started_at=0.0),
               ckpt_path=ckpt, callbacks=(resumed,))
    assert min(resumed.lrs) == r + 1 and len(resumed.lrs) >= 10
    assert all(resumed.lrs[s] == rec.lrs[s] for s in resumed.lrs)
    cfg = cli.model.optim
    assert cli.trainer.global_step == max(rec.lrs) and resumed.lrs[cli.trainer.global_step] == cfg.lr * cfg.min_lr_ratio


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
    # counted from process start: a pytest session that has run long before this test must not spend it
    recipe["trainer"]["max_time"] = "00:05:00:00"
    recipe["trainer"]["callbacks"].append({"class_path": "draftkit.callbacks.time_budget.TimeBudget",
                                           "init_args": {"measure_steps": 2, "skip_steps": 1}})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    with caplog.at_level(logging.INFO):
        cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(tmp_path / "r.yaml")])
    assert cli.model.lr_horizon == 6 and cli.trainer.global_step == 6
    text = caplog.text
    assert "trained: 6 optimizer steps (6 in this run, " in text
    assert f"{cli.model.tokens_trained:,} tokens" in text and cli.model.tokens_trained > 0
    auto = cli.precision["auto"]["reason"]
    assert f"precision: head 32-true, target float32 (requested 32-true/float32; auto on this machine: {auto})" in text
    assert "of the 18000 s budget since process start" in text and "schedule horizon 6" in text


@pytest.mark.parametrize("train_s", [45.0, 100.0])
def test_steps_longer_than_the_margin_still_end_within_the_budget(tmp_path, monkeypatch, train_s):
    """Steps of 45 s and 100 s, longer than the 30 s margin, with the default 10 timed steps: the plan comes too
    late (or never), so the safety stop decides; it does not start a step that cannot finish, so the run ends,
    final validation included, within the 600 s budget (it used to end at 605 s and 624 s)."""
    monkeypatch.chdir(REPO)
    start = 50.0 if train_s == 45.0 else 100.0  # set-up seconds: the budget's end falls inside a step
    clock = FakeClock(start=start, train_s=train_s, val_s=2.0)
    budget = TimeBudget(clock=clock, started_at=0.0)  # measure_steps=10, skip_steps=2, margin_s=30
    cli = _fit(tmp_path, clock, budget)
    # 45 s: after step 11, 50 + 4 (sanity) + 495 + 2 validations (steps 4, 8) = 557 s; a 12th step, a validation
    # and the margin need 557 + 45 + 4 + 30 = 636 s > 600, so it stops there: final validation -> 561 s (the old
    # rule, 557 + 4 + 30 < 600, started step 12 and ended at 606 s).
    # 100 s: after step 4, 100 + 4 + 400 = 504 s; 504 + 100 + 4 + 30 > 600: stop, and the validation after step 4
    # is the final one -> 508 s (the old rule ran step 5 and ended at 612 s).
    steps, end = (11, 561.0) if train_s == 45.0 else (4, 508.0)
    assert cli.trainer.global_step == steps and budget.last_step_s == train_s
    assert clock.now == end <= 600 - 30


def _trainer(max_steps=-1, val_batches=2, every=4):
    from types import SimpleNamespace

    return SimpleNamespace(num_val_batches=[val_batches], val_check_batch=every, max_steps=max_steps,
                           strategy=SimpleNamespace(broadcast=lambda x: x), should_stop=False, global_step=0)


def test_plan_formula_counts_the_final_validation_and_the_margin():
    """H = g + floor((B - E - V - margin) / (s + V / every)) with every term separating: B = 600, E = 94 at g = 3,
    V = 2 batches x 2 s = 4 s, margin 30, s = 10, every 4 -> 3 + floor(472 / 11) = 45; without the final
    validation's V it would be 3 + floor(476 / 11) = 46, and the left-over exactly divisible lands on the step."""
    now = [94.0]
    tb = TimeBudget(margin_s=30.0, clock=lambda: now[0], started_at=0.0)
    tb.budget_s, tb.val_batch_s, tb.step_s = 600.0, 2.0, 10.0
    assert tb.plan(_trainer(), 3) == 45
    now[0] = 94.0 - 1.0  # left = 473 = 43 x 11: exactly 43 more steps fit
    assert tb.plan(_trainer(), 3) == 46
    assert tb.plan(_trainer(max_steps=20), 3) == 20 and tb.plan(_trainer(max_steps=46), 3) == 46
    now[0] = 1000.0  # past the budget: no step more, never fewer than done
    assert tb.plan(_trainer(), 3) == 3
    tb.spent_before, now[0] = 6.0, 94.0 - 6.0  # time spent before a resume counts as elapsed
    assert tb.elapsed() == 94.0 and tb.plan(_trainer(), 3) == 45


def test_a_step_stops_the_run_when_the_next_one_would_reach_the_budget_exactly():
    """Stop when E + last step + V + margin >= B: at equality the next step is not started."""
    from types import SimpleNamespace

    now = [0.0]
    tb = TimeBudget(margin_s=30.0, clock=lambda: now[0], started_at=0.0)
    tb.budget_s, tb.val_batch_s = 600.0, 2.0
    module = SimpleNamespace(lr_horizon=1000)
    tb._last_end, tb._val_total_s = (546.0, 0.0), 0.0
    trainer = _trainer()
    trainer.global_step = 10
    now[0] = 556.0  # E 556 + last step 10 + V 4 + margin 30 = 600 = B
    tb.on_train_batch_end(trainer, module, None, None, 0)
    assert tb.last_step_s == 10.0 and trainer.should_stop
    trainer = _trainer()
    trainer.global_step = 11
    tb._last_end = (545.5, 0.0)
    now[0] = 555.5  # 599.5 < 600: one more step fits
    tb.on_train_batch_end(trainer, module, None, None, 0)
    assert not trainer.should_stop
