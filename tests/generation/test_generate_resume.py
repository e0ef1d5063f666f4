"""``draftkit generate`` resume re-checks every finished shard part against its index entry (case x09)."""

import json
from collections import namedtuple

import pytest

from draftkit.generation.output_file import read_output
from draftkit.generation.regenerate import RegenerateConfig, regenerate
from draftkit.jsonio import InsufficientSpaceError

from tests.generation.test_regenerate import _write_source


def _interrupted(tmp_path, tiny_target_dir, kw):
    src = _write_source(tmp_path / "src.jsonl")
    out = tmp_path / "torn.jsonl"
    calls = []

    def crash():
        calls.append(1)
        if len(calls) == 3:  # one batch per shard: shards 0 and 1 are finished, shard 2 is cut
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regenerate(str(src), str(out), str(tiny_target_dir), _after_batch=crash, **kw)
    return src, out


@pytest.mark.parametrize("tear", ["half", "drop_newline", "other_id"])
def test_a_torn_finished_shard_is_decoded_again(tmp_path, tiny_target_dir, tear):
    cfg = RegenerateConfig(max_new_tokens=5, max_prompt_tokens=200)
    kw = dict(cfg=cfg, dtype="float32", batch_size=3, shard_size=3)
    whole = tmp_path / "whole.jsonl"
    src = _write_source(tmp_path / "src.jsonl")
    regenerate(str(src), str(whole), str(tiny_target_dir), **kw)
    src, out = _interrupted(tmp_path, tiny_target_dir, kw)
    parts = tmp_path / "torn.jsonl.parts"
    index = json.loads((parts / "index.json").read_text())
    assert sorted(index["shards"]) == ["0", "1"]
    part = parts / "shard-00000.jsonl"
    data = part.read_bytes()
    assert data.count(b"\n") == 3
    if tear == "half":
        part.write_bytes(data[: len(data) // 2])
    elif tear == "drop_newline":
        part.write_bytes(data[:-1])
    else:
        part.write_bytes(data.replace(b'"id": "c0"', b'"id": "zz"'))
    later = []
    regenerate(str(src), str(out), str(tiny_target_dir), _after_batch=lambda: later.append(1), **kw)
    assert len(later) == 2  # shard 0 (redone) and shard 2; shard 1 was intact and kept
    assert out.read_bytes() == whole.read_bytes()
    header, shards = read_output(out)
    assert header["source_ids"] == [f"c{i}" for i in range(7)]
    assert sum(len(lines) for lines in shards.values()) == 7 == len(out.read_text().splitlines()) - 1
    assert not parts.exists()


def test_generate_refuses_a_full_disk_before_writing(tmp_path, tiny_target_dir, monkeypatch):
    src = _write_source(tmp_path / "src.jsonl")
    out = tmp_path / "o" / "full.jsonl"
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda p: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(InsufficientSpaceError, match=r"generate: shard part: not enough free space in .*full\.jsonl\.parts.*bytes needed"):
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=3, max_prompt_tokens=200),
                   dtype="float32", batch_size=3, shard_size=3)
    assert not out.exists() and not list((tmp_path / "o" / "full.jsonl.parts").glob("shard-*"))


@pytest.mark.parametrize("damage", ["not json", "a list"])
def test_an_unreadable_shard_index_is_named_and_overwrite_restarts(tmp_path, tiny_target_dir, damage):
    """A damaged ``<output>.parts/index.json`` stopped generate with json's bare "Expecting property name ..." (or
    an AttributeError), naming no file."""
    src = _write_source(tmp_path / "src.jsonl")
    out = tmp_path / "o.jsonl"
    index = tmp_path / "o.jsonl.parts" / "index.json"
    index.parent.mkdir()
    index.write_text("{bad" if damage == "not json" else "[1, 2]")
    kw = dict(cfg=RegenerateConfig(max_new_tokens=3, max_prompt_tokens=200), dtype="float32", shard_size=3)
    why = ("JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
           if damage == "not json" else "no JSON object")
    with pytest.raises(ValueError) as err:
        regenerate(str(src), str(out), str(tiny_target_dir), **kw)
    assert str(err.value) == (f"{index} is not a generate shard index ({why}); restore it, or pass --overwrite to "
                              "restart (the shards beside it are decoded again)")
    assert not out.exists()
    regenerate(str(src), str(out), str(tiny_target_dir), overwrite=True, **kw)
    assert read_output(out)[0]["counts"]["records"] == 7 and not index.parent.exists()


