"""ExportOnCheckpoint on a tiny LightningModule: fit a few steps, then the export reproduces the trained head."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from draftkit.callbacks.export import ExportOnCheckpoint
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig

from draftkit.export import load_exported_head
from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead, KVCache
from draftkit.selection.vocab import VocabMap


class TinyHeadModule(LightningModule):
    """Trains only the head on random features; checkpoints like draftkit's Eagle3Module."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target_ref = target
        cfg = Eagle3Config.from_target_config(AutoConfig.from_pretrained(target), [2, 4, 5], 64)
        torch.manual_seed(0)
        self.head = Eagle3LlamaHead(cfg)
        vm = VocabMap.from_ids(torch.arange(0, 320, 5), 320)
        self.head.set_vocab(vm.d2t, vm.t2d)

    def training_step(self, batch, batch_idx):
        aux, ids = batch
        logits, _ = self.head(ids, self.head.project(aux), torch.arange(ids.shape[1])[None].expand_as(ids))
        return logits.float().logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.head.parameters() if p.requires_grad], lr=0.5)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                    if k.startswith("head.") and not k.startswith("head.embed_tokens.")}
        checkpoint["draftkit"] = {
            "head_config": dataclasses.asdict(self.head.config), "target": self.target_ref,
            "target_dtype": "float32", "aux_layer_ids": [2, 4, 5], "chat_template": None,
            "ttt": {"steps": 7, "decay": 0.8},
        }


def _loader():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 6, 3 * 64, generator=g), torch.randint(0, 320, (8, 6), generator=g))
    return DataLoader(data, batch_size=4)


def _logits(head, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 5, 3 * 64, generator=g)
    ids = torch.randint(0, 320, (1, 5), generator=g)
    with torch.no_grad():
        return head(ids, head.project(aux), torch.arange(5)[None], cache=KVCache())[0]


def test_exports_final_weights_at_fit_end(tiny_target_dir, tmp_path):
    torch.set_num_threads(1)
    module = TinyHeadModule(tiny_target_dir)
    before = module.head.fc.weight.detach().clone()
    cb = ExportOnCheckpoint(engines=["vllm", "sglang"], dtype="float32")
    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(module, _loader())
    assert not torch.equal(module.head.fc.weight, before)  # it trained
    assert sorted(cb.exported) == ["sglang", "vllm"]
    assert cb.exported["vllm"] == (tmp_path / "export" / "vllm").absolute()
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["sglang", "vllm"]  # temp checkpoint removed
    emb = torch.randn(320, 64)
    module.head.load_embedding(emb)
    for engine in ("vllm", "sglang"):
        loaded, meta = load_exported_head(cb.exported[engine], embedding=emb)
        assert meta["aux_layer_ids"] == [2, 4, 5] and meta["engine"] == engine
        torch.testing.assert_close(_logits(loaded), _logits(module.head.eval()), atol=1e-5, rtol=0)


def test_exports_last_checkpoint_into_dirpath(tiny_target_dir, tmp_path):
    torch.set_num_threads(1)
    module = TinyHeadModule(tiny_target_dir)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    cb = ExportOnCheckpoint(engines=["speculators"], dirpath=str(tmp_path / "out"), checkpoint="last")
    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ckpt, cb])
    trainer.fit(module, _loader())
    out = tmp_path / "out" / "vllm-speculators"
    side = json.loads((out / "draftkit_export.json").read_text())
    assert side["source_checkpoint"] == "last.ckpt"
    assert side["dtype"] == "bfloat16"


@pytest.mark.parametrize("kwargs,match", [
    ({"engines": ["onnx"]}, "engines"), ({"engines": []}, "engines"), ({"checkpoint": "first"}, "checkpoint"),
    ({"dtype": "int8"}, "dtype"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
])
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExportOnCheckpoint(**kwargs)


def test_an_engine_that_cannot_take_the_head_stops_the_run_before_training(tiny_target_dir, tmp_path):
    """engines [vllm, llamacpp] on a target that is no GGUF trained the whole run, exported vllm, then failed
    (fit exit 2, no end summary) with a message naming export's --target_gguf, which the callback does not have."""
    torch.set_num_threads(1)
    module = TinyHeadModule(tiny_target_dir)
    before = module.head.fc.weight.detach().clone()
    cb = ExportOnCheckpoint(engines=["vllm", "llamacpp"])
    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with pytest.raises(ValueError) as err:
        trainer.fit(module, _loader())
    assert str(err.value).startswith(
        "ExportOnCheckpoint: engines [llamacpp] cannot take this run's head, so its export at the end of training "
        "would fail (--to llamacpp: the head's GGUF carries the target's tokenizer, and the target ")
    assert str(err.value).endswith("); remove llamacpp from the callback's engines and export the checkpoint with "
                                   "`draftkit export` instead")
    assert trainer.global_step == 0 and torch.equal(module.head.fc.weight, before)  # stopped before training
    assert cb.exported == {} and sorted(p.name for p in tmp_path.iterdir()) == []  # and left nothing behind
