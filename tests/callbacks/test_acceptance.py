"""AcceptanceLengthMonitor on a tiny module: logged values equal a direct evaluation, schedule, arguments; on a
target sharded across 2 gloo processes the ranks decode in lockstep with rank 0's picks."""

import csv
import gc
import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from draftkit.callbacks.acceptance import AcceptanceLengthMonitor
from lightning.pytorch.loggers import CSVLogger

from draftkit.data.prompts import load_prompts
from draftkit.decoding.harness import evaluate_head
from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.decoding.metrics import DISTRIBUTION_METRICS


@pytest.fixture(scope="module")
def tiny_parts(tiny_target_dir):
    from draftkit.target.frozen import FrozenTarget, load_target

    model, tokenizer = load_target(str(tiny_target_dir), "float32")
    return FrozenTarget(model, None), tokenizer


class TinyModule(pl.LightningModule):
    """Holds head/target/tokenizer like Eagle3Module; trains nothing (lr 0) so the head stays fixed."""

    def __init__(self, target, tokenizer) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.target = target
        self.tokenizer = tokenizer
        self.chat_template = None
        self.head = Eagle3LlamaHead(Eagle3Config.from_target_config(target.config, target.aux_layer_ids, 320))
        self.head.load_embedding(target.input_embeddings())

    def training_step(self, batch, batch_idx):
        return self.head.fc(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.head.fc(batch).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 3 * 64), batch_size=2)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(2, 3 * 64), batch_size=2)


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello there", "abc abc abc", "unused"]) + "\n")
    return str(path)


def _metrics(tmp_path):
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if r.get("val/accept_len")]


def test_logs_accept_len_every_n_validations(tmp_path, tiny_parts, prompts):
    torch.set_num_threads(1)
    module = TinyModule(*tiny_parts)
    monitor = AcceptanceLengthMonitor(every_n_validations=2, num_prompts=2, k=3, max_new_tokens=10, prompts=prompts)
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_epochs=4, limit_train_batches=1, limit_val_batches=1,
        logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=1, callbacks=[monitor],
    )
    trainer.fit(module)
    assert [step for step, _ in monitor.history] == [2, 4]  # 4 validations, every 2nd, sanity check excluded
    expected = evaluate_head(module.head, module.target, module.tokenizer, load_prompts(prompts, 2), k=3,
                             max_new_tokens=10, baseline=False, prompt_lookup=False, warmup=False)
    assert monitor.last_report["tau"] == pytest.approx(expected["tau"])
    logged = _metrics(tmp_path)
    assert len(logged) == 2
    assert float(logged[-1]["val/accept_len"]) == pytest.approx(expected["tau"])
    for i, a in enumerate(expected["acceptance_per_position"], 1):
        assert float(logged[-1][f"val/accept_rate_pos{i}"]) == pytest.approx(a)
    assert float(trainer.callback_metrics["val/accept_len"]) == pytest.approx(expected["tau"])  # monitorable
    assert module.head.training  # mode restored


def test_every_n_train_steps(tmp_path, tiny_parts, prompts):
    torch.set_num_threads(1)
    module = TinyModule(*tiny_parts)
    monitor = AcceptanceLengthMonitor(every_n_train_steps=2, num_prompts=1, k=2, max_new_tokens=4, prompts=prompts)
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=4, limit_val_batches=0, logger=CSVLogger(tmp_path),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
    )
    trainer.fit(module)
    assert [step for step, _ in monitor.history] == [2, 4]
    assert len(_metrics(tmp_path)) == 2


