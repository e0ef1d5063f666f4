"""Non-finite numbers are never trained on or saved (issue 30 item 1, case x07): a NaN loss or gradient stops
``fit`` before the optimizer step naming the batch's source, validation refuses NaN logits, and no checkpoint
is written from non-finite weights."""

import json
import struct
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from draftkit.artifacts import resolve_artifact
from draftkit.cli import DraftkitCLI
from draftkit.models.eagle3 import Eagle3Module
from draftkit.models.guards import NonFiniteTrainingError

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny-debug.yaml"


def _nan_shard(path: Path, count: int = 50) -> None:
    """The x07 repro: ``count`` bf16 values at the start of a shard's aux_hidden_states set to NaN."""
    b = bytearray(path.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    start = 8 + n + json.loads(b[8:8 + n])["aux_hidden_states"]["data_offsets"][0]
    for i in range(count):
        b[start + 2 * i:start + 2 * i + 2] = b"\xc0\x7f"  # bf16 NaN
    path.write_bytes(bytes(b))


def _head_tensors(ckpt: Path) -> dict:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("head.") and v.is_floating_point()}


def test_x07_nan_cache_shard_stops_fit_naming_the_shard(tmp_path, monkeypatch):
    """Case x07: 50 NaN values in train-00002 of a 0.5 MB-shard cache. Was: exit 0, train/loss NaN from step 2
    on, best-step=4.ckpt and last.ckpt with NaN weights. Now fit stops at the batch that reads that shard,
    naming it, before its optimizer step; every checkpoint written (best/last before it, the interrupt
    checkpoint at the stop) holds finite weights of the last good step."""
    from draftkit.commands.cache_hidden_states import cache_hidden_states

    monkeypatch.chdir(REPO)
    resolve_artifact("tiny:llama")
    cache = tmp_path / "hc"
    cache_hidden_states([RECIPE], str(cache), shard_mb=0.5)
    shard = cache / "train-00002.safetensors"
    rows = next(s["rows"] for s in json.loads((cache / "index.json").read_text())["splits"]["train"]["shards"]
                if s["file"] == shard.name)
    _nan_shard(shard)
    run = tmp_path / "run"
    override = tmp_path / "x07.yaml"
    override.write_text(yaml.safe_dump({"trainer": {
        "max_steps": 16, "default_root_dir": str(run),
        "callbacks": [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(run / "ckpt"), "filename": "best-{step}", "monitor": "val/tau_sim",
                           "mode": "max", "save_last": True}},
            {"class_path": "draftkit.callbacks.interrupt.InterruptCheckpoint",
             "init_args": {"dirpath": str(run / "interrupted")}},
        ]}}))
    steps, last_good = [], {}

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            steps.append(trainer.global_step)
            last_good.update({f"head.{k}": v.detach().clone() for k, v in pl_module.head.state_dict().items()
                              if v.is_floating_point()})

    monkeypatch.setattr(Eagle3Module, "configure_callbacks", lambda self: [Steps()])
    with pytest.raises(NonFiniteTrainingError) as err:
        DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(override),
                          "--data.hidden_states_cache", str(cache)])
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert f"hidden-state cache shard {shard} sequence 0 (split row {rows[0]}) has 50 NaN/inf values in " \
           "aux_hidden_states; delete that shard file and rerun `python -m draftkit cache-hidden-states`" in msg
    assert msg.startswith(f"non-finite train loss (nan) at optimizer step {len(steps)}, train batch {len(steps)}: ")
    assert "stopped before the optimizer step" in msg
    ckpts = sorted(run.rglob("*.ckpt"))
    assert (run / "interrupted" / "on_exception.ckpt") in ckpts
    for path in ckpts:
        tensors = _head_tensors(path)
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values()), path
    interrupt = _head_tensors(run / "interrupted" / "on_exception.ckpt")  # the weights of the last good step
    assert len(interrupt) > 5 and interrupt.keys() <= last_good.keys()  # (the frozen embedding is not saved)
    assert all(torch.equal(interrupt[k], last_good[k]) for k in interrupt)


def _offline_batch(model, b: int = 2, t: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    width = model.head.fc.weight.shape[1]
    return {
        "input_ids": torch.randint(0, 256, (b, t), generator=g),
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "loss_mask": torch.ones(b, t, dtype=torch.long),
        "aux_hidden_states": torch.randn(b, t, width, generator=g),
        "last_hidden_state": torch.randn(b, t, model.target.config.hidden_size, generator=g),
        "source": [f"shard val-00000.safetensors sequence {i}" for i in range(b)],
    }


@pytest.fixture()
def offline_module(tiny_target_dir):
    """A module in offline mode (the target's LM head only), V_d = V, K = 2."""
    torch.manual_seed(0)
    model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=320, ttt={"steps": 2})

    class CacheDM:
        class hidden_states:  # noqa: N801 - stands in for a HiddenStateCache
            @staticmethod
            def check(expected):
                pass

    model.build(CacheDM())
    assert type(model.target).__name__ == "TargetLMHead"
    return model


