"""The prompts a head trained on travel with it (checkpoint, export), and a run continuing it (``model.init_head``,
handed to ``ChatDataModule.hold_out_head``) keeps them out of validation, also on resume (``draftkit.data.trained_prompts``)."""

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from draftkit.commands import main
from draftkit.data.datamodule import ChatDataModule
from draftkit.data.splits import normalize_prompt
from draftkit.data.trained_prompts import (
    CHECKPOINT_KEY, EXPORT_FILE, SCHEME, hash_each, prompt_hashes, read_trained_prompts, write_trained_prompts,
)
from draftkit.fit_run import HELD_OUT_KEY

REPO = Path(__file__).resolve().parents[2]
TINY = ["fit", "--recipe", "recipes/tiny-debug.yaml", "--trainer.enable_progress_bar", "false"]


def _chat_file(path: Path, prompts: list[str]) -> Path:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": f"answer number {i}"}]
            f.write(json.dumps({"id": f"r{i}", "messages": msgs}) + "\n")
    return path


def test_hashes_are_the_first_8_bytes_of_blake2b_signed_sorted_and_distinct():
    keys = ["write a poem", "explain rope", "write a poem", ""]
    each = hash_each(keys)
    plain = [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little", signed=True) for k in keys]
    assert each.dtype == torch.int64 and each.tolist() == plain
    assert prompt_hashes(keys).tolist() == sorted(set(plain)) and len(prompt_hashes(keys)) == 3


def test_an_export_directory_round_trips_and_a_bad_record_is_named(tmp_path):
    from safetensors.torch import save_file

    hashes = prompt_hashes(["a", "b", "c"])
    write_trained_prompts(tmp_path, hashes)
    # in a subfolder: vLLM loads every *.safetensors at the top of a head's folder as weights
    assert (tmp_path / EXPORT_FILE).parent != tmp_path and not list(tmp_path.glob("*.safetensors"))
    assert torch.equal(read_trained_prompts(tmp_path), hashes)
    unsorted = tmp_path / "unsorted"
    (unsorted / EXPORT_FILE).parent.mkdir(parents=True)
    save_file({"prompt_hashes": hashes.flip(0).repeat(2)}, str(unsorted / EXPORT_FILE), metadata={"scheme": SCHEME})
    assert torch.equal(read_trained_prompts(unsorted), hashes)  # sorted and distinct, whatever wrote it
    empty = tmp_path / "old-export"
    empty.mkdir()
    assert read_trained_prompts(empty) is None  # an export of a draftkit before the record
    with pytest.raises(FileNotFoundError, match="model.init_head .*no-such does not exist"):
        read_trained_prompts(tmp_path / "no-such")
    (empty / EXPORT_FILE).parent.mkdir()
    cases = [
        (lambda f: save_file({"prompt_hashes": torch.zeros(2, 2, dtype=torch.int64)}, str(f), metadata={"scheme": SCHEME}),
         "is not a 1-D int64 tensor of prompt hashes"),
        (lambda f: save_file({"prompt_hashes": hashes}, str(f), metadata={"scheme": "md5 of the raw prompt"}),
         "hashes prompts by 'md5 of the raw prompt', this draftkit by"),
        (lambda f: f.write_bytes(b"\x10" * 100), "is not a readable record of trained prompts"),
    ]
    for write, why in cases:
        write(empty / EXPORT_FILE)
        with pytest.raises(ValueError, match=why) as err:
            read_trained_prompts(empty)
        assert str(empty / EXPORT_FILE) in str(err.value) and "re-export the head from its training .ckpt" in str(err.value)


def test_the_split_keeps_the_head_s_prompts_out_of_validation(tmp_path, tiny_target_dir, monkeypatch):
    """40 prompts, 30 of them trained by the head: validation draws from the other 10 only, the 30 train, and the
    run's trained set is the union; without the head the same seed validates on some of the 30."""
    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    prompts = [f"Write a short story about topic {i}" for i in range(40)]
    path = _chat_file(tmp_path / "chat.jsonl", prompts)
    head = tmp_path / "head"
    head.mkdir()
    seen_keys = [normalize_prompt(p) for p in prompts[:30]] + ["a prompt only the head saw"]
    write_trained_prompts(head, prompt_hashes(seen_keys))
    key_of = {f"r{i}": normalize_prompt(p) for i, p in enumerate(prompts)}

    plain = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=3)
    plain.setup()
    assert {key_of[r] for r in plain.val_set["record"]} & set(seen_keys)  # the seed would validate on seen prompts

    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=3)
    dm.hold_out_head(str(head))
    dm.setup()
    val = {key_of[r] for r in dm.val_set["record"]}
    train = {key_of[r] for r in dm.train_set["record"]}
    assert len(val) == 8 and not val & set(seen_keys) and not val & train
    assert set(seen_keys[:30]) <= train and len(train) == 32
    assert dm.stats["trained_by_init_head"] == 30
    assert torch.equal(dm.trained_prompts(), prompt_hashes(seen_keys + sorted(train)))
    assert dm.fingerprint() != plain.fingerprint()  # a hidden-state cache of the plain split is not this one's

    # 10 unseen prompts cannot hold out 12: the error names the head and what to do
    short = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=12, seed=3)
    short.hold_out_head(str(head))
    with pytest.raises(ValueError, match=r"whose prompt model.init_head .*head did not train on \(10; 30 more have a "
                                         r"prompt it trained on and only train\); lower data.val_size or add "
                                         "conversations the head has not seen"):
        short.setup()

    # a head that trained on none of these prompts splits as no head does: the same hidden-state cache serves both
    other = tmp_path / "other-head"
    other.mkdir()
    write_trained_prompts(other, prompt_hashes(["a prompt of other data entirely"]))
    unrelated = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=3)
    unrelated.hold_out_head(str(other))
    unrelated.setup()
    assert unrelated.val_set["record"] == plain.val_set["record"] and unrelated.fingerprint() == plain.fingerprint()


