"""atomic_path / write_json_atomic: content, ordinary permissions, nothing left behind on failure; short_hash."""

import hashlib
import json
import math
import os
from pathlib import Path

import pytest

from draftkit.jsonio import ResumableRecord, atomic_path, short_hash, write_json_atomic


def test_writes_content_with_umask_permissions(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_json_atomic(path, {"tau": 1.5, "alpha": [0.5, 0.25]}, indent=1)
    assert json.loads(path.read_text()) == {"tau": 1.5, "alpha": [0.5, 0.25]}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomic(path, {"tau": 1.0})
    with pytest.raises(ValueError):
        write_json_atomic(path, {"tau": math.nan}, allow_nan=False)
    assert json.loads(path.read_text()) == {"tau": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_resumable_record_round_trip_torn_line_and_other_run(tmp_path):
    path = tmp_path / "run" / "prompts.jsonl"
    header = {"config": {"k": 3, "budgets": (0.1, 0.2)}, "prompts": "abc"}
    rec = ResumableRecord(path, header)
    assert rec.done == {}
    rec.add("eval/0", {"tokens": [1, 2], "kl": [0.5, 0.25]})
    rec.add("eval/1", {"tokens": [3], "kl": [1.0]})
    intact = path.read_bytes()
    os.utime(path, (0, 0))
    assert ResumableRecord(path, header).done.keys() == {"eval/0", "eval/1"}
    assert path.read_bytes() == intact and path.stat().st_mtime == 0  # an intact record is read, not rewritten
    with open(path, "a") as f:
        f.write('{"key": "eval/2", "val')  # killed mid-write
    again = ResumableRecord(path, header)
    assert again.done == {"eval/0": {"tokens": [1, 2], "kl": [0.5, 0.25]}, "eval/1": {"tokens": [3], "kl": [1.0]}}
    assert again.get("eval/2") is None
    again.add("eval/2", {"tokens": [], "kl": []})
    assert list(ResumableRecord(path, header).done) == ["eval/0", "eval/1", "eval/2"]
    assert len(path.read_text().splitlines()) == 4  # header + 3 rows, the torn line gone
    with pytest.raises(ValueError, match="prompts.jsonl: a record of a different run"):
        ResumableRecord(path, {**header, "prompts": "xyz"})
    memory = ResumableRecord(None, header)
    memory.add("a", 1)
    assert memory.get("a") == 1


def test_atomic_path_file_and_folder_replace_or_keep_the_old(tmp_path):
    """A file gets its content and umask permissions; a failed write keeps the old one; a folder replaces the
    old folder whole, every folder and file in it with umask permissions; nothing is left beside either."""
    path = tmp_path / "a.bin"
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        assert tmp.parent == tmp_path and tmp.name.startswith(".a.bin.")
        f.write(b"one")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_bytes(b"two")
        raise RuntimeError("stop")
    assert path.read_bytes() == b"one"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    out = tmp_path / "dir"
    with atomic_path(out, directory=True) as tmp:
        (tmp / "old.txt").write_text("old")
    with atomic_path(out, directory=True) as tmp:
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "new.txt").write_text("new")
        (tmp / "sub" / "new.txt").chmod(0o600)  # as safetensors' save_file leaves a file
    assert [p.stat().st_mode & 0o777 for p in (out, out / "sub", out / "sub" / "new.txt")] == [
        0o777 & ~umask, 0o777 & ~umask, 0o666 & ~umask]
    with pytest.raises(RuntimeError), atomic_path(out, directory=True) as tmp:
        (tmp / "half.txt").write_text("x")
        raise RuntimeError("stop")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["sub", "sub/new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "dir"]


def test_atomic_folder_rename_failure_puts_the_old_folder_back(tmp_path, monkeypatch):
    """When the final rename of a new folder fails, the old folder is back at its path, whole, and neither the
    new temporary nor the moved-aside copy is left beside it."""
    out = tmp_path / "export"
    with atomic_path(out, directory=True) as tmp:
        (tmp / "model.safetensors").write_text("old")
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(src).name.startswith(".export.") and not Path(src).name.startswith(".export.old-"):
            raise OSError("rename failed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"), atomic_path(out, directory=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert (out / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_short_hash_is_sha256_of_sorted_json_or_of_bytes():
    """16 hex digits of sha256 over json.dumps(sort_keys=True) (a str as its JSON string), or over raw bytes."""
    assert short_hash({"b": 1, "a": [1, 2]}) == hashlib.sha256(b'{"a": [1, 2], "b": 1}').hexdigest()[:16]
    assert short_hash("x") == hashlib.sha256(b'"x"').hexdigest()[:16]
    assert short_hash(b"x") == hashlib.sha256(b"x").hexdigest()[:16] == "2d711642b726b044"
    assert short_hash({"p": Path("/a")}) == short_hash({"p": "/a"})  # default=str


def test_atomic_leftovers_names_only_the_temporaries_of_that_name(tmp_path):
    """atomic_path's temporaries are ``.<name>.XXXX`` beside the target: a killed writer's are found by name (glob
    characters literal), never the target, another name's temporary or a folder."""
    from draftkit.jsonio import atomic_leftovers, atomic_path

    with atomic_path(tmp_path / "a[1].jsonl") as tmp:  # the real naming, not a copy of it
        left = tmp.name
        tmp.write_text("x")
    (tmp_path / left).write_text("a killed writer's")
    for name in ("a[1].jsonl", ".b.jsonl.q9", ".a1.jsonl.z"):
        (tmp_path / name).write_text("x")
    (tmp_path / ".a[1].jsonl.dir").mkdir()
    assert [p.name for p in atomic_leftovers(tmp_path, "a[1].jsonl")] == [left]
    assert sorted(p.name for p in atomic_leftovers(tmp_path)) == sorted([left, ".b.jsonl.q9", ".a1.jsonl.z"])