def test_validation_refuses_nan_logits_naming_the_source(offline_module):
    """NaN teacher states in sequence 1 of a validation batch: no accuracy is counted, the error names it."""
    model = offline_module
    model.on_validation_epoch_start()
    good = _offline_batch(model)
    model.validation_step(good, 0)
    assert model._val_weight.tolist() == [8.0, 6.0]  # 2 rows x (6 - 2 - k) supervised positions
    bad = _offline_batch(model, seed=1)
    bad["last_hidden_state"][1, 2, :3] = float("nan")
    with pytest.raises(NonFiniteTrainingError, match=(
            r"^non-finite validation loss \(nan\) at optimizer step 0, validation batch 7: shard val-00000.safetensors "
            r"sequence 1 has 3 NaN/inf values in last_hidden_state; delete that shard file .*; no accuracy or loss "
            r"is reported for it$")):
        model.validation_step(bad, 7)
    assert model._val_weight.tolist() == [8.0, 6.0]  # the bad batch counted nothing
    assert float(model.val_acc[0].weight) == 8.0


def test_nan_head_weights_are_named_and_never_checkpointed(offline_module):
    model = offline_module
    with torch.no_grad():
        model.head.fc.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteTrainingError, match=r"the head's fc.weight are already NaN/inf \(batch: shard "
                       r"val-00000.safetensors sequence 0, shard val-00000.safetensors sequence 1\)"):
        model.validation_step(_offline_batch(model), 0)
    with pytest.raises(NonFiniteTrainingError, match=r"^not saving a checkpoint at step \?: the head's fc.weight "
                       r"hold NaN/inf"):
        model.on_save_checkpoint({"state_dict": {}})


def test_nan_gradient_stops_before_the_optimizer_step(offline_module, tmp_path):
    """A finite loss whose fc gradient turns NaN (a hook) at the third batch: fit stops in
    ``on_before_optimizer_step`` naming the parameter and the batch; the weights are those after step 2,
    finite; the interrupt checkpoint written at the stop is finite too, and no other checkpoint exists."""
    from draftkit.callbacks.interrupt import InterruptCheckpoint

    model = offline_module
    batches = [_offline_batch(model, seed=s) for s in range(4)]
    seen = []

    def nan_on_third(grad):
        seen.append(1)
        return grad * float("nan") if len(seen) == 3 else grad

    model.head.fc.weight.register_hook(nan_on_third)
    model.configure_optimizers = lambda: torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    weights = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            weights.append(pl_module.head.fc.weight.detach().clone())

    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path / "root", max_steps=4,
                         callbacks=[Watch(), InterruptCheckpoint(dirpath=tmp_path)], enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(NonFiniteTrainingError, match=(
            r"^non-finite gradients of fc.weight at optimizer step 2, train batch 2 \(shard val-00000.safetensors "
            r"sequence 0, shard val-00000.safetensors sequence 1\); stopped before the optimizer step")):
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 2 and len(weights) == 2
    assert torch.equal(model.head.fc.weight, weights[-1]) and bool(torch.isfinite(model.head.fc.weight).all())
    saved = _head_tensors(tmp_path / "on_exception.ckpt")
    assert torch.equal(saved["head.fc.weight"], weights[-1])


def test_interrupt_checkpoint_skips_nan_weights(offline_module, tmp_path):
    """Weights made NaN outside the guarded path, then an error: the original error surfaces and no
    interrupt checkpoint is written."""
    from draftkit.callbacks.interrupt import InterruptCheckpoint

    model = offline_module
    model.configure_optimizers = lambda: torch.optim.AdamW(model.head.parameters(), lr=1e-2)

    class Poison(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            with torch.no_grad():
                pl_module.head.norm.weight[0] = float("nan")
            raise RuntimeError("boom")

    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path / "root", max_steps=4,
                         callbacks=[Poison(), InterruptCheckpoint(dirpath=tmp_path)], enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    with pytest.warns(UserWarning, match="InterruptCheckpoint: not writing .*on_exception.ckpt: the weights hold NaN"):
        with pytest.raises(RuntimeError, match="^boom$"):
            trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader([_offline_batch(model)] * 4,
                                                                              batch_size=None))
    assert not (tmp_path / "on_exception.ckpt").exists()


def test_cache_writer_refuses_non_finite_target_states(tmp_path):
    """A target whose states of one conversation (token 99 in it) are NaN: the cache writer names the split row
    and record and writes no shard, so no cache on disk holds NaN."""
    from draftkit.generation.hidden_states import write_hidden_states

    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "record": "a.jsonl:1"},
            {"input_ids": [4, 99, 5, 6], "loss_mask": [0, 1, 1, 1], "record": "a.jsonl:2"}]

    def forward(ids, attn):
        aux = ids[..., None].float().expand(*ids.shape, 8).clone()  # (B, T, 2*4)
        aux[ids == 99] = float("nan")
        return aux, ids[..., None].float().expand(*ids.shape, 4)  # (B, T, 4)

    with pytest.raises(ValueError, match=(
            r"^the target's hidden states of train row 1 \(record a.jsonl:2\) are non-finite \(NaN/inf; after the "
            r"bf16 cast: 8 aux, 0 last\); nothing of train-00000.safetensors was written")):
        write_hidden_states(tmp_path / "c", {"train": rows}, {"target": "t"}, forward, 4, 2)
    assert not list((tmp_path / "c").glob("*.safetensors"))


def test_collate_names_the_rows_it_batches():
    """Online rows carrying their record name (``record``) and offline rows (``source``) are named in the
    batch; rows without either add no key."""
    from draftkit.data.collate import collate

    named = collate([{"input_ids": [1, 2], "loss_mask": [0, 1], "record": "chat.jsonl:7"},
                     {"input_ids": [3], "loss_mask": [1], "source": "hidden-state cache shard x sequence 0"}])
    assert named["source"] == ["record chat.jsonl:7", "hidden-state cache shard x sequence 0"]
    assert "source" not in collate([{"input_ids": [1, 2], "loss_mask": [0, 1]}])
