"""The offline hidden-state cache written by several ranks (issue 32 item 5): 2 gloo processes write disjoint
shares whose union equals the 1-process cache byte for byte; a rank that stops is reported on every rank and
a rerun writes only the missing shards; the disk check counts the whole cache before any rank writes."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import draftkit.generation.hidden_states as writer
from draftkit.data.hidden_cache import HiddenStateCache, bytes_per_token, plan_shards
from draftkit.generation.hidden_states import write_hidden_states
from draftkit.testing import end_process_group

FP = {"target": "t", "target_config": "c", "target_dtype": "bfloat16", "aux_layer_ids": [1, 2], "tokenizer": "k", "data": "d"}
H, V = 4, 50  # H_t of the tiny target, its vocab; 2 aux layers -> aux width 8


def _rows(n=13):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = int(torch.randint(2, 12, (1,), generator=gen))
        out.append({"input_ids": torch.randint(0, V, (t,), generator=gen).tolist(),
                    "loss_mask": torch.randint(0, 2, (t,), generator=gen).tolist()})
    return out


class _TinyTarget:
    """A tiny random target (seeded, the same in every process): aux = tanh(E[ids] + P[pos]) (B, T, 8) fp32 and
    last (B, T, H) = aux @ W, values that bf16 rounds, so equal files mean equal computation. ``poison``: a
    token id whose sequences' states come out NaN (a rank that stops); ``calls`` counts sequences run."""

    def __init__(self, poison: int | None = None) -> None:
        gen = torch.Generator().manual_seed(1)
        self.emb, self.pos = torch.randn(V, 8, generator=gen), torch.randn(16, 8, generator=gen)
        self.w = torch.randn(8, H, generator=gen)
        self.poison, self.calls = poison, 0

    def __call__(self, ids, attn):
        self.calls += ids.shape[0]
        aux = torch.tanh(self.emb[ids] + self.pos[: ids.shape[1]]) * attn[..., None]  # (B, T, 8)
        if self.poison is not None:
            aux = torch.where((ids == self.poison).any(1)[:, None, None], float("nan"), aux)
        return aux, aux @ self.w  # (B, T, 8), (B, T, H)


def _write(out, forward, **kw):
    rows = _rows()
    return write_hidden_states(out, {"train": rows, "val": rows[:3]}, FP, forward, H, 2, batch_size=3,
                               shard_tokens=16, **kw)


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_main(rank: int, world: int, port: int, root: str, runs: list) -> None:
    """One gloo rank: for each ``(output, poison)`` write the cache as this rank; record the result or error."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for output, poison in runs:
        target = _TinyTarget(poison)
        try:
            result = _write(output, target, rank=rank, world_size=world, barrier=dist.barrier, broadcast=_broadcast)
            results.append({"result": result, "calls": target.calls})
        except (ValueError, OSError) as e:
            results.append({"error": f"{type(e).__name__}: {e}", "calls": target.calls})
    Path(root, f"rank{rank}.json").write_text(json.dumps(results))
    end_process_group()


def _spawn(root: Path, runs: list) -> list[list[dict]]:
    """Run ``runs`` in 2 gloo processes; per rank, the list of per-run results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, str(root), runs), nprocs=2, join=True)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _assert_same_cache(got: Path, want: Path) -> None:
    """Same file names (no part index, no temporary), same bytes, same tensors."""
    a, b = _files(got), _files(want)
    assert a.keys() == b.keys() and "index.json" in a
    assert a == b
    for name in a:
        if name.endswith(".safetensors"):
            x, y = load_file(got / name), load_file(want / name)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_two_ranks_write_disjoint_shares_equal_to_one_process_cache(tmp_path):
    single = tmp_path / "single"
    one = _write(single, _TinyTarget())
    assert one["ranks"][0]["tokens_written"] == one["tokens_total"] and one["shards_todo"] >= 6

    ranks = _spawn(tmp_path, [(str(tmp_path / "two"), None)])
    _assert_same_cache(tmp_path / "two", single)
    assert json.loads((tmp_path / "two" / "index.json").read_text())["complete"] is True
    r0, r1 = (r[0]["result"] for r in ranks)
    assert r0 == r1  # the plan and the totals are rank 0's, broadcast
    shares = [set(part["shards"]) for part in r0["ranks"]]
    planned = [s["file"] for split in ("train", "val") for s in HiddenStateCache(single).shards(split)]
    assert shares[0] & shares[1] == set() and shares[0] | shares[1] == set(planned)
    assert sorted(shares[0]) == planned[0::2] and sorted(shares[1]) == planned[1::2]  # k-th missing shard -> rank k % 2
    assert r0["tokens_written"] == one["tokens_total"] == sum(p["tokens_written"] for p in r0["ranks"])
    assert all(p["tokens_written"] > 0 for p in r0["ranks"])
    assert ranks[0][0]["calls"] + ranks[1][0]["calls"] == len(_rows()) + 3  # every sequence run once, by one rank


