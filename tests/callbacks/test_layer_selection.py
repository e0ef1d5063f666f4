"""``LayerSelection`` in ``fit``: chooses before the head is built, writes the report, reuses it on resume."""

import json
import random

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from draftkit.callbacks.layer_selection import LayerSelection
from draftkit.target.frozen import FrozenTarget, load_target


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class StubModule(pl.LightningModule):
    """The hook points of Eagle3Module: load_target_model, set_aux_layer_ids, head built in setup."""

    def __init__(self, target: str, aux_layer_ids: list[int] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.head = None
        self.built_with = None

    def load_target_model(self):
        if getattr(self, "_target_model", None) is None:
            self._target_model = load_target(self.hparams.target, "float32")
        return self._target_model

    def set_aux_layer_ids(self, ids):
        if self.head is not None:
            raise RuntimeError("aux layers must be chosen before the head is built")
        self.hparams.aux_layer_ids = list(ids)

    def setup(self, stage):
        model, _ = self.load_target_model()
        self.target = FrozenTarget(model, self.hparams.aux_layer_ids)
        self.built_with = list(self.target.aux_layer_ids)
        self.head = nn.Linear(len(self.built_with) * 64, 1)

    def training_step(self, batch, batch_idx):
        out = self.target(batch["input_ids"], attention_mask=batch["attention_mask"], compute_logits=False)
        return self.head(out.aux_hidden_states.float()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.0)


class RandomChat(pl.LightningDataModule):
    def __init__(self, num=12, b=2, t=48):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.batches = []
        for _ in range(num):
            loss = torch.zeros(b, t, dtype=torch.long)
            loss[:, 16:] = 1
            self.batches.append({"input_ids": torch.randint(0, 256, (b, t), generator=g),
                                 "attention_mask": torch.ones(b, t, dtype=torch.long), "loss_mask": loss})

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None)


def _trainer(root, callback):
    return pl.Trainer(
        default_root_dir=root, max_steps=2, accelerator="cpu", logger=TensorBoardLogger(root, name="tb"),
        callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def _callback(**kw):
    options = {"min_tokens": 64, "warmup_rows": 128, "rerank_top": 3}
    return LayerSelection(num_tokens=kw.pop("num_tokens", 1500), k=kw.pop("k", 3), options=options, **kw)


def test_chooses_before_the_head_is_built(tiny_target_dir, tmp_path):
    module = StubModule(str(tiny_target_dir))
    callback = _callback(entropy_quantile=0.25)
    _trainer(tmp_path, callback).fit(module, datamodule=RandomChat())
    report = json.loads((tmp_path / "analysis" / "layers.json").read_text())
    assert module.built_with == report["chosen"] == callback.chosen == module.hparams.aux_layer_ids
    assert report["entropy_filter"]["quantile"] == 0.25 and report["num_tokens"] < 1500
    assert (tmp_path / "analysis" / "layers_cka.png").exists()
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert any(b"analysis/cka" in e.read_bytes() and b"analysis/entropy" in e.read_bytes() for e in events)
    # the analysis leaves no hooks behind on the target (FrozenTarget's capture hooks live only during a forward)
    model, _ = module.load_target_model()
    assert sum(len(layer._forward_hooks) for layer in model.model.layers) == 0


def test_resumed_run_reuses_the_report(tiny_target_dir, tmp_path, monkeypatch):
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "layers.json").write_text(json.dumps({"chosen": [1, 3, 6]}))

    def boom(*a, **k):
        raise AssertionError("the analysis must not run again")

    monkeypatch.setattr("draftkit.analysis.report.run_layer_analysis", boom)
    module = StubModule(str(tiny_target_dir), aux_layer_ids=[2, 4, 5])
    _trainer(tmp_path, _callback()).fit(module, datamodule=RandomChat())
    assert module.built_with == [1, 3, 6]


def test_bad_options_and_a_bad_report(tiny_target_dir, tmp_path):
    with pytest.raises(ValueError, match="at most one"):
        LayerSelection(entropy_quantile=0.5, entropy_threshold=1.0)
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "layers.json").write_text(json.dumps({"chosen": [2, 2, 5]}))
    with pytest.raises(ValueError, match="repeats a layer"):
        _trainer(tmp_path, _callback()).fit(StubModule(str(tiny_target_dir)), datamodule=RandomChat())
    with pytest.raises(ValueError, match="k=8 exceeds the 7 candidate layers"):
        _trainer(tmp_path / "other", _callback(k=8)).fit(StubModule(str(tiny_target_dir)), datamodule=RandomChat())


