"""The offline hidden-state cache re-checks every finished shard against its index on resume and rewrites a torn
one; the resumed cache passes the readers' own check with every row (issue 30 item 5)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftkit.data.hidden_cache import HiddenStateCache
from draftkit.generation.hidden_states import write_hidden_states

FP = {"target": "t", "target_config": "c", "target_dtype": "bfloat16", "aux_layer_ids": [1, 2], "tokenizer": "k", "data": "d"}
H = 4


def _rows(n=9):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = int(torch.randint(2, 12, (1,), generator=gen))
        out.append({"input_ids": torch.randint(0, 50, (t,), generator=gen).tolist(),
                    "loss_mask": torch.randint(0, 2, (t,), generator=gen).tolist()})
    return out


def _forward(ids, attn):
    b, t = ids.shape
    aux = (ids[..., None] * 0.5 + torch.arange(8)) * attn[..., None]
    last = (-ids[..., None].float()).expand(b, t, H) + torch.arange(t)[None, :, None]
    return aux, last


def _write(out, **kw):
    rows = _rows()
    return write_hidden_states(out, {"train": rows, "val": rows[:2]}, FP, _forward, H, 2, batch_size=3,
                               shard_tokens=20, **kw)


@pytest.mark.parametrize("tear", ["half", "last_bytes", "other_shard"])
def test_a_torn_finished_shard_is_rewritten_on_resume(tmp_path, tear):
    root = tmp_path / "c"
    _write(root)
    files = sorted(root.glob("train-*.safetensors"))
    assert len(files) >= 3
    before = {f.name: {k: v.clone() for k, v in load_file(f).items()} for f in files}  # not views of the mmap
    torn = files[1]
    data = torn.read_bytes()
    if tear == "half":
        torn.write_bytes(data[: len(data) // 2])
    elif tear == "last_bytes":
        torn.write_bytes(data[:-1])
    else:
        shutil.copyfile(files[0], torn)  # a whole shard, but not the one the index lists
    plans = []
    stats = _write(root, on_plan=plans.append)
    assert plans[0]["shards_todo"] == 1 and plans[0]["shards_done"] == len(files)  # the others + the val shard
    index = json.loads((root / "index.json").read_text())
    assert stats["tokens_written"] == index["splits"]["train"]["shards"][1]["num_tokens"] and index["complete"]
    after = load_file(torn)
    assert all(torch.equal(after[k], before[torn.name][k]) for k in before[torn.name])
    cache = HiddenStateCache(root)
    cache.verify("train")
    assert len(cache.dataset("train")) == 9 and len(cache.dataset("val")) == 2


def test_the_cache_checks_free_space_before_writing(tmp_path, monkeypatch):
    import draftkit.generation.hidden_states as offline

    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(offline.shutil, "disk_usage", lambda p: real._replace(free=100))
    with pytest.raises(OSError, match=r"not enough disk .* bytes/token x \d+ tokens"):
        _write(tmp_path / "c")
    assert not (tmp_path / "c").exists()