def test_a_stopped_rank_is_named_on_every_rank_and_the_rerun_finishes(tmp_path):
    """Rank 1's target turns NaN on one row: both ranks stop with the error naming rank 1 (rank 0 does not wait
    forever), rank 0's shards stay; the rerun writes only the shards that are missing and equals the clean cache."""
    clean = tmp_path / "clean"
    _write(clean, _TinyTarget())
    planned = [s["file"] for split in ("train", "val") for s in HiddenStateCache(clean).shards(split)]
    # a token found only in rank 1's shards (shard k goes to rank k % 2), so rank 0 finishes its share
    rows, cache = _rows(), HiddenStateCache(clean)
    tokens = [set().union(*(rows[i]["input_ids"] for i in range(*s["rows"])))
              for split in ("train", "val") for s in cache.shards(split)]
    poison = min(set().union(*tokens[1::2]) - set().union(*tokens[0::2]))
    out = tmp_path / "two"
    ranks = _spawn(tmp_path, [(str(out), poison)])
    assert "ValueError: hidden-state cache: rank 1 stopped: the target's hidden states of train row" in ranks[0][0]["error"]
    assert "non-finite" in ranks[1][0]["error"]
    index = json.loads((out / "index.json").read_text())
    assert index["complete"] is False
    with pytest.raises(ValueError, match="is incomplete"):
        HiddenStateCache(out)
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    assert set(planned[0::2]) <= kept.keys() < set(planned)  # rank 0's share is complete, rank 1's is not

    rerun = _spawn(tmp_path, [(str(out), None)])
    _assert_same_cache(out, clean)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors") if p.name in kept} == kept  # not rewritten
    result = rerun[0][0]["result"]
    assert result["shards_done"] == len(kept) and result["shards_todo"] == len(planned) - len(kept)
    todo = [f for f in planned if f not in kept]
    assert [p["shards"] for p in result["ranks"]] == [todo[0::2], todo[1::2]]  # the remainder shared out again


def test_an_interrupted_single_writer_resumes_equal_to_the_clean_cache(tmp_path):
    """The index deleted and one shard cut short (a killed writer): the rerun checks every shard's header,
    rewrites only the short one, and the cache equals the clean one; no temporary is left."""
    clean, out = tmp_path / "clean", tmp_path / "c"
    _write(clean, _TinyTarget())
    _write(out, _TinyTarget())
    (out / "index.json").unlink()
    torn = out / "train-00002.safetensors"
    torn.write_bytes(torn.read_bytes()[:-7])
    (out / ".train-00003.safetensors.abc123").write_bytes(b"partial")  # a killed atomic write's temporary
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors") if p != torn}
    target = _TinyTarget()
    result = _write(out, target)
    assert result["shards_todo"] == 1 and result["ranks"][0]["shards"] == [torn.name]
    assert target.calls == HiddenStateCache(clean).shards("train")[2]["rows"][1] - HiddenStateCache(clean).shards("train")[2]["rows"][0]
    _assert_same_cache(out, clean)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors") if p != torn} == mtimes