def _chat_file(tmp_path):
    """40 random two-turn conversations of a 10-word vocabulary (seeded)."""
    rng = random.Random(0)
    data = tmp_path / "chat.jsonl"
    words = ["the", "draft", "head", "reads", "aux", "states", "and", "predicts", "next", "token"]
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choices(words, k=5))},
        {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(10, 25)))}]}) + "\n" for _ in range(40)))
    return data


def test_with_the_eagle3_module_and_chat_datamodule(tiny_target_dir, tmp_path, monkeypatch):
    """Integration with Eagle3Module's and ChatDataModule's hook points."""
    import draftkit.data.datamodule as module_mod
    import draftkit.models.eagle3 as eagle3
    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    data = _chat_file(tmp_path)
    model = eagle3.Eagle3Module(target=str(tiny_target_dir), target_dtype="float32", draft_vocab_size=64,
                                ttt=eagle3.TTTConfig(steps=2))
    dm = module_mod.ChatDataModule(path=str(data), tokenizer=str(tiny_target_dir), max_length=128, val_size=4, batch_size=4)
    trainer = pl.Trainer(default_root_dir=tmp_path / "run", max_steps=1, accelerator="cpu", logger=False,
                         callbacks=[_callback(num_tokens=800)], enable_checkpointing=False, limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    report = json.loads((tmp_path / "run" / "analysis" / "layers.json").read_text())
    assert list(model.head.config.aux_layer_ids) == report["chosen"]


def test_auto_hidden_state_cache_is_written_for_the_chosen_layers(tiny_target_dir, tmp_path, monkeypatch):
    """``hidden_states_cache: auto`` with LayerSelection: the cache is written after the choice, for the chosen aux
    layers, and the head trains offline from it (it used to be written for the default [2, 4, 5] in the
    datamodule's setup, before any callback ran, and the head's build refused it)."""
    from draftkit.data.datamodule import ChatDataModule
    from draftkit.models.eagle3 import Eagle3Module, TTTConfig
    from draftkit.target.lm_head import TargetLMHead

    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("draftkit.analysis.report.run_layer_analysis", lambda *a, **kw: {"chosen": [1, 3, 6]})
    data = _chat_file(tmp_path)
    model = Eagle3Module(target=str(tiny_target_dir), target_dtype="float32", draft_vocab_size=64,
                         ttt=TTTConfig(steps=2))
    dm = ChatDataModule(path=str(data), tokenizer=str(tiny_target_dir), max_length=128, val_size=4, batch_size=4,
                        hidden_states_cache="auto")
    trainer = pl.Trainer(default_root_dir=tmp_path / "run", max_steps=1, accelerator="cpu", logger=False,
                         callbacks=[_callback(num_tokens=800)], enable_checkpointing=False, limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    assert list(model.head.config.aux_layer_ids) == [1, 3, 6]
    assert dm.hidden_states.fingerprint["aux_layer_ids"] == [1, 3, 6] and not dm.auto_cache_pending
    assert isinstance(model.target, TargetLMHead)  # trained offline, from the cache


# LayerSelection hands the analysis a figure writer only when the logger has one (issue 36).


@pytest.mark.parametrize("logger", ["tensorboard", "csv", "none"])
def test_layer_selection_writer_only_from_a_logger_with_figures(logger, tiny_target_dir, tmp_path, monkeypatch):
    seen = []

    def analysis(model, batches, config, exclude, path, writer, meta, device):
        seen.append(writer)
        return {"chosen": [1, 3, 6]}

    monkeypatch.setattr("draftkit.analysis.report.run_layer_analysis", analysis)
    made = {"tensorboard": lambda: TensorBoardLogger(tmp_path, name="tb"), "csv": lambda: CSVLogger(tmp_path),
            "none": lambda: False}[logger]()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=1, accelerator="cpu", logger=made,
                         callbacks=[LayerSelection(k=3)], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = StubModule(str(tiny_target_dir))
    trainer.fit(module, datamodule=RandomChat(num=2))
    assert module.built_with == [1, 3, 6]
    assert len(seen) == 1
    if logger == "tensorboard":
        assert seen[0] is trainer.logger.experiment and hasattr(seen[0], "add_figure")
    else:  # CSVLogger's experiment has no add_figure: no writer, not a crash in log_figures
        assert seen[0] is None
