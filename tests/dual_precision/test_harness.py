"""``dual_precision.harness.evaluate_target`` on the tiny target: the same report as the orchestrator run on a
session built by hand, plus what ran; an unknown kernel choice is named."""

import pytest

from draftkit.data.prompts import Prompt, encode_prompt
from draftkit.dual_precision import DualPrecisionConfig, evaluate_dual_precision
from draftkit.dual_precision.harness import evaluate_target
from draftkit.quant import QuantConfig
from draftkit.target.frozen import load_target
from draftkit.target.session import TargetSession
from draftkit.target.tokens import stop_token_ids

PROMPTS = [Prompt(str(i), [{"role": "user", "content": f"count to {i}"}]) for i in range(4)]
CONFIG = DualPrecisionConfig(max_new_tokens=5, k=2, bootstrap_samples=0)


def test_evaluate_target_equals_the_orchestrator_on_a_session_built_by_hand(tiny_target_dir, tmp_path):
    quant = QuantConfig(group_size=32)
    report = evaluate_target(str(tiny_target_dir), PROMPTS[:2], PROMPTS[2:], CONFIG, quant, kernels="stock",
                             record=str(tmp_path / "r.jsonl"))
    model, tokenizer = load_target(str(tiny_target_dir), "float32")
    lm = TargetSession.with_precision_switch(model, quant)
    ids = [encode_prompt(p, tokenizer, "chat") for p in PROMPTS]
    expected = evaluate_dual_precision(lm, ids[:2], ids[2:], CONFIG, stop_token_ids(tokenizer, model.generation_config))
    for key in ("weight_bytes", "thresholds", "calibration", "replay", "methods", "mcnemar", "sizes"):
        assert report[key] == expected[key], key
    assert report["methods"]["verified"]["exact_match"] == 1.0
    assert (report["target"], report["dtype"], report["template"]) == (str(tiny_target_dir), "float32", "chat")
    assert report["record"] == str(tmp_path / "r.jsonl") and report["quant"]["group_size"] == 32
    assert report["kernels"]["kernel"] == "stock" and report["timing_s"]["load_and_quantize"] > 0
    with pytest.raises(ValueError, match="--kernels must be one of auto, onednn, stock, got 'fast'"):
        evaluate_target(str(tiny_target_dir), PROMPTS[:1], [], CONFIG, quant, kernels="fast")
