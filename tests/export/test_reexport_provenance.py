"""Re-exporting an export directory keeps what the sidecar recorded (issue 34 M4, M5): the serving name of the
target in the launch line and speculators' verifier, and the trained length; TensorRT-LLM's architecture (M3)."""

from __future__ import annotations

import json
import logging

from export_helpers import make_head, write_checkpoint

from draftkit.artifacts import resolve_model_dir
from draftkit.export.exporter import export_checkpoint

ENGINES = ["vllm", "speculators", "sglang", "trtllm"]


def _read(out):
    return json.loads((out / "config.json").read_text()), json.loads((out / "draftkit_export.json").read_text())


def test_re_export_keeps_the_recorded_target_name(tmp_path, caplog):
    """The shipped head's case: trained on a target only this machine resolves, exported with --target_name;
    re-exporting that directory for each engine names the target as recorded, with no cache-path warning."""
    head, ids = make_head(resolve_model_dir("tiny:llama"))
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, "tiny:llama", ids)
    shipped = export_checkpoint(ckpt, "vllm", tmp_path / "shipped", target_name="org/tiny-llama")
    with caplog.at_level(logging.WARNING, logger="draftkit.export.exporter"):
        for engine in ENGINES:
            config, side = _read(export_checkpoint(shipped, engine, tmp_path / engine))
            assert side["target_name"] == "org/tiny-llama" and side["target"] == "tiny:llama", engine
            if engine == "speculators":
                assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
                assert side["launch"] == f"vllm serve {tmp_path / engine}"
            else:
                assert "org/tiny-llama" in side["launch"] and str(resolve_model_dir("tiny:llama")) not in side["launch"]
    assert "local cache path" not in caplog.text
    # --target_name still wins; a re-export of a directory that only had the cache path warns again
    _, side = _read(export_checkpoint(shipped, "sglang", tmp_path / "named", target_name="other/name"))
    assert side["target_name"] == "other/name" and "--model-path other/name " in side["launch"]
    unnamed = export_checkpoint(ckpt, "vllm", tmp_path / "unnamed")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draftkit.export.exporter"):
        _, side = _read(export_checkpoint(unnamed, "vllm", tmp_path / "unnamed-again"))
    assert side["target_name"] == side["target_path"] and "local cache path" in caplog.text


def test_trtllm_architecture_is_llama_for_causal_lm_with_draft_vocab(tiny_checkpoint, tmp_path):
    """TensorRT-LLM prefixes EAGLE3 to the architecture (EAGLE3LlamaForCausalLM); the others keep theirs."""
    ckpt, _ = tiny_checkpoint
    archs = {e: _read(export_checkpoint(ckpt, e, tmp_path / e))[0] for e in ENGINES}
    assert archs["trtllm"]["architectures"] == ["LlamaForCausalLM"] and archs["trtllm"]["draft_vocab_size"] == 96
    assert archs["vllm"]["architectures"] == archs["sglang"]["architectures"] == ["LlamaForCausalLMEagle3"]
    assert archs["speculators"]["architectures"] == ["Eagle3Speculator"]
