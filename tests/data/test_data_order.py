"""Data order and resume: each epoch its own seeded permutation; exact resume from any checkpoint; a resume on
another world size or global batch continues at the next unseen sequence or refuses (issue 14, item 4).

A one-parameter LightningModule stands in for the head: the loader's behaviour under Lightning's loops is what
is tested, and it records the batches it trains on.
"""

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from draftkit.data.collate import collate
from draftkit.data.datamodule import ChatDataModule
from draftkit.data.sampler import EpochSampler, ResumableLoader


class Recorder(pl.LightningModule):
    """Records (global_step, epoch, sequence indices) of every training batch; one parameter, SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.rows: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.rows.append((self.trainer.global_step, self.current_epoch, batch["index"]))
        return (self.w - float(sum(batch["index"]))) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD([self.w], lr=1e-3)


class IndexedData(ChatDataModule):
    """The chat datamodule with each batch carrying the indices of its sequences in the training split."""

    def setup(self, stage=None):
        super().setup(stage)
        if "index" not in self.train_set.column_names:
            self.train_set = self.train_set.add_column("index", list(range(len(self.train_set))))

    def train_dataloader(self):
        loader = super().train_dataloader()
        collate_fn = loader.collate_fn

        def with_index(rows):
            out = collate_fn(rows)
            out["index"] = [r["index"] for r in rows]
            return out

        loader.collate_fn = with_index
        return loader


@pytest.fixture()
def chat20(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i}" + "x" * (i % 7)}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _fit(path, tok, root, ckpt=None, bucket_window=0, **limits):
    pl.seed_everything(0)
    dm = IndexedData(str(path), tokenizer=str(tok), max_length=64, val_size=4, batch_size=3,
                     bucket_window=bucket_window)
    model = Recorder()
    cb = ModelCheckpoint(dirpath=root, filename="s-{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[cb], **limits)
    trainer.fit(model, dm, ckpt_path=ckpt, weights_only=False)
    return {step: (epoch, index) for step, epoch, index in model.rows}, model.w.detach().clone()


def _expected_epoch(size, seed, epoch, batch, lengths=None, window=0):
    sampler = EpochSampler(size, seed, True, batch, lengths=lengths, bucket_window=window)
    sampler.set_epoch(epoch)
    return sampler.global_batches()


@pytest.mark.parametrize("bucket_window", [0, 6])
def test_case_each_epoch_draws_its_own_seeded_permutation(chat20, tiny_target_dir, tmp_path, bucket_window):
    """User case n7 (epoch order): every epoch replayed epoch 0's order; the loader state stayed at epoch 0."""
    rows, _ = _fit(chat20, tiny_target_dir, tmp_path, bucket_window=bucket_window, max_epochs=3)
    by_epoch = {}
    for step in sorted(rows):
        epoch, index = rows[step]
        by_epoch.setdefault(epoch, []).append(index)
    assert sorted(by_epoch) == [0, 1, 2] and all(len(b) == 7 for b in by_epoch.values())  # 20 train, batch 3
    assert by_epoch[0] != by_epoch[1] and by_epoch[1] != by_epoch[2] and by_epoch[0] != by_epoch[2]  # pairwise
    if bucket_window == 0:
        for epoch, batches in by_epoch.items():
            assert batches == _expected_epoch(20, 0, epoch, 3)  # epoch e: permutation seeded seed*100003 + e
    for batches in by_epoch.values():
        assert sorted(sum(batches, [])) == list(range(20))


@pytest.mark.parametrize("mode,resume_at", [("steps", 7), ("steps", 10), ("epochs", 7), ("epochs", 14)])
def test_case_resume_from_any_checkpoint_gives_the_same_batches(chat20, tiny_target_dir, tmp_path, mode, resume_at):
    """User case n7 (resume at an epoch boundary): a resume from the checkpoint at the end of epoch 0 (step 7 of
    7 batches per epoch) changed every later batch. Mid-epoch and max_epochs resume points as well."""
    limits = dict(max_steps=17) if mode == "steps" else dict(max_epochs=3)
    full, w_full = _fit(chat20, tiny_target_dir, tmp_path / "a", **limits)
    resumed, w_resumed = _fit(chat20, tiny_target_dir, tmp_path / "b", ckpt=str(tmp_path / "a" / f"s-step={resume_at}.ckpt"),
                              **limits)
    assert sorted(resumed) == [s for s in sorted(full) if s >= resume_at]
    assert {s: full[s] for s in resumed} == resumed  # same epoch and batch at every step
    assert torch.equal(w_full, w_resumed)


def _loader(size, world, rank, batch, window=0):
    data = [{"input_ids": [i], "loss_mask": [1]} for i in range(size)]
    lengths = [1 + (i * 7) % 11 for i in range(size)]
    return ResumableLoader(data, seed=3, shuffle=True, num_replicas=world, rank=rank, lengths=lengths,
                           bucket_window=window, batch_size=batch, collate_fn=collate)


def _ids(batches):
    return [b["input_ids"].flatten().tolist() for b in batches]


def _consume(loader, steps):
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return loader.state_dict()


def test_case_resume_on_more_processes_refuses_naming_both_settings():
    """User case n8 (world-size resume): checkpointed on 1 process x batch 4 after 4 steps (sequences 0-15 of
    the epoch order) and resumed on 2 processes x batch 4, sequences 16-31 were skipped silently. Lightning counts
    the remaining steps of the epoch from the checkpoint, so a changed global batch cannot continue mid-epoch."""
    state = _consume(_loader(40, 1, 0, 4), 4)
    assert (state["sequences"], state["global_batch"], state["world_size"]) == (16, 4, 1)
    with pytest.raises(ValueError, match=(
            r"cannot resume mid-epoch \(epoch 0, after 16 sequences\): the checkpoint was trained with world size 1 "
            r"x batch 4 \(global batch 4\), this run has world size 2 x batch 4 \(global batch 8\); keep devices x "
            r"data.batch_size = 4 to resume here")):
        _loader(40, 2, 0, 4).load_state_dict(state)


@pytest.mark.parametrize("window", [0, 8])
def test_resume_on_another_world_size_with_the_same_global_batch_continues_at_the_next_sequence(window):
    """Another resume point: 2 processes x batch 2 -> 1 process x batch 4, and 1 x 4 -> 2 x 2, after 3 steps."""
    order = sum(_ids(_loader(40, 1, 0, 4, window)), [])
    one = _loader(40, 1, 0, 4, window)
    one.load_state_dict(_consume(_loader(40, 2, 0, 2, window), 3))
    assert sum(_ids(one), []) == order[12:]
    state = _consume(_loader(40, 1, 0, 4, window), 3)
    ranks = []
    for rank in range(2):
        loader = _loader(40, 2, rank, 2, window)
        loader.load_state_dict(state)
        ranks.append(_ids(loader))
    assert sum((r0 + r1 for r0, r1 in zip(*ranks)), []) == order[12:]


def test_resume_at_an_epoch_boundary_with_any_setting_starts_the_next_epoch():
    done = _loader(40, 1, 0, 4, window=8)
    list(done)
    fresh = _loader(40, 2, 1, 3, window=8)
    fresh.load_state_dict(done.state_dict())
    got = _ids(fresh)
    reference = _loader(40, 2, 1, 3, window=8)
    list(reference)  # epoch 0; the next pass is epoch 1, from its first batch
    assert got == _ids(reference) and len(got) == len(fresh) == 7  # rank 1's share: 20 sequences in batches of 3
    assert fresh.state_dict()["epoch"] == 1 and fresh.state_dict()["consumed"] == len(fresh)
