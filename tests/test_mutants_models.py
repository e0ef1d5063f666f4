"""``draftkit.models.eagle3.Eagle3Module`` validation (issue 36 survivor): ``val/loss`` is logged as soon as TTT
step 0 supervised any weight, one token included."""

from __future__ import annotations

import pytest
import torch

from draftkit.data.datamodule import ChatDataModule
from draftkit.models.eagle3 import Eagle3Module
from tests.models.test_eagle3_module import _fit


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_val_loss_logged_with_one_supervised_token(weight, tiny_target_dir, tiny_chat_jsonl, tmp_path):
    torch.manual_seed(0)
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), max_length=64, val_size=2, batch_size=3)
    dm.setup("fit")
    model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=320, ttt={"steps": 1})
    model.build(dm)
    real, totals = model.ttt_loss, []

    def ttt_loss(batch, batch_idx=0):  # validation: step 0's weighted count is `weight` (one token, or half of one)
        total, stats = real(batch, batch_idx)
        if not model.training:
            loss_sum, correct_sum, w_sum = stats[0]
            stats = [(loss_sum / w_sum * weight, correct_sum / w_sum * weight, w_sum / w_sum * weight)]
            totals.append(float(total))
        return total, stats

    model.ttt_loss = ttt_loss
    _, rows = _fit(model, dm, tmp_path, "val/loss", max_steps=1, val_check_interval=1, limit_val_batches=1)
    logged = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(totals) == 1 and logged == pytest.approx(totals, rel=1e-6)  # one validation batch: its loss
