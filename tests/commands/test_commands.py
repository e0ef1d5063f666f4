"""The verb table: --help, one prompt reader and one EOS rule across verbs, recipe paths under
default_root_dir, and an export engine registered in a test offered by the CLI and ExportOnCheckpoint."""

from __future__ import annotations

import copy
import json
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "export"))

from export_helpers import make_head, save_tiny_target, write_checkpoint  # noqa: E402

from draftkit.commands import COMMANDS, LIGHTNING_VERBS, build_parser, main  # noqa: E402


def test_help_lists_every_verb_with_program_name(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: draftkit")
    for verb in ("fit", "validate", "evaluate", "select-layers", "export", "bench", "cache-hidden-states", "generate"):
        assert f"    {verb}" in out, verb
    assert " test " not in out and "predict" not in out
    assert "(chain or EAGLE-2 tree" in " ".join(out.split())  # evaluate's summary names both topologies, as the README
    assert set(LIGHTNING_VERBS) | set(COMMANDS) == {
        "fit", "validate", "evaluate", "evaluate-dual-precision", "select-layers", "export", "bench",
        "cache-hidden-states", "generate"}


def test_prompt_file_reads_the_same_in_fit_evaluate_and_dual_precision(tmp_path, tiny_target_dir):
    """AcceptanceLengthMonitor (fit), evaluate and evaluate-dual-precision see the same prompts and ids."""
    from draftkit.callbacks.acceptance import AcceptanceLengthMonitor
    from draftkit.data.prompts import load_prompts
    from draftkit.target.frozen import load_target
    from draftkit.target.tokens import encode_chat

    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt": "name a colour"},
        {"question_id": 7, "turns": ["count to three", "ignored"]},
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]},
        "a bare string",
    ]).encode() + b"\n")
    expected = load_prompts(str(prompts))
    assert [p.id for p in expected] == ["a", "7", "3", "4"]
    monitor = AcceptanceLengthMonitor(prompts=str(prompts), num_prompts=4)
    monitor._prompts = load_prompts(monitor.prompts, monitor.num_prompts)  # what _decode reads during fit
    assert monitor._prompts == expected

    head, ids = make_head(str(tiny_target_dir), draft_vocab_size=320)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--checkpoint", str(ckpt), "--target", str(tiny_target_dir), "--prompts", str(prompts),
                 "--output", str(out), "--k", "2", "--max_new_tokens", "3", "--dtype", "float32",
                 "--prompt_lookup", "false"]) == 0
    rows = json.loads(out.read_text())["per_prompt"]
    _, tok = load_target(str(tiny_target_dir), "float32")
    assert [r["id"] for r in rows] == [p.id for p in expected]
    assert [r["prompt_tokens"] for r in rows] == [len(encode_chat(tok, p.messages)) for p in expected]

    dual = tmp_path / "dual.json"
    assert main(["evaluate-dual-precision", "--target", str(tiny_target_dir), "--prompts", str(prompts),
                 "--calibration_prompts", "1", "--max_new_tokens", "2", "--bootstrap_samples", "0",
                 "--methods", "[all_high]", "--dtype", "float32", "--output", str(dual)]) == 0
    seen = json.loads(dual.read_text())["prompts"]
    assert sorted(seen["evaluation_ids"] + seen["calibration_ids"]) == sorted(p.id for p in expected)


def test_generation_config_eos_stops_evaluate_and_dual_precision_alike(tiny_target, tiny_tokenizer):
    """A target whose end token is only in its generation config stops there in both evaluators."""
    from draftkit.decoding.harness import evaluate_drafter
    from draftkit.decoding.drafters import PromptLookupDrafter
    from draftkit.sampling import DecodeConfig
    from draftkit.dual_precision import greedy_decode
    from draftkit.target.frozen import FrozenTarget
    from draftkit.target.session import TargetSession
    from draftkit.target.tokens import encode_chat, stop_token_ids

    model = copy.deepcopy(tiny_target).double()
    prompt = encode_chat(tiny_tokenizer, [{"role": "user", "content": "hello there"}])
    lm = TargetSession.with_precision_switch(copy.deepcopy(model))
    free = greedy_decode(lm, prompt, DecodeConfig(8), "high").tokens
    end = next(t for t in free[2:] if t != tiny_tokenizer.eos_token_id)  # a token generated a few steps in
    assert end != tiny_tokenizer.eos_token_id
    model.generation_config.eos_token_id = end
    lm.target.model.generation_config.eos_token_id = end

    eos = stop_token_ids(tiny_tokenizer, lm.target.generation_config)  # the rule evaluate-dual-precision uses
    dual = greedy_decode(lm, prompt, DecodeConfig(8, eos_token_ids=eos), "high").tokens
    report = evaluate_drafter(PromptLookupDrafter(), FrozenTarget(model), tiny_tokenizer, [torch.tensor(prompt)],
                              k=2, max_new_tokens=8, baseline=True, prompt_lookup=False, warmup=False)
    assert dual[-1] == end and end not in dual[:-1] and len(dual) < 8
    assert report["per_prompt"][0]["baseline_new_tokens"] == len(dual)
    assert report["per_prompt"][0]["new_tokens"] == len(dual)


def test_default_root_dir_moves_checkpoints_and_logs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    before = (REPO / "checkpoints" / "tiny-debug").exists()
    root = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["fit", "--recipe", "recipes/tiny-debug.yaml", "--trainer.default_root_dir", str(root),
                     "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                     "--trainer.enable_progress_bar", "false"]) == 0
    assert list(root.rglob("*.ckpt")) and list(root.rglob("events.out.tfevents.*"))
    assert (REPO / "checkpoints" / "tiny-debug").exists() == before
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]


def _fake_engine() -> types.ModuleType:
    """An engine module written in the test: the vLLM layout under another name and directory."""
    from draftkit.export import vllm

    engine = types.ModuleType("fake_engine")
    for name in ("ENGINE_VERSION", "LAYER_PREFIX", "build_files", "read_view", "from_engine_ids"):
        setattr(engine, name, getattr(vllm, name))
    engine.ENGINE, engine.EXPORT_DIR = "fake", "fake-engine"
    engine.launch_command = lambda source, out_dir, k: f"fake-serve {out_dir}"
    return engine


def test_registered_engine_is_offered_by_the_cli_and_the_callback(tmp_path, monkeypatch, capsys):
    from draftkit import export
    from draftkit.callbacks.export import ExportOnCheckpoint, engine_dir

    monkeypatch.setitem(export.ENGINES, "fake", None)  # undone after the test
    export.register_engine(_fake_engine())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "--help"])
    assert "fake" in capsys.readouterr().out
    target = save_tiny_target(tmp_path / "target")
    head, ids = make_head(target)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, target, ids)
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--to", "fake", "--dtype", "float32"]) == 0
    sidecar = json.loads((tmp_path / "out" / "draftkit_export.json").read_text())
    assert sidecar["engine"] == "fake" and sidecar["launch"].startswith("fake-serve")
    loaded, meta = export.load_exported_head(tmp_path / "out")
    assert meta["engine"] == "fake" and meta["aux_layer_ids"] == ids
    callback = ExportOnCheckpoint(engines=["vllm", "fake"])
    assert callback.engines == ["vllm", "fake"] and engine_dir("fake") == "fake-engine"
    with pytest.raises(ValueError, match="lacks"):
        export.register_engine(types.ModuleType("broken"))
    assert main(["export", str(ckpt), str(tmp_path / "o2"), "--to", "nope"]) == 2
    assert "unknown engine 'nope'; choose one of vllm, speculators, sglang, trtllm, llamacpp, fake" in capsys.readouterr().err