def test_a_head_without_the_record_is_named_and_splits_as_before(tmp_path, tiny_target_dir, monkeypatch, caplog):
    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    path = _chat_file(tmp_path / "chat.jsonl", [f"Write a short story about topic {i}" for i in range(40)])
    old = tmp_path / "old-head"
    old.mkdir()
    plain = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=3)
    plain.setup()
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=3)
    dm.hold_out_head(str(old))
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert f"model.init_head {old} records no training prompts" in caplog.text
    assert dm.val_set["record"] == plain.val_set["record"] and dm.fingerprint() == plain.fingerprint()


def test_fit_records_export_carries_and_a_continued_run_validates_on_unseen_prompts(tmp_path, monkeypatch):
    """End to end on the tiny recipe: the first run's checkpoint records its training prompts, export writes them,
    a run continuing the exported head on the same data validates on none of them and records the union, and its
    resume keeps that split after the head is gone (the checkpoint holds what it kept out)."""
    monkeypatch.chdir(REPO)
    first = tmp_path / "first"
    assert main(TINY + ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                        "--trainer.default_root_dir", str(first)]) == 0
    ckpt = first / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    rows = [json.loads(line) for line in open(REPO / "recipes" / "data" / "tiny-chat.jsonl")]
    key_of = {f"line {n}": normalize_prompt(next(m["content"] for m in r["messages"] if m["role"] == "user"))
              for n, r in enumerate(rows, 1)}  # the records have no id: named by line
    cli_first = _datamodule(["--trainer.default_root_dir", str(first)])
    first_train = {key_of[r] for r in cli_first.train_set["record"]}
    first_val = {key_of[r] for r in cli_first.val_set["record"]}
    recorded = torch.load(ckpt, weights_only=False)[CHECKPOINT_KEY]["hashes"]
    assert torch.equal(recorded, prompt_hashes(first_train)) and HELD_OUT_KEY not in torch.load(ckpt, weights_only=False)

    exp = tmp_path / "exp"
    assert main(["export", str(ckpt), str(exp), "--to", "vllm", "--dtype", "float32"]) == 0
    assert torch.equal(read_trained_prompts(exp), recorded)
    assert json.loads((exp / "draftkit_export.json").read_text())["trained_prompts"] == len(recorded)

    nxt = tmp_path / "next"
    cont = ["--model.init_head", str(exp), "--data.val_size", "4", "--trainer.default_root_dir", str(nxt)]
    assert main(TINY + cont + ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]) == 0
    dm = _datamodule(cont)
    val = {key_of[r] for r in dm.val_set["record"]}
    assert len(dm.val_set) == 4 and val <= first_val and not val & first_train
    last = nxt / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=False)
    assert torch.equal(state[HELD_OUT_KEY]["hashes"], recorded)
    train = {key_of[r] for r in dm.train_set["record"]}
    assert torch.equal(state[CHECKPOINT_KEY]["hashes"], prompt_hashes(first_train | train))

    # the head goes away: the resume keeps the split from the checkpoint (a changed split would change the batches)
    exp.rename(tmp_path / "gone")
    assert main(TINY + cont + ["--trainer.max_steps", "3", "--trainer.val_check_interval", "2",
                               "--ckpt_path", str(last)]) == 0
    resumed = torch.load(last, weights_only=False)
    assert resumed["global_step"] == 3 and torch.equal(resumed[HELD_OUT_KEY]["hashes"], recorded)
    assert torch.equal(resumed[CHECKPOINT_KEY]["hashes"], state[CHECKPOINT_KEY]["hashes"])


def test_the_head_is_named_once_by_model_init_head(tmp_path, monkeypatch, capsys):
    """``model.init_head`` is the one option: a ``data.init_head`` (the datamodule has none) is refused by the parser
    naming it, as any unknown key."""
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        main(TINY + ["--data.init_head", str(tmp_path), "--trainer.default_root_dir", str(tmp_path / "r")])
    assert exit_.value.code == 2
    assert f"unrecognized arguments: --data.init_head {tmp_path}" in capsys.readouterr().err


def _datamodule(extra: list[str]):
    from draftkit.cli import DraftkitCLI

    cli = DraftkitCLI(args=TINY[1:] + extra, run=False)
    cli.datamodule.setup("fit")
    return cli.datamodule
