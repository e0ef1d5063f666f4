"""``fit --ckpt_path`` compares the run's options with the checkpoint's: a changed ``model.*``/``data.*`` option
is refused naming both values; a limit (``trainer.max_steps``) may change and the change is logged once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from draftkit.cli import DraftkitCLI, load_recipe
from draftkit.commands import main
from draftkit.artifacts import file_sha256
from draftkit.fit_run import DATA_KEY, check_resume_options
from draftkit.models.schedule import RESUME_KEY

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny-debug.yaml"


def _args(root: Path, *extra: str) -> list[str]:
    return ["fit", "--recipe", RECIPE, "--trainer.default_root_dir", str(root), "--trainer.val_check_interval", "2",
            "--trainer.enable_progress_bar", "false", *extra]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """(run root, last.ckpt) of a 2-step tiny fit."""
    root = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        DraftkitCLI(args=_args(root, "--trainer.max_steps", "2"))
    return root, root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


def _checkpoints(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.ckpt"))


@pytest.mark.parametrize("flag, new, old", [("--model.draft_vocab_size", "32", "64"), ("--model.ttt.steps", "2", "3"),
                                            ("--data.max_length", "64", "128")])
def test_a_changed_model_or_data_option_is_refused_naming_both_values(two_steps, monkeypatch, capsys, flag, new, old):
    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    before = _checkpoints(root)
    assert main(_args(root, "--trainer.max_steps", "4", "--ckpt_path", str(ckpt), flag, new)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"draftkit fit: error: --ckpt_path {ckpt}: {flag[2:]} is {new} in this run but {old} in "
                          "the checkpoint. Resuming continues the checkpoint's run, so these options cannot change: "
                          "drop the flag (or set the recipe value back to the checkpoint's) to resume, or start a new "
                          f"run without --ckpt_path to train with the new values (--model.init_head {ckpt} starts it "
                          "from this head's weights and draft vocab, e.g. to continue it on new data).")
    assert _checkpoints(root) == before  # refused before anything ran


def test_a_changed_limit_trains_on_and_is_logged_once(two_steps, monkeypatch, caplog):
    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)[RESUME_KEY]["trainer.max_steps"] == 2
    with caplog.at_level(logging.INFO):
        cli = DraftkitCLI(args=_args(root, "--trainer.max_steps", "3", "--data.num_workers", "0", "--ckpt_path",
                                     str(ckpt)))
    assert cli.trainer.global_step == 3
    assert caplog.text.count(f"resuming {ckpt}: trainer.max_steps changed 2 -> 3") == 1
    assert "changed" not in caplog.text.replace("trainer.max_steps changed", "")  # nothing else differs
    assert torch.load(ckpt.parent / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3


def _stored(ckpt: Path) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)


def test_an_option_the_checkpoint_lacks_is_reported_not_refused(two_steps, monkeypatch, caplog):
    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    saved = _stored(ckpt)
    del saved["hyper_parameters"]["serving_k"], saved[RESUME_KEY]  # as an older draftkit wrote it
    config = load_recipe([RECIPE], ["--model.serving_k", "2", "--trainer.max_steps", "9"])
    with caplog.at_level(logging.INFO):
        check_resume_options(config, saved, "old.ckpt")
    assert "resuming old.ckpt: the checkpoint stores no trainer options (an older draftkit)" in caplog.text
    assert "resuming old.ckpt: the checkpoint stores no model.serving_k (this run: 2) (written by an older" in caplog.text


def test_a_data_file_that_changed_since_the_checkpoint_is_refused(tmp_path, monkeypatch, capsys):
    """The checkpoint stores the data file's sha256; a file extended under the same data.path (as a growing
    regeneration output is) would change the split and the batch order, so the resume is refused naming the file;
    the file restored, the same resume trains on."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    data = tmp_path / "chat.jsonl"
    original = (REPO / "recipes/data/tiny-chat.jsonl").read_bytes()
    data.write_bytes(original)
    root = tmp_path / "run"
    DraftkitCLI(args=_args(root, "--trainer.max_steps", "2", "--data.path", str(data)))
    ckpt = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert _stored(ckpt)[DATA_KEY] == file_sha256(data)
    first_line = original.split(b"\n", 1)[0]
    data.write_bytes(original + first_line.replace(b"?", b"??") + b"\n")  # one more conversation
    changed = file_sha256(data)
    before = _checkpoints(root)
    assert main(_args(root, "--trainer.max_steps", "3", "--data.path", str(data), "--ckpt_path", str(ckpt))) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"draftkit fit: error: --ckpt_path {ckpt}: data.path {data} holds other data than the run "
                          f"trained on (content {changed[:16]} now, {file_sha256(REPO / 'recipes/data/tiny-chat.jsonl')[:16]} "
                          "in the checkpoint: the file was rewritten or extended since)")
    assert _checkpoints(root) == before  # refused before anything ran
    data.write_bytes(original)
    cli = DraftkitCLI(args=_args(root, "--trainer.max_steps", "3", "--data.path", str(data), "--ckpt_path", str(ckpt)))
    assert cli.trainer.global_step == 3


