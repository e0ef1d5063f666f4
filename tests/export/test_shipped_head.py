"""The head shipped under checkpoints/ (issue 13): it loads as the default recipe's head, its report is the
80-prompt lossless check, and (slow) it evaluates and re-exports against the real SmolLM2 out of the box."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftkit.export import export_checkpoint, load_exported_head

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "checkpoints" / "smollm2-135m-eagle3-head"
TAU_K5 = 1.5874  # chain k = 5 in the shipped evaluate.json (MADE_BY.md)


def test_shipped_head_is_the_default_recipes_head():
    recipe = yaml.safe_load((REPO / "recipes" / "smollm2-135m-eagle3.yaml").read_text())
    head, meta = load_exported_head(SHIPPED)
    assert meta["target"] == recipe["model"]["target"] and meta["engine"] == "vllm" and meta["dtype"] == "bfloat16"
    assert meta["aux_layer_ids"] == [2, 15, 27] and head.config.draft_vocab_size == recipe["model"]["draft_vocab_size"]
    assert meta["ttt"]["steps"] == recipe["model"]["ttt"]["steps"]
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) <= 25 * 2**20  # issue 13: <= 25 MB
    report = json.loads((SHIPPED / "evaluate.json").read_text())
    assert report["num_prompts"] == 80 and report["temperature"] == 0 and report["setup"]["target_dtype"] == "float32"
    chain = {r["topology"]: r for r in report["sweep"]}["chain k=5"]
    assert chain["greedy_equal"] == 80  # float32 speculative output identical to plain greedy on every prompt
    assert all(r["greedy_equal"] == 80 for r in report["sweep"])  # every chain and tree of the sweep too
    assert chain["tau"] == pytest.approx(TAU_K5, abs=1e-4)  # the figure MADE_BY.md quotes


@pytest.mark.slow
def test_shipped_head_evaluates_and_re_exports(tmp_path):
    from draftkit.commands import main as draftkit_main

    out = tmp_path / "report.json"
    assert draftkit_main(["evaluate", "--checkpoint", str(SHIPPED), "--prompts", "mt-bench", "--num_prompts", "2",
                          "--max_new_tokens", "16", "--dtype", "float32", "--prompt_lookup", "false",
                          "--output", str(out)]) in (0, None)
    report = json.loads(out.read_text())
    assert report["greedy_equal"] == 2 and report["tau"] >= 1.0
    sglang = export_checkpoint(SHIPPED, "sglang", tmp_path / "sglang")
    assert json.loads((sglang / "draftkit_export.json").read_text())["source_checkpoint"] == str(SHIPPED)