def test_a_file_where_the_shards_go_is_named(tmp_path, tiny_target_dir):
    src = _write_source(tmp_path / "src.jsonl")
    (tmp_path / "o.jsonl.parts").write_text("not a folder")
    with pytest.raises(FileExistsError) as err:
        regenerate(str(src), str(tmp_path / "o.jsonl"), str(tiny_target_dir), RegenerateConfig(max_new_tokens=3),
                   dtype="float32")
    assert str(err.value) == (f"{tmp_path / 'o.jsonl.parts'} is a file, where generate keeps the shards of --output "
                              f"{tmp_path / 'o.jsonl'}: move it away, or write another --output")


_HOLD = ("import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, sys.argv[2].encode())\n"
         "print('held', flush=True)\n"
         "time.sleep(600)\n")


def test_a_second_generate_of_the_same_output_stops_at_once(tmp_path, tiny_target_dir, monkeypatch):
    """Two generate runs of one output at once both decoded every shard; the first to finish removed the parts and
    the other stopped with "[Errno 2] No such file or directory: '...parts/shard-00000.jsonl'". Now the second is
    refused naming the first, which holds the lock (``flock``); once that process is killed (-9), its lock file is
    taken over."""
    import socket
    import subprocess
    import sys

    src = _write_source(tmp_path / "src.jsonl")
    out = tmp_path / "o.jsonl"
    lock = tmp_path / "o.jsonl.parts" / "lock"
    lock.parent.mkdir()
    host = socket.gethostname()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock), f"{host} 4242"], stdout=subprocess.PIPE,
                              text=True)
    import draftkit.generation.regenerate as regen

    opened = regen._open_engine
    try:
        assert holder.stdout.readline().strip() == "held"
        kw = dict(cfg=RegenerateConfig(max_new_tokens=3, max_prompt_tokens=200), dtype="float32", shard_size=3)
        # refused before the target loads (a large target on a shared GPU would load, or run out of memory, first)
        monkeypatch.setattr(regen, "_open_engine", lambda *a, **k: pytest.fail("the target was loaded"))
        with pytest.raises(FileExistsError) as err:
            regenerate(str(src), str(out), str(tiny_target_dir), **kw)
        assert str(err.value) == (
            f"--output {out} is being written by another draftkit generate (process 4242 on {host}, {lock}); wait "
            "for it to finish (this command then finds the file done), or stop it")
        assert lock.read_text() == f"{host} 4242" and not out.exists()
        (lock.parent / "shard-00000.jsonl").write_text("the other run's\n")
        with pytest.raises(FileExistsError, match="is being written by another draftkit generate"):
            regenerate(str(src), str(out), str(tiny_target_dir), overwrite=True, **kw)  # --overwrite removes nothing
        assert (lock.parent / "shard-00000.jsonl").read_text() == "the other run's\n"
    finally:
        holder.kill()  # as kill -9: the lock file stays, naming it; the kernel released its flock
        holder.wait()
    assert lock.read_text() == f"{host} 4242"

    def fails(*a, **k):
        raise RuntimeError("the engine failed to start")

    monkeypatch.setattr(regen, "_open_engine", fails)  # a run that fails after claiming gives the claim up
    with pytest.raises(RuntimeError, match="the engine failed to start"):
        regenerate(str(src), str(out), str(tiny_target_dir), overwrite=True, **kw)
    monkeypatch.setattr(regen, "_open_engine", opened)  # so the next run in this same process is not refused
    regenerate(str(src), str(out), str(tiny_target_dir), overwrite=True, **kw)
    assert read_output(out)[0]["counts"]["records"] == 7 and not lock.parent.exists()


