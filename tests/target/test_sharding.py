"""The target sharded with FSDP2 (``draftkit.target.sharding``): 2 gloo processes each read half of every
tensor, gather the same weights and compute the same states as the whole target, and write the offline cache
in lockstep byte for byte equal to one process's."""

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from draftkit.generation.hidden_states import write_hidden_states
from draftkit.target.frozen import FrozenTarget, load_target
from draftkit.target.sharding import load_sharded_target, resident_bytes
from draftkit.testing import build_tiny_target, end_process_group

FP = {"target": "t", "target_config": "c", "target_dtype": "float32", "aux_layer_ids": [2, 4, 5], "tokenizer": "k",
      "data": "d"}
AUX = [2, 4, 5]


def _rows(n: int = 9) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = int(torch.randint(3, 20, (1,), generator=gen))
        out.append({"input_ids": torch.randint(0, 300, (t,), generator=gen).tolist(), "loss_mask": [1] * t})
    return out


def _write(output: str, target: FrozenTarget, **kw) -> dict:
    def forward(ids, attn):
        out = target(ids, attention_mask=attn, compute_logits=False)
        return out.aux_hidden_states, out.last_hidden_state  # (B, T, 3*H_t), (B, T, H_t)

    rows = _rows()
    # 2 sequences per forward, ~40 tokens per shard: 3 shards, 2 for rank 0 and 1 for rank 1 (uneven forwards)
    return write_hidden_states(output, {"train": rows[:7], "val": rows[7:]}, FP, forward, target.hidden_size, 3,
                               batch_size=2, shard_tokens=40, **kw)


def _rank_main(rank: int, world: int, port: int, target_dir: str, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, _ = load_sharded_target(target_dir, "float32", mesh, "cpu")
    whole, _ = load_target(target_dir, "float32")
    gathered = {n: p.full_tensor() for n, p in model.named_parameters()}
    report = {
        "same_weights": all(torch.equal(gathered[n], p) for n, p in whole.named_parameters(remove_duplicate=False)),
        "bytes": resident_bytes(model), "whole_bytes": resident_bytes(whole),
    }
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(rank))  # each rank its own batch
    a, b = FrozenTarget(model, AUX)(ids), FrozenTarget(whole, AUX)(ids)
    # what Eagle3Module.build copies into the head (init_from_target too): gathered, equal to the whole target's
    sharded_facts, whole_facts = FrozenTarget(model, AUX), FrozenTarget(whole, AUX)
    report["same_facts"] = all(torch.equal(getattr(sharded_facts, f)(), getattr(whole_facts, f)())
                               for f in ("input_embeddings", "lm_head_weight", "final_norm_weight"))
    report["same_states"] = all(torch.equal(x, y) for x, y in ((a.aux_hidden_states, b.aux_hidden_states),
                                                               (a.last_hidden_state, b.last_hidden_state),
                                                               (a.logits, b.logits)))

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    result = _write(str(Path(root) / "two"), FrozenTarget(model, AUX), rank=rank, world_size=world,
                    barrier=dist.barrier, broadcast=broadcast, lockstep=True)
    report["shards"] = result["ranks"][rank]["shards"]
    Path(root, f"rank{rank}.json").write_text(json.dumps(report))
    del model, gathered, a, b, sharded_facts, whole_facts  # the sharded target's DTensors, before the group ends
    end_process_group()


def test_two_ranks_hold_half_gather_the_same_target_and_write_the_same_cache(tmp_path):
    """A tied target with an odd vocabulary (321 rows: shards of 161 and 160; the LM head untied into its own
    sharded copy): the gathered weights, the aux/last states and the logits equal the whole target's exactly,
    each rank holds about half its bytes, and the cache the two ranks write in lockstep (2 shards for rank 0,
    1 for rank 1) equals one process's byte for byte."""
    target_dir = build_tiny_target(tmp_path / "tied", vocab_size=321, tie_word_embeddings=True)
    single = tmp_path / "single"
    whole, _ = load_target(str(target_dir), "float32")
    _write(str(single), FrozenTarget(whole, AUX))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, str(target_dir), str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert r["same_weights"] and r["same_states"] and r["same_facts"]
        # half of every tensor plus, on each rank, half of the untied LM head copy (V*H_t/2 more than half)
        untied = 321 * 64 * 4
        assert abs(r["bytes"] - (r["whole_bytes"] + untied) / 2) < 0.01 * r["whole_bytes"], r
    assert [len(r["shards"]) for r in reports] == [2, 1]  # uneven: rank 1 pads with one-token forwards
    files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}  # noqa: E731
    assert files(tmp_path / "two") == files(single)
