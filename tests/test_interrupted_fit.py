"""An interrupted ``fit`` (issue 55): it exits non-zero and says where its state went and how to resume; the same
command rerun without ``--ckpt_path`` never resumes silently; a resume goes through the option check."""

import functools
import logging
import shlex
import signal
from pathlib import Path

import pytest
import torch

from draftkit.commands import main

REPO = Path(__file__).resolve().parents[1]


class _SigtermAt(__import__("lightning").pytorch.Callback):
    """SIGTERM to this process after optimizer step ``step`` (as fit turns a first Ctrl-C into)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        import os

        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _recipe(tmp_path: Path) -> Path:
    path = tmp_path / "with interrupt.yaml"  # a space: the printed command must quote it
    path.write_text(f"""trainer:
  default_root_dir: {tmp_path}
  max_steps: 8
  enable_progress_bar: false
  callbacks+:
    - class_path: draftkit.callbacks.interrupt.InterruptCheckpoint
""")  # no dirpath: <default_root_dir>/interrupted
    return path


def test_interrupted_fit_reports_and_never_resumes_silently(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(REPO)
    args = ["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_recipe(tmp_path))]
    from lightning.pytorch import Trainer

    init = Trainer.__init__

    @functools.wraps(init)  # LightningCLI reads the trainer options from this signature
    def with_stop(self, *a, callbacks=None, **kw):  # the signal source, as a terminal or a scheduler would send it
        init(self, *a, callbacks=[*(callbacks or []), _SigtermAt(3)], **kw)

    monkeypatch.setattr(Trainer, "__init__", with_stop)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as stop:
        main(args)
    monkeypatch.setattr(Trainer, "__init__", init)
    assert stop.value.code == 143  # not 0: a script or scheduler must see the run did not finish
    ckpt = tmp_path / "interrupted" / "on_exception.ckpt"
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 3
    assert torch.load(last, weights_only=False)["global_step"] == 3  # written at the stop: no step lost
    assert "draftkit fit stopped by SIGTERM at optimizer step 3 (3 in this run)." in caplog.text
    resume = next(line.split(": ", 1)[1] for line in caplog.text.splitlines() if "resume (the options" in line)
    assert shlex.split(resume) == ["python", "-m", "draftkit", *args, "--ckpt_path", str(ckpt)]

    # the same command again, without --ckpt_path and with another lr: refused, naming the state and the command
    caplog.clear()
    assert main(args + ["--model.optim", "{lr: 0.05, warmup_steps: 1}"]) == 2
    assert not (tmp_path / "lightning_logs" / "version_1").exists()
    # through the printed command with the changed lr: the resume-option check refuses it
    assert main(shlex.split(resume)[3:] + ["--model.optim.lr", "0.05"]) == 2
    # and a changed draft vocab: a clear refusal, not a raw size mismatch
    assert main(shlex.split(resume)[3:] + ["--model.draft_vocab_size", "128"]) == 2
    # the printed command as is: resumes in the original run directory and finishes (the state file is consumed)
    with caplog.at_level(logging.INFO):
        assert main(shlex.split(resume)[3:]) == 0
    assert "trained: 8 optimizer steps (5 in this run" in caplog.text
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]
    # last.ckpt, written at the stop, is refreshed by the resumed run (it stayed at step 3 beside a last-v1.ckpt)
    assert [p.name for p in last.parent.iterdir() if p.name.startswith("last")] == ["last.ckpt"]
    assert torch.load(last, weights_only=False)["global_step"] == 8
    assert not ckpt.exists()


def test_refusals_name_the_state_and_the_options(tmp_path, monkeypatch, capsys):
    """The one-line errors of the refusals above (stderr, exit 2)."""
    monkeypatch.chdir(REPO)
    state = tmp_path / "interrupted" / "on_exception.ckpt"
    state.parent.mkdir()
    torch.save({"global_step": 5, "draftkit_log_dir": "runs/version_3"}, state)
    args = ["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_recipe(tmp_path))]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{state} holds the state of a stopped run at step 5 (run directory runs/version_3)" in err
    assert shlex.join(["python", "-m", "draftkit", *args, "--ckpt_path", str(state)]) in err
    assert not (tmp_path / "lightning_logs").exists()
    bare = tmp_path / "bare.yaml"
    bare.write_text(f"trainer:\n  default_root_dir: {tmp_path}\n  callbacks+:\n"
                    f"    - class_path: lightning.pytorch.callbacks.OnExceptionCheckpoint\n"
                    f"      init_args: {{dirpath: {tmp_path}}}\n")
    assert main(["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(bare)]) == 2
    assert "use draftkit.callbacks.interrupt.InterruptCheckpoint" in capsys.readouterr().err


class _InterruptInsideUpdate(__import__("lightning").pytorch.Callback):
    """A KeyboardInterrupt (a second Ctrl-C, which interrupts at once) raised right after the optimizer has updated
    the weights of step ``step`` and before Lightning counts the step, or (``inside=False``) at the start of the
    batch after it, outside any update."""

    def __init__(self, step: int, inside: bool) -> None:
        self.step, self.inside = step, inside

    def _raise(self, trainer) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt

    def on_train_start(self, trainer, pl_module) -> None:
        if self.inside:
            trainer.optimizers[0].register_step_post_hook(lambda *a: self._raise(trainer))

    def on_train_batch_start(self, trainer, *args) -> None:
        if not self.inside:
            self._raise(trainer)


@pytest.mark.parametrize("inside", [True, False])
def test_an_interrupt_inside_an_update_writes_no_state(tmp_path, monkeypatch, caplog, inside):
    """Inside the update of step 3 the weights are one update ahead of global_step 2: InterruptCheckpoint wrote that
    state and the report offered to resume it (it would train step 3 twice). Now it writes nothing there and says so;
    at a batch start (outside any update) it writes the consistent state of step 2."""
    monkeypatch.chdir(REPO)
    args = ["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(_recipe(tmp_path))]
    from lightning.pytorch import Trainer

    init = Trainer.__init__

    @functools.wraps(init)
    def with_stop(self, *a, callbacks=None, **kw):
        init(self, *a, callbacks=[*(callbacks or []), _InterruptInsideUpdate(2, inside)], **kw)

    monkeypatch.setattr(Trainer, "__init__", with_stop)
    with caplog.at_level(logging.INFO), pytest.warns() as warned, pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 130
    ckpt = tmp_path / "interrupted" / "on_exception.ckpt"
    refusal = [str(w.message) for w in warned if "InterruptCheckpoint: not writing" in str(w.message)]
    if inside:
        assert not ckpt.exists()
        assert refusal == [f"InterruptCheckpoint: not writing {ckpt}: the stop (KeyboardInterrupt) came inside the "
                           "optimizer update of step 3, whose weights may be part-updated; resume from the latest "
                           "periodic checkpoint (a single Ctrl-C stops at the next step boundary and writes this file)"]
        assert "state written" not in caplog.text
        assert "no checkpoint written at the stop (InterruptCheckpoint declined: its warning says why); latest " \
            in caplog.text
    else:
        assert torch.load(ckpt, weights_only=False)["global_step"] == 2 and not refusal
        assert f"state written: {ckpt} (step 2)" in caplog.text


def test_interrupt_folder_follows_the_trainer_root(tmp_path):
    """dirpath None: the stopped state goes below each run's own default_root_dir, so runs with their own root
    (ablation arms, two experiments) never share one file; an explicit dirpath is kept."""
    from types import SimpleNamespace

    from draftkit.callbacks.interrupt import InterruptCheckpoint

    a, b, fixed = InterruptCheckpoint(), InterruptCheckpoint(), InterruptCheckpoint(tmp_path / "mine")
    with pytest.raises(RuntimeError, match="bind_trainer"):
        a.ckpt_path
    for cb, root in ((a, "runs/a"), (b, "runs/b"), (fixed, "runs/c")):
        cb.setup(SimpleNamespace(default_root_dir=str(tmp_path / root)), None, "fit")
    assert a.ckpt_path == str(tmp_path / "runs" / "a" / "interrupted" / "on_exception.ckpt")
    assert b.ckpt_path == str(tmp_path / "runs" / "b" / "interrupted" / "on_exception.ckpt")
    assert fixed.ckpt_path == str(tmp_path / "mine" / "on_exception.ckpt")


def test_one_interrupt_callback_follows_each_trainer_it_serves(tmp_path):
    """The same InterruptCheckpoint (dirpath None) given to two trainers in turn (two fits in one Python session)
    writes below the root of the trainer it serves now, not the first one's: the runs never share a file."""
    from types import SimpleNamespace

    from draftkit.callbacks.interrupt import InterruptCheckpoint

    cb = InterruptCheckpoint()
    for root in ("runs/a", "runs/b"):
        cb.setup(SimpleNamespace(default_root_dir=str(tmp_path / root)), None, "fit")
        assert cb.ckpt_path == str(tmp_path / root / "interrupted" / "on_exception.ckpt")
    assert cb.dirpath is None  # the option as given