def test_a_tree_is_measured_beside_the_chain_as_evaluate_measures_it(tmp_path, tiny_parts, prompts):
    """``tree``: the monitor also decodes the tree on the same prompts and logs its acceptance length and per-depth
    acceptance, equal to ``evaluate`` with that tree; the chain's values stay those of the chain."""
    from draftkit.decoding.tree import TreeConfig

    torch.set_num_threads(1)
    module = TinyModule(*tiny_parts)
    monitor = AcceptanceLengthMonitor(every_n_train_steps=2, num_prompts=2, k=3, max_new_tokens=10, prompts=prompts,
                                      tree="3,2,4")
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, logger=CSVLogger(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[monitor])
    trainer.fit(module)
    kw = dict(max_new_tokens=10, baseline=False, prompt_lookup=False, warmup=False)
    chain = evaluate_head(module.head, module.target, module.tokenizer, load_prompts(prompts, 2), k=3, **kw)
    tree = evaluate_head(module.head, module.target, module.tokenizer, load_prompts(prompts, 2),
                         tree=TreeConfig.parse("3,2,4"), **kw)
    logged = {name: float(v) for name, v in _metrics(tmp_path)[-1].items() if v}
    assert logged["val/accept_len"] == pytest.approx(chain["tau"])
    assert logged["val/tree_accept_len"] == pytest.approx(tree["tau"])
    assert [logged[f"val/tree_accept_rate_pos{i}"] for i in (1, 2, 3)] == pytest.approx(tree["acceptance_per_position"])
    assert "val/tree_accept_rate_pos4" not in logged
    with pytest.raises(ValueError, match="AcceptanceLengthMonitor tree"):
        AcceptanceLengthMonitor(tree="3,two,4")


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"every_n_validations": 0}, {"num_prompts": 0}, {"temperature": -1.0},
                                    {"every_n_train_steps": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="AcceptanceLengthMonitor"):
        AcceptanceLengthMonitor(**kwargs)


# AcceptanceLengthMonitor logs the per-position distribution metrics of its report; callback defaults (issue 36).


def test_acceptance_monitor_logs_distribution_metrics_per_position(tmp_path, tiny_parts):
    module = TinyModule(*tiny_parts)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc"}) + "\n")
    monitor = AcceptanceLengthMonitor(every_n_train_steps=1, num_prompts=1, k=2, max_new_tokens=4, prompts=str(prompts))
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0, logger=CSVLogger(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[monitor])
    trainer.fit(module)
    expected = evaluate_head(module.head, module.target, module.tokenizer, load_prompts(str(prompts), 1), k=2,
                             max_new_tokens=4, baseline=False, prompt_lookup=False, warmup=False)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/accept_len")]
    assert len(rows) == 1
    logged = {name: float(v) for name, v in rows[0].items() if v}
    want = {f"val/{name}_pos{i}": x for name in DISTRIBUTION_METRICS
            for i, x in enumerate(expected[f"{name}_per_position"], 1) if x is not None}
    assert len(want) == 2 * len(DISTRIBUTION_METRICS)  # k = 2 positions, each metric measured at both
    assert {name: logged[name] for name in want} == pytest.approx(want, abs=1e-6)


def test_documented_defaults_and_the_k_boundary():
    """``draftkit.callbacks.acceptance`` / ``draftkit.callbacks.export``: the defaults that change what is
    measured or written, and k = 1 (the boundary of ``k < 1``) accepted, 0 refused."""
    from draftkit.callbacks.export import ExportOnCheckpoint

    m = AcceptanceLengthMonitor()
    assert (m.every_n_validations, m.every_n_train_steps, m.num_prompts, m.k, m.max_new_tokens, m.temperature,
            m.prompts, m.seed) == (1, None, 8, 5, 64, 0.0, "mt-bench", 0)
    e = ExportOnCheckpoint()
    assert (e.engines, e.dirpath, e.checkpoint, e.dtype, e.num_speculative_tokens, e.overwrite) == (
        ["vllm"], None, "final", "bfloat16", 3, True)
    assert ExportOnCheckpoint(num_speculative_tokens=1).num_speculative_tokens == 1
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        ExportOnCheckpoint(num_speculative_tokens=0)


def test_schedule_decisions_on_a_fake_trainer(monkeypatch):
    """Which hook measures (issue 56): with every_n_train_steps the validations never do; a step is measured
    once even when several batches end at it (gradient accumulation), never at step 0; without it, every
    n-th real validation (the sanity check not counted)."""
    from types import SimpleNamespace

    from draftkit.callbacks.acceptance import AcceptanceLengthMonitor

    def run(monitor, events):
        done = []
        monkeypatch.setattr(monitor, "_decode", lambda trainer, module, sync: done.append(trainer.global_step) or {})
        for kind, step, sanity in events:
            trainer = SimpleNamespace(global_step=step, sanity_checking=sanity, global_rank=0, loggers=[],
                                      strategy=SimpleNamespace(broadcast=lambda x, src=0: x))
            module = SimpleNamespace(log=lambda *a, **k: None)
            if kind == "batch":
                monitor.on_train_batch_end(trainer, module, None, None, 0)
            else:
                monitor.on_validation_epoch_end(trainer, module)
        return done

    steps = AcceptanceLengthMonitor(every_n_train_steps=2)
    events = [("val", 0, True), ("batch", 0, False), ("batch", 1, False), ("batch", 2, False), ("batch", 2, False),
              ("val", 2, False), ("batch", 3, False), ("batch", 4, False), ("val", 4, False)]
    assert run(steps, events) == [2, 4]
    vals = AcceptanceLengthMonitor(every_n_validations=2)
    assert run(vals, events) == [4]  # real validations at 2 and 4: the second one; the sanity check not counted


