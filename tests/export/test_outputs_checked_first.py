"""Verbs check the file they will write before the long work (issue 55): ``evaluate --output`` naming a directory
or a folder where no file can be created failed only after decoding every prompt, naming a temporary file."""

from __future__ import annotations

import json
import os

import pytest

from draftkit.commands import main
from draftkit.jsonio import check_writable


def test_check_writable_leaves_nothing(tmp_path):
    check_writable(tmp_path / "a" / "b" / "r.json", "--output")  # a folder to be created: fine
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=f"--output {tmp_path} is a directory; give a file path"):
        check_writable(tmp_path, "--output")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores modes: a folder under /proc refuses every new file
            locked = "/proc/draftkit-test"
        with pytest.raises(OSError, match=r"--output .*r.json: no file can be created in "):
            check_writable(f"{locked}/r.json", "--output")
    finally:
        (tmp_path / "locked").chmod(0o700)


def test_evaluate_refuses_a_directory_output_before_decoding(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    path, _ = tiny_checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    decoded = []
    monkeypatch.setattr("draftkit.decoding.harness.evaluate_head", lambda *a, **k: decoded.append(1))
    assert main(["evaluate", "--checkpoint", str(path), "--prompts", str(prompts), "--output", str(tmp_path),
                 "--k", "2", "--max_new_tokens", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"draftkit evaluate: error: --output {tmp_path} is a directory; give a file path")
    assert decoded == []


def test_generate_refuses_an_unwritable_output_before_the_target_loads(tmp_path, capsys, monkeypatch):
    """generate --output in a read-only folder loaded the target, then stopped at the first shard with a bare
    "[Errno 30] Read-only file system: 'ro/gen.jsonl.parts'"; now one line naming --output, before any work."""
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                   + "\n")
    started = []
    monkeypatch.setattr("draftkit.generation.regenerate.regenerate", lambda *a, **k: started.append(1))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        folder = str(locked) if not os.access(locked, os.W_OK) else "/proc"  # root ignores modes; /proc refuses
        out = f"{folder}/draftkit-test/gen.jsonl"
        assert main(["generate", "--source", str(src), "--target", "tiny:llama", "--output", out]) == 2
    finally:
        locked.chmod(0o700)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"draftkit generate: error: --output {out}: no file can be created in {folder} (")
    assert started == []


def test_output_directories_under_a_file_or_in_a_read_only_folder(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """export and cache-hidden-states stopped after reading the checkpoint or loading the target with
    "[Errno 30] Read-only file system: '.../.x-vllm.uhhxd_os'" (a temporary name), "[Errno 17] File exists: 'keep'"
    (a file where a folder should be) or "[Errno 20] Not a directory"; now one line naming the option, first."""
    path, _ = tiny_checkpoint
    keep = tmp_path / "keep"
    keep.write_text("x")
    with pytest.raises(ValueError, match=f"--output {keep} is a file; give a directory path"):
        check_writable(keep, "--output", directory=True)
    with pytest.raises(OSError, match=rf"--output {keep}/sub: no file can be created in {keep} \(a file, not a folder\)"):
        check_writable(keep / "sub", "--output", directory=True)
    read, loaded = [], []
    monkeypatch.setattr("draftkit.export.exporter.read_checkpoint", lambda *a, **k: read.append(1))
    monkeypatch.setattr("draftkit.cli.DraftkitCLI", lambda *a, **k: loaded.append(1))
    for out in (keep / "sub", "/proc/draftkit-test/x"):
        assert main(["export", str(path), str(out), "--to", "vllm"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
            f"draftkit export: error: export directory {out}: no file can be created in ")
        assert main(["cache-hidden-states", "--recipe", "recipes/tiny-debug.yaml", "--output", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
            f"draftkit cache-hidden-states: error: --output {out}: no file can be created in ")
    assert main(["cache-hidden-states", "--recipe", "recipes/tiny-debug.yaml", "--output", str(keep)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--output {keep} is a file; give a directory path")
    assert read == [] and loaded == []