def test_the_batch_size_may_change_only_keeping_the_global_batch(two_steps, monkeypatch, caplog):
    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    saved = _stored(ckpt)
    saved["datamodule_hyper_parameters"]["batch_size"] = 2
    saved[RESUME_KEY]["trainer.devices"] = 2  # a 2-process run resumed on one process
    with caplog.at_level(logging.INFO):
        check_resume_options(load_recipe([RECIPE], ["--trainer.max_steps", "2"]), saved, "ddp.ckpt")
    assert "resuming ddp.ckpt: data.batch_size changed 2 -> 4 (global batch 4 kept)" in caplog.text
    assert "resuming ddp.ckpt: trainer.devices changed 2 -> 1" in caplog.text
    with pytest.raises(ValueError, match=r"data.batch_size is 3 in this run but 2 in the checkpoint \(it may change "
                                         r"only with trainer.devices, keeping the global batch\)"):
        check_resume_options(load_recipe([RECIPE], ["--data.batch_size", "3"]), saved, "ddp.ckpt")



def test_a_ckpt_path_that_is_no_checkpoint_is_one_line_naming_it(two_steps, tmp_path, monkeypatch, capsys):
    """A recipe, an empty file or an export directory given to --ckpt_path gave torch's mmap RuntimeError traceback
    (exit 1) or, for a directory, Lightning's "Checkpoint file not found" after the target and data were loaded."""
    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "export").mkdir()
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
    cases = {
        RECIPE: "could not be read (invalid load key",
        str(tmp_path / "empty.ckpt"): "could not be read (",
        str(tmp_path / "export"): "is a directory, not a .ckpt file",
        str(tmp_path / "other.ckpt"): "is not a draftkit training checkpoint",
        str(tmp_path / "missing.ckpt"): "does not exist",
    }
    for path, message in cases.items():
        assert main(_args(root, "--ckpt_path", path)) == 2, path
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"draftkit fit: error: --ckpt_path {path} {message}"), err
    assert main(["validate", *_args(root, "--ckpt_path", RECIPE)[1:]]) == 2  # was an UnpicklingError traceback
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"draftkit validate: error: --ckpt_path {RECIPE} could not be read (")
    assert main(["validate", *_args(root, "--ckpt_path", str(tmp_path / "export"))[1:]]) == 2
    assert capsys.readouterr().err.strip().endswith(  # validate measures no fit: the hint names evaluate too
        "fit --model.init_head DIR starts a new run from it, evaluate --checkpoint DIR measures it")
    assert not (tmp_path / "lightning_logs").exists() and _checkpoints(root) == [
        "lightning_logs/version_0/checkpoints/best-step=2.ckpt", "lightning_logs/version_0/checkpoints/last.ckpt"]


