"""What ``fit`` checks and leaves before training starts (issue 55): a ``data.max_length`` past the target's
context window, two fits started together in one ``default_root_dir``, small data under the tiny recipe, a stop
during set-up (no run directory left), and a target whose own outputs overflow in ``model.target_dtype``."""

import json
from pathlib import Path

from draftkit.commands import main

REPO = Path(__file__).resolve().parents[1]
TINY = ["fit", "--recipe", "recipes/tiny-debug.yaml", "--trainer.enable_progress_bar", "false"]
RECORDS = [  # case x01: four short ShareGPT records, one batch of training data
    {"id": f"r{i}", "conversations": [{"from": "human", "value": f"What is {i} plus {i}?"},
                                      {"from": "gpt", "value": f"{i} plus {i} is {2 * i}."}]} for i in range(4)]


def test_max_length_past_the_context_window_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(TINY + ["--data.max_length", "1024", "--trainer.default_root_dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "draftkit fit: error: data.max_length=1024 exceeds the context window of model.target tiny:llama "
        "(max_position_embeddings=512): the target's states past 512 tokens are not the ones it serves; set "
        "data.max_length to at most 512")
    assert not (tmp_path / "run").exists()


def test_two_fits_started_together_get_their_own_run_directories(tmp_path, monkeypatch):
    """Both runs listed the empty directory at the same moment (as two processes started together do)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(TensorBoardLogger, "_get_next_version", lambda self: 0)
    for seed in ("1", "2"):
        assert main(TINY + ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                            "--seed_everything", seed,
                            "--trainer.default_root_dir", str(tmp_path)]) == 0
    runs = sorted((tmp_path / "lightning_logs").iterdir())
    assert [p.name for p in runs] == ["version_0", "version_1"]
    for run in runs:
        assert len(list(run.glob("events.out.tfevents.*"))) == 1
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best-step=2.ckpt", "last.ckpt"]
    assert [json.loads(json.dumps(__import__("yaml").safe_load((r / "config.yaml").read_text())["seed_everything"]))
            for r in runs] == [1, 2]


def test_the_tiny_recipe_trains_on_one_batch_and_epoch_bound_validation_names_the_options(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.chdir(REPO)
    data = tmp_path / "x01.json"
    data.write_text(json.dumps(RECORDS))
    small = TINY + ["--data.path", str(data), "--data.val_size", "1", "--model.draft_vocab_size", "320",
                    "--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path / "a")]
    assert main(small) == 0
    assert (tmp_path / "a" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").exists()
    # a recipe that validates per epoch: the option names, not Lightning's, and no run directory left behind
    assert main(small + ["--trainer.check_val_every_n_epoch", "1", "--trainer.default_root_dir", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "draftkit fit: error: trainer.val_check_interval=4 exceeds the 1 training batches of an epoch; set "
        "trainer.check_val_every_n_epoch null (validation every trainer.val_check_interval batches across epochs) "
        "or lower trainer.val_check_interval")
    assert not (tmp_path / "b").exists()


def test_a_target_overflowing_in_float16_is_named_and_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    """Case b14: the target's layer-6 MLP output scaled by 1e8 overflows float16 (float32 stays finite)."""
    from safetensors.torch import load_file, save_file

    from draftkit.testing import build_tiny_target

    monkeypatch.chdir(REPO)
    target = build_tiny_target(tmp_path / "tiny-ovf")
    weights = load_file(str(target / "model.safetensors"))
    weights["model.layers.6.mlp.down_proj.weight"] *= 1e8
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    assert main(TINY + ["--model.target", str(target), "--model.target_dtype", "float16", "--trainer.precision",
                        "16-mixed", "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "validation batch 0: the target's own outputs are non-finite (" in err
    assert ("NaN/inf values in its logits) with model.target_dtype=float16: the target overflows in that dtype, "
            "whatever the head or the learning rate; set model.target_dtype to float32") in err
    assert "model.optim.lr" not in err
    assert not (tmp_path / "run").exists()  # stopped in the sanity check: no config, hparams or event file left


def test_a_fit_of_zero_steps_names_no_last_checkpoint(tmp_path, monkeypatch, caplog):
    """A fit that trains no step (here trainer.max_epochs 0; trainer.max_steps 0 is refused up front) ended
    "last checkpoint: .../last.ckpt", a file no one wrote."""
    import logging

    monkeypatch.chdir(REPO)
    with caplog.at_level(logging.INFO):
        assert main(TINY + ["--trainer.max_steps", "-1", "--trainer.max_epochs", "0", "--trainer.max_time", "null",
                            "--trainer.default_root_dir", str(tmp_path)]) == 0
    assert "  last checkpoint: (none)\n" in caplog.text and not list(tmp_path.rglob("*.ckpt"))
