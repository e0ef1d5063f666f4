"""Which engines serve an EAGLE3 head for a target family (``ENGINE_TARGET_FAMILIES``, eagle3-format.md §7.7):
``draftkit export`` warns, naming the engine, the target's model_type and the engines that serve it, and still
writes the export; the sidecar records the target's model_type."""

from __future__ import annotations

import json
import logging

import pytest
from export_helpers import make_head, write_checkpoint

from draftkit.artifacts import resolve_model_dir
from draftkit.export import ENGINES
from draftkit.export.common import CHECKED_TARGET_FAMILIES, ENGINE_TARGET_FAMILIES, engine_family_warning
from draftkit.export.exporter import export_checkpoint
from draftkit.heads.eagle3_llama import SUPPORTED_MODEL_TYPES

LOGGER = "draftkit.export.exporter"


def test_the_table_covers_every_engine_and_every_supported_family():
    assert set(ENGINE_TARGET_FAMILIES) == set(ENGINES) == {"vllm", "speculators", "sglang", "trtllm", "llamacpp"}
    assert set(SUPPORTED_MODEL_TYPES) <= CHECKED_TARGET_FAMILIES
    for engine, families in ENGINE_TARGET_FAMILIES.items():
        assert families <= CHECKED_TARGET_FAMILIES, engine
    # as read in the engines' model files (vLLM 0.34.0, SGLang 0.5.23, TensorRT-LLM source)
    assert {e for e, f in ENGINE_TARGET_FAMILIES.items() if "gemma3_text" in f} == {"sglang"}
    assert not any("gemma2" in f for f in ENGINE_TARGET_FAMILIES.values())
    for family in ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "deepseek_v3"):
        assert all(family in f for e, f in ENGINE_TARGET_FAMILIES.items() if e != "llamacpp"), family
    # llama.cpp b11434 records target layer inputs only in some graphs (src/models/*.cpp: res->t_layer_inp)
    assert ENGINE_TARGET_FAMILIES["llamacpp"] == {"llama", "mistral", "qwen3", "qwen3_moe", "gpt_oss"}
    assert "engines that serve it: sglang." in engine_family_warning("llamacpp", "gemma3_text")


def test_warning_text_per_case():
    assert engine_family_warning("vllm", "qwen3_moe") is None
    assert engine_family_warning("sglang", "gemma3_text") is None
    msg = engine_family_warning("vllm", "gemma3_text")
    assert msg.startswith("--to vllm: vllm's model for target model_type 'gemma3_text' does not declare EAGLE3")
    assert "engines that serve it: sglang." in msg
    assert "engines that serve it: none." in engine_family_warning("trtllm", "gemma2")
    unknown = engine_family_warning("sglang", "falcon")
    assert unknown.startswith("--to sglang: EAGLE3 support for target model_type 'falcon' in sglang was not checked")
    assert "not checked" in engine_family_warning("myengine", "llama")
    assert "not checked" in engine_family_warning("vllm", None)


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    head, ids = make_head(resolve_model_dir("tiny:gemma3_text"))
    return write_checkpoint(tmp_path_factory.mktemp("gemma3") / "h.ckpt", head, "tiny:gemma3_text", ids)


@pytest.mark.parametrize("engine", ["vllm", "speculators", "sglang", "trtllm"])
def test_export_warns_for_an_engine_without_the_family(engine, gemma3_checkpoint, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = export_checkpoint(gemma3_checkpoint, engine, tmp_path / engine, target_name="org/tiny-gemma3")
    side = json.loads((out / "draftkit_export.json").read_text())
    assert side["target_model_type"] == "gemma3_text"
    family = [r.getMessage() for r in caplog.records if "model_type 'gemma3_text'" in r.getMessage()]
    if engine == "sglang":
        assert family == []
    else:
        assert family == [engine_family_warning(engine, "gemma3_text")]
        assert f"--to {engine}: " in family[0] and "engines that serve it: sglang." in family[0]
    assert (out / "model.safetensors").exists()  # warned, not refused


def test_export_of_a_served_family_does_not_warn_and_re_export_keeps_the_model_type(tmp_path, caplog):
    head, ids = make_head(resolve_model_dir("tiny:llama"))
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, "tiny:llama", ids)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = export_checkpoint(ckpt, "trtllm", tmp_path / "a", target_name="org/tiny-llama")
        again = export_checkpoint(first, "vllm", tmp_path / "b")
    assert "EAGLE3" not in caplog.text
    for out in (first, again):
        assert json.loads((out / "draftkit_export.json").read_text())["target_model_type"] == "llama"
