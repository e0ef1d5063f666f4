"""User errors of the head verbs (cases x15, x11): one line, exit 2, the same checked error for every verb."""

from __future__ import annotations

import json
from collections import namedtuple

import torch

from draftkit.commands import main

Usage = namedtuple("Usage", "total used free")


def _mismatched(tiny_checkpoint, tmp_path):
    """The x15 checkpoint: meta says draft_vocab_size 320 (V), the tensors hold 96 rows."""
    path, _ = tiny_checkpoint
    c = torch.load(path, weights_only=False)
    c["draftkit"]["head_config"]["draft_vocab_size"] = 320
    bad = tmp_path / "vd-mismatch.ckpt"
    torch.save(c, bad)
    return bad


def test_evaluate_and_export_give_the_same_checked_error_for_a_vocab_mismatch(tiny_checkpoint, tmp_path, capsys):
    bad = _mismatched(tiny_checkpoint, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    rc_eval = main(["evaluate", "--checkpoint", str(bad), "--prompts", str(prompts), "--output",
                    str(tmp_path / "r.json"), "--k", "3", "--max_new_tokens", "4"])
    err_eval = capsys.readouterr().err.strip().splitlines()
    rc_export = main(["export", str(bad), str(tmp_path / "exp"), "--to", "vllm"])
    err_export = capsys.readouterr().err.strip().splitlines()
    expected = (f"checkpoint {bad}: lm_head.weight has shape (96, 64), expected (320, 64) from its stored "
                "head_config")
    assert rc_eval == rc_export == 2
    assert err_eval[-1].startswith(f"draftkit evaluate: error: {expected}")
    assert err_export[-1].startswith(f"draftkit export: error: {expected}")
    assert not any("Traceback" in line for line in err_eval + err_export)
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "exp").exists()


def test_export_into_a_full_disk_names_the_directory_and_bytes_and_leaves_nothing(tiny_checkpoint, tmp_path,
                                                                                 capsys, monkeypatch):
    path, _ = tiny_checkpoint
    seen = []

    def usage(p):
        seen.append(str(p))
        return Usage(10**9, 10**9 - 50_000, 50_000)

    monkeypatch.setattr("shutil.disk_usage", usage)
    out = tmp_path / "small" / "exp"
    assert main(["export", str(path), str(out), "--to", "vllm", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"draftkit export: error: export to {out}: not enough free space in {out.parent}")
    to_write = int(err.split(" to write plus a margin")[0].rsplit("(", 1)[1])
    needed = int(err.split(" bytes needed")[0].rsplit(" ", 1)[1])
    assert needed == int(to_write + (1 << 20) + 0.05 * to_write) and "50000 free" in err
    state = torch.load(path, weights_only=False)["state_dict"]
    head_bytes = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in state.values())
    assert head_bytes <= to_write < head_bytes + 20_000  # the float32 tensors plus headers and JSON
    assert seen and not (out.parent.exists() and list(out.parent.iterdir()))  # nothing written


def test_export_fits_when_the_disk_has_room(tiny_checkpoint, tmp_path, monkeypatch):
    path, _ = tiny_checkpoint
    monkeypatch.setattr("shutil.disk_usage", lambda p: Usage(10**12, 0, 10**12))
    assert main(["export", str(path), str(tmp_path / "exp"), "--to", "vllm", "--dtype", "float32"]) == 0
    assert (tmp_path / "exp" / "model.safetensors").is_file()