def test_runs_taking_over_one_ended_lock_at_once_leave_exactly_one_holder(tmp_path):
    """The pid-based take-over let two runs that found one ended holder in the same instant both unlink and create
    the lock, both holding it (one unlinked the lock the other had just created; a slow ``unlink`` widens that
    window here); with ``flock`` exactly one of eight simultaneous claimants holds it."""
    import socket
    import subprocess
    import sys

    parts = tmp_path / "o.jsonl.parts"
    parts.mkdir()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (parts / "lock").write_text(f"{socket.gethostname()} {ended.stdout.strip()}")  # a holder that has ended
    claim = ("import sys, time\n"
             "from pathlib import Path\n"
             "from draftkit.generation.output_file import Parts\n"
             "slow = Path.unlink\n"
             "Path.unlink = lambda self, *a, **k: (time.sleep(0.5), slow(self, *a, **k))[1]  # a slow file system\n"
             "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
             "try:\n"
             "    p = Parts(Path(sys.argv[1]))\n"
             "except FileExistsError:\n"
             "    print('refused', flush=True); sys.exit(0)\n"
             "print('held', flush=True)\n"
             "time.sleep(3)\n")
    import time

    start = str(time.time() + 4.0)  # every claimant imports first, then all claim in the same instant
    procs = [subprocess.Popen([sys.executable, "-c", claim, str(tmp_path / "o.jsonl"), start], stdout=subprocess.PIPE,
                              text=True) for _ in range(8)]
    said = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert said == ["held"] + ["refused"] * 7


def test_an_interrupted_run_leaves_its_shards_but_not_its_lock(tmp_path, tiny_target_dir):
    kw = dict(cfg=RegenerateConfig(max_new_tokens=5, max_prompt_tokens=200), dtype="float32", batch_size=3,
              shard_size=3)
    _, out = _interrupted(tmp_path, tiny_target_dir, kw)
    assert sorted(p.name for p in (tmp_path / "torn.jsonl.parts").iterdir()) == [
        "index.json", "shard-00000.jsonl", "shard-00001.jsonl"]


def test_temporaries_of_a_killed_run_are_removed(tmp_path, tiny_target_dir):
    """A run killed with -9 while writing the output file (or a part, or the index) left its ``atomic_path``
    temporary (``.o.jsonl.XXXX``) beside them for good; the next run of the same output removes them and writes the
    same file as a run that was never killed."""
    src = _write_source(tmp_path / "src.jsonl")
    kw = dict(cfg=RegenerateConfig(max_new_tokens=3, max_prompt_tokens=200), dtype="float32", shard_size=3)
    regenerate(str(src), str(tmp_path / "clean.jsonl"), str(tiny_target_dir), **kw)
    out = tmp_path / "o[1].jsonl"  # glob characters in the name are plain text
    parts = tmp_path / "o[1].jsonl.parts"
    parts.mkdir()
    torn = [tmp_path / ".o[1].jsonl.k9x2ab", parts / ".shard-00000.jsonl.q1w2e3", parts / ".index.json.zz9"]
    for path in torn:
        path.write_text("half a write")
    other = tmp_path / ".other.jsonl.k9x2ab"  # another output's: not this run's to remove
    other.write_text("kept")
    regenerate(str(src), str(out), str(tiny_target_dir), **kw)
    assert [p.exists() for p in torn] == [False, False, False] and other.read_text() == "kept"
    assert out.read_bytes() == (tmp_path / "clean.jsonl").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.jsonl.k9x2ab", "clean.jsonl", "o[1].jsonl", "src.jsonl"]


@pytest.mark.parametrize("content", ["", "no-pid-here", "host notanumber"])
def test_a_damaged_lock_is_taken_over(tmp_path, tiny_target_dir, content):
    """A lock file that names no process (empty: killed between creating and writing it; or garbage) is taken over,
    as a lock of an ended process is."""
    src = _write_source(tmp_path / "src.jsonl")
    out = tmp_path / "o.jsonl"
    lock = tmp_path / "o.jsonl.parts" / "lock"
    lock.parent.mkdir()
    lock.write_text(content)
    kw = dict(cfg=RegenerateConfig(max_new_tokens=3, max_prompt_tokens=200), dtype="float32", shard_size=3)
    regenerate(str(src), str(out), str(tiny_target_dir), **kw)
    assert read_output(out)[0]["counts"]["records"] == 7 and not lock.parent.exists()
