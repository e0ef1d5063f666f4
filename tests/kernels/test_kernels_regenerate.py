"""Kernels in regeneration (issue 35): ``regenerate(kernels=onednn)`` packs the target and writes the file that
``kernels=stock`` writes, byte for byte (the same greedy tokens, header and ``settings`` hash), and each resumes
the other's shards."""

from __future__ import annotations

import json

import pytest

from draftkit.generation.regenerate import RegenerateConfig, regenerate
from draftkit.kernels import linears as kernels

needs_onednn = pytest.mark.skipif(not kernels._onednn_available(), reason="torch without oneDNN")


def _source(path, n=5):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}" + " more" * i},
                                                            {"role": "assistant", "content": f"answer {i}"}]}) + "\n")
    return path


@needs_onednn
def test_onednn_and_stock_write_the_same_file(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setattr(kernels, "PACK_MIN_ELEMENTS", 0)  # the tiny target's weights are under the size floor
    calls = []
    real = kernels._packed_linear
    monkeypatch.setattr(kernels, "_packed_linear", lambda *a: calls.append(1) or real(*a))
    src = _source(tmp_path / "src.jsonl")
    kw = dict(cfg=RegenerateConfig(max_new_tokens=8), dtype="float32", batch_size=2, shard_size=2)
    runs = {}
    for kernel in ("onednn", "stock"):
        out = tmp_path / f"{kernel}.jsonl"
        before = len(calls)
        runs[kernel] = regenerate(str(src), str(out), str(tiny_target_dir), kernels=kernel, **kw)
        runs[kernel]["packed_calls"] = len(calls) - before
    assert runs["onednn"]["kernels"]["kernel"] == "onednn"
    assert runs["onednn"]["kernels"]["packed_linears"] == 8 * 7 + 1  # every projection and the LM head
    assert runs["onednn"]["packed_calls"] > 0
    assert runs["stock"]["kernels"]["packed_linears"] == 0 and runs["stock"]["packed_calls"] == 0
    assert (tmp_path / "onednn.jsonl").read_bytes() == (tmp_path / "stock.jsonl").read_bytes()
    assert runs["onednn"]["settings"] == runs["stock"]["settings"]
    assert "kernels" not in json.loads((tmp_path / "stock.jsonl").read_text().splitlines()[0])["header"]
    assert runs["stock"]["counts"]["records"] == 5 and runs["stock"]["counts"]["new_tokens"] > 5

    # a stock run interrupted in its second shard (one batch per shard) resumes under onednn into the same file
    batches = []

    def crash():
        batches.append(1)
        if len(batches) == 2:
            raise KeyboardInterrupt

    resumed = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(str(src), str(resumed), str(tiny_target_dir), kernels="stock", _after_batch=crash, **kw)
    assert sorted(p.name for p in (tmp_path / "resumed.jsonl.parts").iterdir()) == ["index.json", "shard-00000.jsonl"]
    later = []
    regenerate(str(src), str(resumed), str(tiny_target_dir), kernels="onednn", _after_batch=lambda: later.append(1),
               **kw)
    assert len(later) == 2  # shards 1 and 2 decoded, shard 0 reused
    assert resumed.read_bytes() == (tmp_path / "stock.jsonl").read_bytes()


def test_bad_kernels_option_writes_nothing(tmp_path, tiny_target_dir):
    src = _source(tmp_path / "src.jsonl")
    out = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="kernels must be one of auto, onednn, stock, got 'fast'"):
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=2), dtype="float32",
                   kernels="fast")
    assert list(tmp_path.iterdir()) == [src]