def test_the_disk_check_counts_the_whole_cache_before_any_rank_writes(tmp_path, monkeypatch):
    """With 2 ranks, rank 0 counts every rank's shards (the whole cache: bytes per token x all tokens plus the
    headers), refuses before anything is written, and rank 1 raises the same error from the broadcast."""
    rows = _rows()
    shards = [s for split, n in (("train", 13), ("val", 3)) for s in plan_shards(
        [len(r["input_ids"]) for r in rows[:n]], split, 16)]
    tokens = sum(len(r["input_ids"]) for r in rows) + sum(len(r["input_ids"]) for r in rows[:3])
    need = bytes_per_token(H, 2) * tokens + sum(8 * (s["rows"][1] - s["rows"][0] + 1) + 4096 for s in shards)
    assert bytes_per_token(H, 2) == 2 * 3 * H + 5
    monkeypatch.setattr(writer, "_free_bytes", lambda path: need - 1)
    sent, plans = [], []

    def rank0_broadcast(obj):
        sent.append(obj)
        return obj

    def no_barrier():
        raise AssertionError("a rank reached the barrier: it wrote before the disk check stopped it")

    out = tmp_path / "c"
    with pytest.raises(OSError, match=rf"not enough disk for the hidden-state cache in {out}: the {len(shards)} shards "
                       rf"still to write \(all 2 ranks'\) need {need} bytes .* {need - 1} bytes free"):
        _write(out, _TinyTarget(), rank=0, world_size=2, barrier=no_barrier, broadcast=rank0_broadcast, on_plan=plans.append)
    assert plans[0]["bytes_needed"] == need and plans[0]["tokens"] == tokens and plans[0]["world_size"] == 2
    target = _TinyTarget()
    with pytest.raises(OSError, match=rf"in {out}: .* need {need} bytes") as rank1:
        _write(out, target, rank=1, world_size=2, barrier=no_barrier, broadcast=lambda obj: sent[0])
    assert rank1.value.errno == 28 and target.calls == 0
    assert not out.exists()
    monkeypatch.setattr(writer, "_free_bytes", lambda path: need)  # exactly enough: written
    assert _write(out, _TinyTarget())["bytes_needed"] == need


def test_inconsistent_ranks_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, world_size=2\)"):
        _write(tmp_path / "c", _TinyTarget(), rank=2, world_size=2, barrier=lambda: None, broadcast=lambda o: o)
    with pytest.raises(ValueError, match="world_size=2 needs a barrier and a broadcast"):
        _write(tmp_path / "c", _TinyTarget(), rank=0, world_size=2)
    assert not (tmp_path / "c").exists()


def test_cache_hidden_states_under_torchrun_equals_one_process(tmp_path, monkeypatch):
    """`torchrun --nproc_per_node 2 -m draftkit cache-hidden-states` (gloo, the tiny recipe's random target): each
    process writes its share of the 5 shards, and the files are the bytes one process writes."""
    import subprocess
    import sys

    from draftkit.commands.cache_hidden_states import cache_hidden_states

    repo = Path(__file__).resolve().parents[2]
    args = ["--recipe", "recipes/tiny-debug.yaml", "--shard_mb", "1", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "draftkit",
         "cache-hidden-states", *args, "--output", str(tmp_path / "two")],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 wrote" in proc.stderr and "rank 1 wrote" in proc.stderr
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone prints the summary
    monkeypatch.chdir(repo)
    one = cache_hidden_states(["recipes/tiny-debug.yaml"], str(tmp_path / "one"), shard_mb=1, device="cpu")
    assert one["shards_todo"] == 5 and one["world_size"] == 1
    _assert_same_cache(tmp_path / "two", tmp_path / "one")
