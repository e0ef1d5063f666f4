"""``model.init_head``: a new run starting from a trained head's weights and draft vocab map, to continue it on
other data (issue 55 / 52 item 5: ``--ckpt_path`` rightly refuses a new ``data.path``, and nothing else could
warm-start a run from a head)."""

import json
from pathlib import Path

import torch

from draftkit.cli import DraftkitCLI
from draftkit.commands import main

REPO = Path(__file__).resolve().parents[2]
TINY = ["fit", "--recipe", "recipes/tiny-debug.yaml", "--trainer.enable_progress_bar", "false"]


def _other_data(path: Path) -> Path:
    """Chat records unlike tiny-chat.jsonl: their token counts pick another draft vocab."""
    with open(path, "w") as f:
        for i in range(24):
            msgs = [{"role": "user", "content": f"Question {i}: which number follows {i * 7}?"},
                    {"role": "assistant", "content": f"{i * 7 + 1} follows {i * 7}; {i * 7 + 2} after that."}]
            f.write(json.dumps({"id": f"n{i}", "messages": msgs}) + "\n")
    return path


def test_a_head_continues_on_other_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(TINY + ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                        "--trainer.default_root_dir", str(tmp_path / "first")]) == 0
    ckpt = tmp_path / "first" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    trained = {k[len("head."):]: v for k, v in torch.load(ckpt, weights_only=False)["state_dict"].items()
               if k.startswith("head.")}
    data = _other_data(tmp_path / "other.jsonl")
    new = TINY + ["--data.path", str(data), "--data.val_size", "4", "--trainer.default_root_dir", str(tmp_path / "next")]

    # the new run's head starts as the trained one, vocab map included (its data alone picks another map)
    for init in (str(ckpt), None):
        cli = DraftkitCLI(args=new[1:] + (["--model.init_head", init] if init else []), run=False)
        cli.datamodule.prepare_data()
        cli.datamodule.setup("fit")
        cli.model.build(cli.datamodule)
        state = cli.model.head.state_dict()
        same = [k for k, v in trained.items() if torch.equal(state[k], v)]
        assert (sorted(same) == sorted(trained)) if init else "d2t" not in same
    # and trains on: exit 0, a new run (step count and schedule fresh)
    assert main(new + ["--model.init_head", str(ckpt), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]) == 0
    last = tmp_path / "next" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    continued = torch.load(last, weights_only=False)
    assert continued["global_step"] == 2
    # the trained length is the head's: the first run's 128-token rows, not only this run's shorter ones
    first_length = torch.load(ckpt, weights_only=False)["draftkit"]["trained_length"]
    assert first_length == 128 > max(len(cli.datamodule.train_set[i]["input_ids"]) for i in range(len(cli.datamodule.train_set)))
    assert continued["draftkit"]["trained_length"] == first_length
    # resumed with the same command after the init head moved away: the checkpoint holds the weights and vocab map
    moved = tmp_path / "moved.ckpt"
    ckpt.rename(moved)
    assert main(new + ["--model.init_head", str(ckpt), "--trainer.max_steps", "3", "--trainer.val_check_interval", "2",
                       "--ckpt_path", str(last)]) == 0
    resumed = torch.load(last, weights_only=False)
    assert resumed["global_step"] == 3 and torch.equal(resumed["state_dict"]["head.d2t"], trained["d2t"])
    moved.rename(ckpt)
    # from an export directory too
    assert main(["export", str(ckpt), str(tmp_path / "exp"), "--to", "vllm", "--dtype", "float32"]) == 0
    cli = DraftkitCLI(args=new[1:] + ["--model.init_head", str(tmp_path / "exp")], run=False)
    cli.datamodule.prepare_data()
    cli.datamodule.setup("fit")
    cli.model.build(cli.datamodule)
    assert torch.equal(cli.model.head.fc.weight, trained["fc.weight"])
    assert torch.equal(cli.model.head.d2t, trained["d2t"])
    capsys.readouterr()
    # a head of another draft vocab size: one clear line naming the options, not a size-mismatch traceback
    assert main(new + ["--model.init_head", str(ckpt), "--model.draft_vocab_size", "128"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"draftkit fit: error: model.init_head {ckpt} has a draft vocab of 64 ids, this run "
        "model.draft_vocab_size=128: set model.draft_vocab_size 64 (the head's lm_head rows are its draft ids)")
    # another head variant (the README's command on the plain EAGLE-3 shipped head under the EAGLE-3.1 default):
    # refused with the flags that match the head, before the data is read or the target loaded (minutes on SmolLM2)
    monkeypatch.setattr("draftkit.data.datamodule.ChatDataModule.prepare_data",
                        lambda self: (_ for _ in ()).throw(AssertionError("the data was read")))
    for head in (ckpt, tmp_path / "exp"):
        assert main(new + ["--model.init_head", str(head), "--model.norm_before_fc", "true",
                           "--model.norm_output", "true"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"draftkit fit: error: model.init_head {head}: the head differs from the one this run builds in "
            "norm_before_fc False (this run True); norm_output False (this run True); set the model options to the "
            "head's: --model.norm_before_fc false --model.norm_output false")


def test_an_init_head_that_is_no_head_names_the_option(tmp_path):
    """A recipe or an empty folder given as model.init_head said "checkpoint ... could not be read" or "... is not
    a draftkit export directory", naming no option (the run has several paths)."""
    import pytest

    from draftkit.models.init_head import read_init_head

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-debug.yaml"
    with pytest.raises(ValueError, match=rf"^model\.init_head: checkpoint {recipe} could not be read \("):
        read_init_head(str(recipe), "tiny:llama", [2, 4, 5], 64)
    with pytest.raises(ValueError, match=rf"^model\.init_head: {tmp_path} is not a draftkit export directory"):
        read_init_head(str(tmp_path), "tiny:llama", [2, 4, 5], 64)
