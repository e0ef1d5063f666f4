"""A validation split with no supervised row while ``ModelCheckpoint`` monitors ``val/tau_sim`` is a user error
(exit 2) naming ``data.val_size`` and ``data.path``: at the sanity check when it saw every validation batch
(before any optimizer step), else at the first validation; no checkpoint is written (issue 30, case x01)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftkit.commands import main

REPO = Path(__file__).resolve().parents[2]

# case x01: four short ShareGPT records; data.val_size 1 holds out one whose assistant rows have no target top
# token in the tiny target's 64-id draft vocab
RECORDS = [
    {"id": "ok1", "conversations": [{"from": "human", "value": "What is 1 plus 1?"},
                                    {"from": "gpt", "value": "1 plus 1 is 2."}]},
    {"id": "ok2", "conversations": [{"from": "human", "value": "What is 2 plus 2?"},
                                    {"from": "gpt", "value": "2 plus 2 is 4."}]},
    {"id": "color", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a color."},
                                      {"from": "gpt", "value": "Blue."}]},
    {"id": "paris", "conversations": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}]},
]


@pytest.mark.parametrize("sanity_steps, stopped", [
    (2, "stopped at the sanity check, before the first optimizer step"),  # the sanity check sees the one batch
    # no sanity check: known at the first validation, after 2 training batches, one without a trainable token
    (0, "stopped at optimizer step 1"),
])
def test_validation_with_nothing_to_measure_is_a_user_error(tmp_path, monkeypatch, capsys, sanity_steps, stopped):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    data = tmp_path / "x01-small-val.json"
    data.write_text(json.dumps(RECORDS))
    root = tmp_path / "run"
    code = main(["fit", "--recipe", "recipes/tiny-debug.yaml", "--data.path", str(data), "--data.val_size", "1",
                 "--data.batch_size", "1", "--trainer.val_check_interval", "2", "--trainer.max_steps", "4",
                 "--trainer.num_sanity_val_steps", str(sanity_steps), "--trainer.default_root_dir", str(root),
                 "--trainer.enable_progress_bar", "false"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err == (
        f"draftkit fit: error: validation has nothing to measure: its 1 sequence(s) (data.val_size=1 held out from "
        f"data.path={data}; trainer.limit_val_batches=2) have no supervised row at TTT step(s) [0, 1, 2] (step k "
        "supervises row p when token p+2+k is an assistant token and the target's top token after p+1+k is one of "
        "the model.draft_vocab_size=64 draft ids), so val/tau_sim, which a callback monitors, is never logged; raise "
        "data.val_size (or hold out conversations with longer assistant turns), raise model.draft_vocab_size or "
        f"lower model.ttt.steps; {stopped}, no checkpoint written"
    )
    assert list(root.rglob("*.ckpt")) == []