# Under fsdp_target every rank applies rank 0's rounds: ranks whose picks differ cannot part (and hang).


def _repeating_head(target, token: int) -> Eagle3LlamaHead:
    """TinyModule's head with its d2t buffer changed so that every draft id maps to target token ``token``: it
    drafts ``token`` k times per round. The tiny target's greedy answers repeat 254 ("hello there") and 123 ("abc
    abc abc"), so heads drafting one or the other accept different counts in different rounds."""
    torch.manual_seed(0)
    head = Eagle3LlamaHead(Eagle3Config.from_target_config(target.config, target.aux_layer_ids, 320))
    head.load_embedding(target.input_embeddings())
    head.d2t.copy_(token - torch.arange(320))  # draft id i -> target id i + d2t[i] = token
    return head


def _report(monitor: AcceptanceLengthMonitor) -> dict:
    r = monitor.last_report
    out = {"tau": r["tau"], "alpha": r["acceptance_per_position"],
           "prompts": [(p["new_tokens"], p["rounds"]) for p in r["per_prompt"]]}
    if r["sweep"]:  # the tree (monitor.tree)
        t = r["sweep"][1]
        out["tree"] = {"tau": t["tau"], "alpha": t["acceptance_per_position"],
                       "prompts": [(p["new_tokens"], p["rounds"]) for p in t["per_prompt"]]}
    return out


def _sharded_rank(rank: int, world: int, port: int, target_dir: str, prompts: str, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from draftkit.target.frozen import FrozenTarget
    from draftkit.target.sharding import load_sharded_target

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # ranks that part would wait on each other's gathers: a timeout turns that hang into a failure
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model, tokenizer = load_sharded_target(target_dir, "float32", mesh, "cpu")
    target = FrozenTarget(model, None)
    # rank 1's head is another head: on its own it would accept other counts and stop after other rounds
    module = SimpleNamespace(head=_repeating_head(target, (123, 254)[rank]), target=target, tokenizer=tokenizer,
                             chat_template=None)

    def broadcast(value, src=0):  # what Lightning's DDP strategies do
        box = [value]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    trainer = SimpleNamespace(global_rank=rank, global_step=2, loggers=[],
                              strategy=SimpleNamespace(target_mesh=mesh, broadcast=broadcast))
    monitor = AcceptanceLengthMonitor(every_n_train_steps=2, num_prompts=2, k=3, max_new_tokens=16, prompts=prompts,
                                      tree=TREE)
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    Path(root, f"rank{rank}.json").write_text(json.dumps(_report(monitor)))
    del module, target, model, monitor
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


TREE = "3,2,4"  # depth 3, top-k 2, 4 nodes


def test_sharded_ranks_apply_rank_zeros_rounds(tmp_path, tiny_target_dir, tiny_parts):
    """2 gloo processes share a sharded tiny target; rank 1's head drafts another token than rank 0's, so on its
    own it accepts other counts per round and runs another number of rounds (each a collective target forward).
    Both ranks finish, and both measure exactly what one process measures with rank 0's head, for the chain and
    for the tree (each rank verifies rank 0's tree)."""
    import torch.multiprocessing as mp

    target, tokenizer = tiny_parts
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello there", "abc abc abc"]))
    alone = {}
    for token in (123, 254):
        monitor = AcceptanceLengthMonitor(num_prompts=2, k=3, max_new_tokens=16, prompts=str(prompts), tree=TREE)
        module = SimpleNamespace(head=_repeating_head(target, token), target=target, tokenizer=tokenizer,
                                 chat_template=None)
        monitor._decode(SimpleNamespace(global_step=2), module)
        alone[token] = _report(monitor)
    # the two heads part: other rounds per prompt (rank 0's head accepts on the second prompt, rank 1's on the first)
    assert [r for _, r in alone[123]["prompts"]] == [15, 6]
    assert [r for _, r in alone[254]["prompts"]] == [9, 14]
    assert [r for _, r in alone[123]["tree"]["prompts"]] != [r for _, r in alone[254]["tree"]["prompts"]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sharded_rank, args=(2, port, str(tiny_target_dir), str(prompts), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == json.loads(json.dumps(alone[123]))