def test_validate_names_the_model_options_the_checkpoint_replaces(two_steps, monkeypatch, caplog):
    """``validate --ckpt_path`` ran the checkpoint's model options without a word: ``--model.draft_vocab_size 32``
    or another ``--model.target`` were dropped (LightningCLI fills ``model.*`` from the checkpoint)."""
    from draftkit.fit_run import warn_replaced_model_options

    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)
    cfg = load_recipe([RECIPE], ["--model.draft_vocab_size", "32", "--model.target", "tiny:gemma3_text",
                                 "--model.optim.lr", "0.5", "--model.init_head", "h.ckpt"])  # these two: not used
    with caplog.at_level(logging.WARNING, logger="draftkit.fit_run"):
        assert warn_replaced_model_options(cfg, stored, "c.ckpt") == [
            "model.target 'tiny:gemma3_text' -> 'tiny:llama'", "model.draft_vocab_size 32 -> 64"]
    assert [r.getMessage() for r in caplog.records if r.name == "draftkit.fit_run"] == [
        "validate --ckpt_path c.ckpt runs the head with the checkpoint's model options, not this run's: "
        "model.target 'tiny:gemma3_text' -> 'tiny:llama'; model.draft_vocab_size 32 -> 64. To measure the head on "
        "another target use `draftkit evaluate --checkpoint c.ckpt --target T`; other head options need a new fit"]
    assert warn_replaced_model_options(load_recipe([RECIPE], []), stored, "c.ckpt") == []  # aux ids null: no change


def test_validate_does_not_read_the_init_head_of_the_run(two_steps, tmp_path, monkeypatch, caplog):
    """A head trained with ``model.init_head`` could not be validated once that head had moved: validate read it
    ("model.init_head: ... does not exist") although the checkpoint holds the weights."""
    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    started = tmp_path / "started"
    assert main(_args(started, "--trainer.max_steps", "1", "--model.init_head", str(ckpt))) == 0
    trained = started / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    moved = tmp_path / "moved.ckpt"
    ckpt.rename(moved)
    try:
        with caplog.at_level(logging.WARNING, logger="draftkit.fit_run"):
            assert main(["validate", "--recipe", RECIPE, "--ckpt_path", str(trained), "--trainer.default_root_dir",
                         str(tmp_path / "v"), "--trainer.enable_progress_bar", "false"]) == 0
    finally:
        moved.rename(ckpt)
    assert not [r for r in caplog.records if r.name == "draftkit.fit_run"]  # the recipe's options are the run's


def test_a_resume_under_another_root_dir_says_where_it_logs(two_steps, tmp_path, monkeypatch, caplog):
    """The run directory is continued only under the root that wrote it; under another trainer.default_root_dir the
    resumed run opens a new version directory there, and says so, naming the old one."""
    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    step = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    other = tmp_path / "elsewhere"
    with caplog.at_level(logging.WARNING):
        DraftkitCLI(args=_args(other, "--trainer.max_steps", str(step + 1), "--data.num_workers", "0", "--ckpt_path",
                               str(ckpt)))
    old = root / "lightning_logs" / "version_0"
    assert (f"resuming {ckpt}: its run directory {old} is not under {other / 'lightning_logs'} "
            "(trainer.default_root_dir or the logger changed)") in caplog.text
    assert (other / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").exists()


def test_a_run_resumes_in_another_precision_on_a_cpu_without_fast_bf16(two_steps, tmp_path, monkeypatch, caplog):
    """A run started where bf16 is fast must resume where it is ~60x slower: trainer.precision and
    model.target_dtype may change on resume (logged once each); the model runs the new target dtype (LightningCLI
    would put the checkpoint's back) and the next checkpoint stores it."""
    import shutil

    root, ckpt = two_steps
    monkeypatch.chdir(REPO)
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)
    step, dtype = stored["global_step"], stored["hyper_parameters"]["target_dtype"]
    precision = stored[RESUME_KEY]["trainer.precision"]
    new_dtype, new_precision = ("bfloat16", "bf16-mixed") if dtype == "float32" else ("float32", "32-true")
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    moved = copy / ckpt.relative_to(root)
    with caplog.at_level(logging.INFO):
        cli = DraftkitCLI(args=_args(copy, "--trainer.max_steps", str(step + 1), "--data.num_workers", "0",
                                     "--trainer.precision", new_precision, "--model.target_dtype", new_dtype,
                                     "--ckpt_path", str(moved)))
    assert cli.trainer.global_step == step + 1
    assert caplog.text.count(f"model.target_dtype changed {dtype!r} -> {new_dtype!r}") == 1
    assert caplog.text.count(f"trainer.precision changed {precision!r} -> {new_precision!r}") == 1
    assert cli.model.hparams.target_dtype == new_dtype
    assert str(next(cli.model.target.parameters()).dtype) == f"torch.{new_dtype}"
    last = max(copy.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)  # the copy logs into a new version dir
    assert torch.load(last, map_location="cpu", weights_only=True)["hyper_parameters"]["target_dtype"] == new_dtype
