"""Export -> reload round trips, strict tensor sets, exact configs and bad-input handling (eagle3-format.md §7)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from export_helpers import make_head, save_tiny_target, write_checkpoint
from safetensors.torch import load_file

from draftkit.commands import main as draftkit_main
from draftkit.export import export_checkpoint, load_exported_head, reference_forward
from draftkit.export import exporter as exporter_mod
from draftkit.export import sglang as sglang_engine
from draftkit.export import speculators as speculators_engine
from draftkit.export import vllm as vllm_engine
from draftkit.export.common import rope_legacy_fields
from draftkit.heads.eagle3_llama import Eagle3Config, KVCache

ENGINES = ["vllm", "speculators", "sglang", "trtllm"]

MID = [
    "input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]
# What the engines' loaders consume (vLLM llama_eagle3.py load_weights, SGLang llama_eagle3.py, TRT-LLM
# Eagle3DraftModel); t2d is read by none but written for draftkit and skipped by all.
REQUIRED = {
    "midlayer.": {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {"midlayer." + k for k in MID},
    "layers.0.": {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {"layers.0." + k for k in MID},
}
PREFIX = {"vllm": "midlayer.", "speculators": "layers.0.", "sglang": "midlayer.", "trtllm": "midlayer."}


def _serve(head, aux, ids, embedding_rows=None):
    """Prefill 5 positions from aux states, then 3 chained single-token draft steps; returns all logits."""
    cache, logits = KVCache(), []
    t = aux.shape[1]
    feat = head.project(aux)
    for step in range(4):
        lo, hi = (0, t) if step == 0 else (t + step - 1, t + step)
        out, h = head(ids[:, lo + 1:hi + 1], feat, torch.arange(lo, hi)[None], cache=cache)
        logits.append(out)
        feat = h[:, -1:]
    return torch.cat(logits, dim=1)


def _inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    aux = torch.randn(2, 5, cfg.num_aux_layers * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    return emb, aux, ids


@pytest.mark.parametrize("engine", ENGINES)
def test_export_reload_gives_identical_logits(engine, tiny_checkpoint, tmp_path):
    ckpt, head = tiny_checkpoint
    out = export_checkpoint(ckpt, engine, tmp_path / engine, dtype="float32")
    emb, aux, ids = _inputs(head.config)
    head.load_embedding(emb)
    loaded, meta = load_exported_head(out, embedding=emb)
    with torch.no_grad():
        want = _serve(head, aux, ids)
        got = _serve(loaded, aux, ids)
    assert got.shape == (2, 5 + 3, 96)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    assert meta["aux_layer_ids"] == [2, 4, 5]
    assert meta["target"] == head_target(ckpt)
    assert meta["ttt"] == {"steps": 7, "decay": 0.8} and meta["chat_template"] is None
    assert meta["head_config"]["draft_vocab_size"] == 96 and meta["engine"] == engine


def head_target(ckpt):
    return torch.load(ckpt, weights_only=False)["draftkit"]["target"]


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_independent_reference_forward_matches_head(engine, tiny_target_dir, tmp_path):
    """A §3 forward written without draftkit.heads reproduces the training module on the exported tensors."""
    head, ids_ = make_head(tiny_target_dir, aux_layer_ids=[1, 3, 6])
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids_)
    out = export_checkpoint(ckpt, engine, tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    if engine == "speculators":
        config = {**config["transformer_layer_config"], "norm_before_residual": config["norm_before_residual"]}
    weights = load_file(str(out / "model.safetensors"))
    emb, aux, ids = _inputs(head.config, seed=3)
    head.load_embedding(emb)
    with torch.no_grad():
        want = _serve(head, aux, ids)
    got, past, feat = [], None, aux
    for step in range(4):
        lo, hi = (0, 5) if step == 0 else (4 + step, 5 + step)
        logits, h, past = reference_forward(weights, config, ids[:, lo + 1:hi + 1], feat, torch.arange(lo, hi)[None]
                                            .expand(2, -1), emb, past=past, project=step == 0)
        got.append(logits)
        feat = h[:, -1:]
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-5, rtol=0)


def test_bfloat16_export_equals_rounded_head(tiny_checkpoint, tmp_path):
    ckpt, head = tiny_checkpoint
    out = export_checkpoint(ckpt, "vllm", tmp_path / "bf16")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    emb, aux, ids = _inputs(head.config)
    head.load_embedding(emb)
    loaded, meta = load_exported_head(out, embedding=emb)
    assert meta["dtype"] == "bfloat16"
    with torch.no_grad():
        torch.testing.assert_close(_serve(loaded, aux, ids), _serve(head, aux, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_required_key_and_no_unknown_key(engine, tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint
    out = export_checkpoint(ckpt, engine, tmp_path / engine)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == REQUIRED[PREFIX[engine]]  # no embed_tokens when H == H_t, no prefix leftovers
    files = {p.name for p in out.iterdir()}
    assert files == {"config.json", "model.safetensors", "draftkit_export.json"} | (
        {"trtllm_spec.yaml"} if engine == "trtllm" else set())
    config = json.loads((out / "config.json").read_text())
    flags = config  # all four norm flags are explicit, top level, in every engine config
    assert {k: flags[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == dict.fromkeys(
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dirs left behind


def test_vllm_config_matches_format_doc_example():
    """§7.2's SmolLM2 example with the non-default layer set, key for key and in order."""
    cfg = Eagle3Config(hidden_size=576, target_hidden_size=576, num_aux_layers=3, intermediate_size=1536,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                       draft_vocab_size=8192, rms_norm_eps=1e-05, max_position_embeddings=8192,
                       rope={"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    expected = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
        "vocab_size": 49152, "draft_vocab_size": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": [4, 13, 26],
    }
    got = vllm_engine.build_config(cfg, [4, 13, 26], 30, "bfloat16")
    assert got == expected and list(got) == list(expected)
    default = vllm_engine.build_config(cfg, [2, 15, 27], 30, "bfloat16")
    assert "eagle_aux_hidden_state_layer_ids" not in default and "target_hidden_size" not in default

    sgl = sglang_engine.build_config(cfg, [4, 13, 26], 30, "bfloat16", sglang_engine.PLUS_ONE)
    assert "eagle_aux_hidden_state_layer_ids" not in sgl
    assert sgl["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [3, 12, 25]}
    assert {k: v for k, v in sgl.items() if k != "eagle_config"} == {
        k: v for k, v in expected.items() if k != "eagle_aux_hidden_state_layer_ids"}

    spec = speculators_engine.build_config(cfg, [4, 13, 26], 30, "bfloat16", verifier="/models/smollm2",
                                           verifier_architectures=["LlamaForCausalLM"], num_speculative_tokens=3)
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_version"] == speculators_engine.ENGINE_VERSION
    assert spec["target_hidden_size"] is None and spec["draft_vocab_size"] == 8192
    assert spec["eagle_aux_hidden_state_layer_ids"] == [4, 13, 26]
    assert spec["norm_before_residual"] is False and spec["norm_before_fc"] is False
    assert spec["fc_norm"] is False and spec["norm_output"] is False
    layer = spec["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 49152 and layer["rope_theta"] == 100000.0
    assert spec["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "/models/smollm2", "architectures": ["LlamaForCausalLM"]},
    }


def test_rope_fields_are_mirrored_from_rope_parameters():
    assert rope_legacy_fields({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}) == (1e5, None)
    assert rope_legacy_fields({"rope_theta": 1e4}) == (1e4, None)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert rope_legacy_fields({"rope_parameters": {"rope_theta": 5e5, **llama3}}) == (5e5, llama3)
    assert rope_legacy_fields({"rope_theta": 5e5, "rope_scaling": llama3}) == (5e5, llama3)


def test_d2t_is_exported_exactly(tiny_target_dir, tmp_path):
    """§5 example, draft ids [1, 3, 4, 8] inside a V = 320 vocab: d2t = [1, 2, 2, 5]."""
    from draftkit.selection.vocab import VocabMap

    head, ids = make_head(tiny_target_dir, draft_vocab_size=4)
    vm = VocabMap.from_ids(torch.tensor([1, 3, 4, 8]), 320)
    head.set_vocab(vm.d2t, vm.t2d)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    out = export_checkpoint(ckpt, "vllm", tmp_path / "out")
    t = load_file(str(out / "model.safetensors"))
    assert t["d2t"].tolist() == [1, 2, 2, 5]
    assert torch.nonzero(t["t2d"]).flatten().tolist() == [1, 3, 4, 8] and t["t2d"].shape == (320,)
    # vLLM compute_logits: scatter the draft logits into a -inf full vocab at arange(V_d) + d2t
    draft_logits = torch.zeros(1, 4)
    draft_logits[0, 3] = 1.0
    full = torch.full((1, 320), float("-inf"))
    full[:, torch.arange(4) + t["d2t"]] = draft_logits
    assert int(full.argmax()) == 8
    sidecar = json.loads((out / "draftkit_export.json").read_text())
    assert sidecar["vocab"]["draft_vocab_size"] == 4 and len(sidecar["vocab"]["fingerprint"]) == 64


def test_cli_main_writes_and_refuses_existing(tiny_checkpoint, tmp_path, capsys):
    ckpt, _ = tiny_checkpoint
    out = tmp_path / "cli"
    assert draftkit_main(["export", str(ckpt), "--to", "sglang", str(out), "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "launch: python -m sglang.launch_server" in printed and str(out) in printed
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert draftkit_main(["export", str(ckpt), "--to", "sglang", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert draftkit_main(["export", str(ckpt), "--to", "sglang", str(out), "--overwrite"]) == 0
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli", "head.ckpt"]


def test_checkpoint_for_another_target_names_both(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint
    other = save_tiny_target(tmp_path / "wide", hidden_size=96, vocab_size=400)
    with pytest.raises(ValueError) as err:
        export_checkpoint(ckpt, "vllm", tmp_path / "out", target=other)
    msg = str(err.value)
    assert "hidden size 64 and vocab 320" in msg and "hidden_size 96 and vocab_size 400" in msg
    assert not (tmp_path / "out").exists()
    vocab_only = save_tiny_target(tmp_path / "vocab", vocab_size=400)
    with pytest.raises(ValueError, match="vocab_size 400"):
        export_checkpoint(ckpt, "vllm", tmp_path / "out", target=vocab_only)


def test_missing_d2t_is_refused(tiny_target_dir, tmp_path):
    head, ids = make_head(tiny_target_dir)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids, drop=("d2t",))
    with pytest.raises(ValueError, match=r"no draft-vocab map \(head.d2t\).*V_d=96 < V=320"):
        export_checkpoint(ckpt, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_full_vocab_without_d2t_exports_no_map(tiny_target_dir, tmp_path):
    """V_d == V: a checkpoint without d2t/t2d is the identity, and the export carries none (issue 34 M1)."""
    head, ids = make_head(tiny_target_dir, draft_vocab_size=320)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids, drop=("d2t", "t2d"))
    out = export_checkpoint(ckpt, "sglang", tmp_path / "out")
    t = load_file(str(out / "model.safetensors"))
    assert "d2t" not in t and "t2d" not in t and len(t) == len(REQUIRED["midlayer."]) - 2


def test_missing_t2d_is_rebuilt_from_d2t_with_its_offset(tiny_target_dir, tmp_path):
    """A checkpoint with d2t but no t2d, draft ids [1, 3, 4, 8] of V = 320: t2d marks ids i + d2t[i]."""
    from draftkit.selection.vocab import VocabMap

    head, ids = make_head(tiny_target_dir, draft_vocab_size=4)
    vm = VocabMap.from_ids(torch.tensor([1, 3, 4, 8]), 320)
    head.set_vocab(vm.d2t, vm.t2d)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids, drop=("t2d",))
    t = load_file(str(export_checkpoint(ckpt, "vllm", tmp_path / "out") / "model.safetensors"))
    assert t["d2t"].tolist() == [1, 2, 2, 5]
    assert torch.nonzero(t["t2d"]).flatten().tolist() == [1, 3, 4, 8] and t["t2d"].shape == (320,)


def test_unexpected_head_tensor_is_refused(tiny_target_dir, tmp_path):
    head, ids = make_head(tiny_target_dir)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids,
                            state_extra={"head.midlayer.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected \['midlayer.extra.weight'\]"):
        export_checkpoint(ckpt, "vllm", tmp_path / "out")


def test_interrupted_export_leaves_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    ckpt, _ = tiny_checkpoint

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("simulated interruption after the files were written")

    monkeypatch.setattr(exporter_mod, "verify_export", boom)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(ckpt, "vllm", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.ckpt"]
    # an interrupted --overwrite keeps the previous export intact
    monkeypatch.undo()
    out = export_checkpoint(ckpt, "vllm", tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(exporter_mod, "verify_export", boom)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(ckpt, "vllm", tmp_path / "out", overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.ckpt", "out"]


def test_corrupted_export_fails_the_reference_loader(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint
    out = export_checkpoint(ckpt, "vllm", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    del config["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="norm flags"):
        load_exported_head(out)
    config["norm_before_residual"] = False
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        load_exported_head(out)


def test_non_standard_head_refused_by_sglang_and_trtllm(tiny_target_dir, tmp_path):
    head, ids = make_head(tiny_target_dir, norm_before_residual=True)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    for engine in ("sglang", "trtllm"):
        with pytest.raises(ValueError, match="norm_before_residual=true"):
            export_checkpoint(ckpt, engine, tmp_path / engine)
        assert not (tmp_path / engine).exists()
    out = export_checkpoint(ckpt, "speculators", tmp_path / "spec", dtype="float32")
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is True
    emb, aux, ids_ = _inputs(head.config)
    head.load_embedding(emb)
    loaded, _ = load_exported_head(out, embedding=emb)
    with torch.no_grad():
        torch.testing.assert_close(_serve(loaded, aux, ids_), _serve(head, aux, ids_), atol=1e-5, rtol=0)


def test_sglang_unexpressible_ids_error(tiny_target_dir, tmp_path):
    head, ids = make_head(tiny_target_dir, aux_layer_ids=[1, 4, 6])
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    with pytest.raises(ValueError, match="cannot be expressed for SGLang"):
        export_checkpoint(ckpt, "sglang", tmp_path / "o", sglang_aux_rule=sglang_engine.PLUS_ONE_IF_FIRST_IS_ONE)
    with pytest.raises(ValueError, match="newer than the last release"):
        export_checkpoint(ckpt, "sglang", tmp_path / "o", sglang_version="0.6.0")
    out = export_checkpoint(ckpt, "sglang", tmp_path / "o")  # default pinned release: unconditional +1
    side = json.loads((out / "draftkit_export.json").read_text())
    assert side["engine_version"] == "0.5.23" and side["engine_aux_rule"] == "plus_one"
    assert json.loads((out / "config.json").read_text())["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}


def test_sidecar_records_the_provenance(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint
    out = export_checkpoint(ckpt, "trtllm", tmp_path / "t", num_speculative_tokens=4)
    side = json.loads((out / "draftkit_export.json").read_text())
    assert side["engine"] == "trtllm" and side["engine_version"] == "1.2.1"
    assert side["aux_layer_ids"] == [2, 4, 5] and side["aux_layer_ids_default"] is True
    assert side["engine_aux_layer_ids"] is None and side["target_num_layers"] == 8
    assert side["ttt"] == {"steps": 7, "decay": 0.8} and side["source_checkpoint"] == Path(ckpt).name
    assert side["launch"] == f"trtllm-serve {side['target_name']} --extra_llm_api_options {out}/trtllm_spec.yaml"
    spec = (out / "trtllm_spec.yaml").read_text()
    assert "max_draft_len: 4" in spec and "eagle3_layers_to_capture" not in spec
    assert side["target_path"] == Path(side["target_name"]).name  # named, no path of the exporting machine


def test_portable_path_names_what_lies_outside_the_working_directory(tmp_path, monkeypatch):
    from draftkit.export.common import portable_path

    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    assert portable_path(tmp_path / "repo" / "runs" / "last.ckpt") == "runs/last.ckpt"
    assert portable_path("runs/last.ckpt") == "runs/last.ckpt"
    assert portable_path(tmp_path / "cache" / "hf" / "SmolLM2-135M-b179") == "SmolLM2-135M-b179"
    assert portable_path("org/model") == "org/model"  # a hub id is no local path: kept as written


@pytest.mark.parametrize("engine", ENGINES)
def test_an_export_directory_re_exports_byte_identical_weights(engine, tiny_checkpoint, tmp_path):
    """A shipped export (any layout) re-exports for every engine with exactly the tensors the checkpoint gives."""
    ckpt, _ = tiny_checkpoint
    shipped = export_checkpoint(ckpt, engine, tmp_path / "shipped")
    for to in ENGINES:
        direct = load_file(export_checkpoint(ckpt, to, tmp_path / f"direct-{to}") / "model.safetensors")
        again_dir = export_checkpoint(shipped, to, tmp_path / f"again-{to}")
        again = load_file(again_dir / "model.safetensors")
        assert again.keys() == direct.keys()
        assert all(again[k].dtype == direct[k].dtype and torch.equal(again[k], direct[k]) for k in direct), to
        side = json.loads((again_dir / "draftkit_export.json").read_text())
        first = json.loads((tmp_path / f"direct-{to}" / "draftkit_export.json").read_text())
        assert side["source_checkpoint"] == shipped.name
        for key in ("aux_layer_ids", "vocab", "head_config", "tokenizer_fingerprint", "target", "ttt", "launch"):
            if key != "launch":
                assert side[key] == first[key], (to, key)
        assert side["launch"] == first["launch"].replace(str(tmp_path / f"direct-{to}"), str(again_dir))


# The speculators exporter names the verifier's own architecture; the exporter's k boundary, self-check and
# chain-only note (issue 36).


def _source(architectures):
    cfg = Eagle3Config(hidden_size=64, target_hidden_size=64, num_aux_layers=3, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                       draft_vocab_size=96, rms_norm_eps=1e-05, max_position_embeddings=512,
                       rope={"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}})
    target_config = SimpleNamespace() if architectures is None else SimpleNamespace(architectures=architectures)
    return SimpleNamespace(config=cfg, aux_layer_ids=[1, 3, 6], num_layers=8, target_config=target_config,
                           serving_name="/models/tiny")


@pytest.mark.parametrize(("architectures", "expected"), [
    (["Qwen2ForCausalLM"], ["Qwen2ForCausalLM"]),  # the target's own, not the Llama fallback
    (None, ["LlamaForCausalLM"]),  # a config without the field
    ([], ["LlamaForCausalLM"]),
])
def test_verifier_architectures_are_the_targets(architectures, expected):
    files = speculators_engine.build_files(_source(architectures), "/out", "float32", 3, {})
    verifier = files["config"]["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "/models/tiny", "architectures": expected}
    assert files["speculation"] == {"speculative_tokens": 3}


def test_one_draft_token_is_a_valid_k():
    """``draftkit.export.exporter``: k = 1 is the smallest k (the boundary of ``k < 1``), 0 is refused."""
    from draftkit.export.exporter import _draft_tokens

    assert (_draft_tokens(1, None), _draft_tokens(None, None)) == (1, 3)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        _draft_tokens(0, None)


def test_verify_export_returns_the_largest_logit_difference(tmp_path):
    """The self-check of a float32 export reports its largest difference: above 0 (the reference forward's
    rounding), below the 1e-4 tolerance (not a start value)."""
    from draftkit.export.exporter import export_checkpoint, verify_export
    from draftkit.heads.checkpoint import read_checkpoint
    from tests.export.export_helpers import make_head, save_tiny_target, write_checkpoint

    target = save_tiny_target(tmp_path / "tiny")
    head, ids = make_head(target)
    ckpt = write_checkpoint(tmp_path / "head.ckpt", head, target, ids)
    out = export_checkpoint(ckpt, "vllm", tmp_path / "out", dtype="float32", num_speculative_tokens=1)
    worst = verify_export(out, read_checkpoint(ckpt))
    assert 0.0 < worst < 1e-4  # the reference forward differs from the head by rounding, not by 0 exactly


def test_chain_only_engine_warns_that_it_serves_the_trees_depth(tmp_path, caplog):
    """``draftkit.export.exporter``: vLLM given a tree logs the engine's note (it drafts a chain of the depth)."""
    import logging

    from draftkit.export import Speculation
    from draftkit.export.exporter import export_checkpoint
    from draftkit.export.speculation import chain_only_note
    from tests.export.export_helpers import make_head, save_tiny_target, write_checkpoint

    target = save_tiny_target(tmp_path / "tiny")
    head, ids = make_head(target)
    ckpt = write_checkpoint(tmp_path / "head.ckpt", head, target, ids)
    speculation = Speculation.parse("3,2,6")
    with caplog.at_level(logging.WARNING, logger="draftkit.export.exporter"):
        export_checkpoint(ckpt, "vllm", tmp_path / "out", dtype="float32", speculation=speculation)
    note = chain_only_note(speculation.tree)
    assert note and [r.getMessage() for r in caplog.records if r.name == "draftkit.export.exporter"
                     and r.levelno == logging.WARNING] == [f"vllm: {note}"]


def test_overwrite_replaces_only_an_earlier_export(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """``export CKPT run/checkpoints --overwrite true`` replaced the run's checkpoints folder, the exported
    checkpoint among them, with the export (exit 0); any folder given by mistake (``.``, a data folder) went too."""
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    ckpt, _ = tiny_checkpoint
    run = tmp_path / "run"
    run.mkdir()
    inside = run / "last.ckpt"
    inside.write_bytes(ckpt.read_bytes())
    (run / "best.ckpt").write_bytes(b"another checkpoint")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (data / name).write_text("{}\n")
    cases = [
        (inside, run, f"--overwrite: {run} holds the checkpoint being exported ({inside}); replacing it would delete "
                      "it: give another export directory"),
        (ckpt, data, f"--overwrite replaces only an earlier export directory (one holding draftkit_export.json), and "
                     f"{data} is none: it holds a.jsonl, b.jsonl; give a new directory, or empty this one"),
        (ckpt, data / "a.jsonl", f"--overwrite replaces only an earlier export directory, and {data / 'a.jsonl'} is "
                                 "a file or a link: give another export directory"),
    ]
    for source, out, message in cases:
        assert draftkit_main(["export", str(source), str(out), "--to", "vllm", "--overwrite", "true"]) == 2
        assert capsys.readouterr().err == f"draftkit export: error: {message}\n"
    assert sorted(p.name for p in run.iterdir()) == ["best.ckpt", "last.ckpt"]
    assert sorted(p.name for p in data.iterdir()) == ["a.jsonl", "b.jsonl"]
    # an earlier export, an empty folder and an export re-exported in place are replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    for source, out in ((ckpt, run / "exp"), (ckpt, run / "exp"), (ckpt, empty), (run / "exp", run / "exp")):
        assert draftkit_main(["export", str(source), str(out), "--to", "sglang", "--overwrite", "true"]) == 0
    assert json.loads((run / "exp" / "draftkit_export.json").read_text())["engine"] == "sglang"
