"""Export with a speculation shape: hand-given trees (exact launch lines and trtllm_spec.yaml), a shape taken from
an evaluate report (sidecar round trip), the chain default unchanged, and bad input naming the option or file."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import yaml

from draftkit.commands import main as draftkit_main
from draftkit.export import Speculation, export_checkpoint, load_exported_head
from draftkit.export.common import SIDECAR
from draftkit.export.speculation import resolve_speculation

REPO = Path(__file__).resolve().parents[2]
NAME = "org/tiny-target"

# the sidecar keys of a chain export, in order: an export without --tree / --from_report writes exactly these
CHAIN_SIDECAR_KEYS = [
    "format", "format_version", "draftkit_version", "engine", "engine_version", "dtype", "layer_prefix",
    "source_checkpoint", "target", "trained_target", "target_architecture", "target_path", "target_name",
    "target_model_type", "target_dtype", "tokenizer_fingerprint", "chat_template", "target_num_layers", "aux_layer_ids", "aux_layer_ids_convention",
    "aux_layer_ids_default", "engine_aux_layer_ids", "vocab", "head_config", "ttt", "trained_length",
    "trained_prompts", "num_speculative_tokens", "launch",
]


def trtllm_yaml(out: Path, max_draft_len: int, tree: tuple[int, int] | None = None) -> str:
    """The whole trtllm_spec.yaml draftkit writes for the tiny head (default aux ids: no capture key)."""
    lines = [
        "# TensorRT-LLM LLM-API options written by draftkit export (eagle3-format.md §7.5).",
        "speculative_config:",
        '  decoding_type: Eagle3          # "Eagle" is an accepted alias in some releases',
        f"  max_draft_len: {max_draft_len}",
        f"  speculative_model_dir: {out}   # newer releases name this key speculative_model",
        "  eagle3_one_model: true",
    ]
    if tree:
        lines += [
            "  use_dynamic_tree: true         # EAGLE-2 dynamic tree (EagleDecodingConfig; unverified for 1.2.1)",
            f"  dynamic_tree_max_topK: {tree[0]}       # top-k expanded per drafter layer",
            f"  max_total_draft_tokens: {tree[1]}     # draft nodes verified per round, root excluded",
        ]
    return "\n".join(lines) + "\n"


def sidecar(out) -> dict:
    return json.loads((Path(out) / SIDECAR).read_text())


def export(args: list[str]) -> int:
    return draftkit_main(["export", *args])


def test_hand_given_tree_launch_lines_and_trtllm_yaml(tiny_checkpoint, tmp_path, capsys):
    ckpt, _ = tiny_checkpoint
    out = {e: tmp_path / e for e in ("sglang", "trtllm", "vllm", "speculators")}
    for engine, path in out.items():
        assert export([str(ckpt), str(path), "--to", engine, "--tree", "5,4,16", "--target_name", NAME]) == 0
    printed = capsys.readouterr().out
    assert f"for sglang (bfloat16, tree 5,4,16) into {out['sglang']}" in printed

    assert sidecar(out["sglang"])["launch"] == (
        f"python -m sglang.launch_server --model-path {NAME} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {out['sglang']} --speculative-num-steps 5 --speculative-eagle-topk 4 "
        "--speculative-num-draft-tokens 17"
    )
    assert sidecar(out["trtllm"])["launch"] == (
        f"trtllm-serve {NAME} --extra_llm_api_options {out['trtllm']}/trtllm_spec.yaml")
    text = (out["trtllm"] / "trtllm_spec.yaml").read_text()
    assert text == trtllm_yaml(out["trtllm"], 5, (4, 16))
    assert yaml.safe_load(text)["speculative_config"] == {
        "decoding_type": "Eagle3", "max_draft_len": 5, "speculative_model_dir": str(out["trtllm"]),
        "eagle3_one_model": True, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 16,
    }
    vllm = sidecar(out["vllm"])
    assert vllm["launch"] == (f"vllm serve {NAME} --speculative-config '{{\"method\": \"eagle3\", \"model\": "
                              f"\"{out['vllm']}\", \"num_speculative_tokens\": 5}}'")
    assert vllm["num_speculative_tokens"] == 5
    assert "vLLM drafts chains only: tree 5,4,16" in vllm["speculation"]["engine_settings"]["note"]
    spec_cfg = json.loads((out["speculators"] / "config.json").read_text())["speculators_config"]
    assert spec_cfg["proposal_methods"][0]["speculative_tokens"] == 5
    assert "chains only" in sidecar(out["speculators"])["speculation"]["engine_settings"]["note"]

    record = sidecar(out["sglang"])["speculation"]
    assert record == {
        "topology": "tree", "depth": 5, "topk": 4, "num_nodes": 16, "source": "--tree",
        "engine_settings": {"speculative_num_steps": 5, "speculative_eagle_topk": 4,
                            "speculative_num_draft_tokens": 17},
        "report": None, "note": None,
    }
    assert sidecar(out["trtllm"])["speculation"]["engine_settings"] == {
        "max_draft_len": 5, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 16}
    for path in out.values():  # the exports still reload
        load_exported_head(path)


def _auto_report(path: Path, choice: str, tree: dict | None, k: int) -> Path:
    """An evaluate report as ``decoding.harness`` writes it with ``--tree auto`` (keys the export reads)."""
    report = {
        "num_prompts": 80, "k": k, "temperature": 0.0, "tau": 1.61, "speedup": 1.12, "tree": tree,
        "auto": {"choice": choice, "predicted_speedup": 1.19, "measured_speedup": 1.12,
                 "calibration": {"prompts": 4, "tokens": 48}, "predictions": []},
        "setup": {"device": "cpu", "hardware": "x86_64 2 cpus, 1 torch threads", "target_dtype": "float32",
                  "dataset": "mt-bench",
                  "precision": {"requested": "float32", "dtype": "float32",
                                "auto": {"device": "cpu", "dtype": "bfloat16", "bf16_slowdown": 0.51,
                                         "reason": "cpu AVX512: bf16 matmul 0.51x the float32 time -> bfloat16"}}},
    }
    path.write_text(json.dumps(report))
    return path


def test_sidecar_round_trip_from_an_auto_report(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint
    report = _auto_report(tmp_path / "auto.json", "5,4,16", {"depth": 5, "topk": 4, "num_nodes": 16}, 5)
    out = tmp_path / "sglang"
    assert export([str(ckpt), str(out), "--to", "sglang", "--from_report", str(report), "--target_name", NAME]) == 0
    side = sidecar(out)
    assert side["launch"].endswith(
        "--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 17")
    record = side["speculation"]
    assert (record["topology"], record["depth"], record["topk"], record["num_nodes"]) == ("tree", 5, 4, 16)
    assert record["source"] == "--from_report" and "re-tune" in record["note"]
    assert record["report"] == {
        "path": report.name, "chosen_by": "cost model (evaluate --k auto / --tree auto)",
        "choice": "5,4,16", "predicted_speedup": 1.19, "measured_speedup": 1.12, "tau": 1.61, "device": "cpu",
        "hardware": "x86_64 2 cpus, 1 torch threads",
        "cpu_capability": "cpu AVX512: bf16 matmul 0.51x the float32 time -> bfloat16", "target_dtype": "float32",
        "dataset": "mt-bench", "checkpoint": None, "head_fingerprint": None, "num_prompts": 80, "temperature": 0.0,
    }
    # round trip: the recorded report gives the recorded shape again
    again = Speculation.from_report(report.parent / record["report"]["path"])  # its name: no machine path
    assert (again.tree.depth, again.tree.topk, again.tree.num_nodes) == (5, 4, 16) and again.report == record["report"]
    _, meta = load_exported_head(out)
    assert meta["engine"] == "sglang"


def test_auto_chain_and_measured_reports_give_chains(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint
    chain = _auto_report(tmp_path / "chain.json", "chain k=3", None, 3)
    out = export_checkpoint(ckpt, "trtllm", tmp_path / "t", target_name=NAME,
                            speculation=Speculation.from_report(chain))
    assert (out / "trtllm_spec.yaml").read_text() == trtllm_yaml(out, 3)
    record = sidecar(out)["speculation"]
    assert record["topology"] == "chain" and record["depth"] == 3 and record["report"]["choice"] == "chain k=3"
    assert record["engine_settings"] == {"max_draft_len": 3}
    # a measured (non-auto) report in the repository: the chain k = 5 it ran
    measured = REPO / "benchmarks" / "results" / "evaluate_default_head_chain_k5.json"
    k, shape = resolve_speculation(None, None, str(measured))
    assert k == 5 and shape.is_chain and shape.report["chosen_by"].startswith("measured configuration")
    assert shape.report["predicted_speedup"] is None
    assert shape.report["measured_speedup"] == pytest.approx(0.6278, abs=1e-4)
    tree = Speculation.from_report(REPO / "benchmarks" / "results" / "evaluate_default_head_tree_5_4_16.json")
    assert str(tree.tree) == "5,4,16" and tree.report["device"] == "cpu"


def test_chain_default_is_unchanged(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint
    for engine in ("sglang", "trtllm", "vllm"):
        out = export_checkpoint(ckpt, engine, tmp_path / engine, target_name=NAME)
        side = sidecar(out)
        assert list(side) == (CHAIN_SIDECAR_KEYS[:5] + ["engine_aux_rule"] + CHAIN_SIDECAR_KEYS[5:]
                              if engine == "sglang" else CHAIN_SIDECAR_KEYS)
        assert side["num_speculative_tokens"] == 3
    assert sidecar(tmp_path / "sglang")["launch"] == (
        f"python -m sglang.launch_server --model-path {NAME} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {tmp_path / 'sglang'} --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4"
    )
    assert (tmp_path / "trtllm" / "trtllm_spec.yaml").read_text() == trtllm_yaml(tmp_path / "trtllm", 3)
    # the chain given as a tree (top-k 1) launches the same; only the sidecar records the shape
    tree_chain = export_checkpoint(ckpt, "sglang", tmp_path / "sglang-tree", target_name=NAME,
                                   speculation=Speculation.parse("3,1,3"))
    chain_launch = sidecar(tmp_path / "sglang")["launch"]
    assert sidecar(tree_chain)["launch"] == chain_launch.replace(str(tmp_path / "sglang"), str(tree_chain))
    assert sidecar(tree_chain)["speculation"]["topology"] == "chain"


def test_bad_speculation_input_names_the_option_or_file(tiny_checkpoint, tmp_path, capsys):
    ckpt, _ = tiny_checkpoint
    base = [str(ckpt), str(tmp_path / "out"), "--to", "sglang"]

    def error(args):
        assert export([*base, *args]) == 2
        return capsys.readouterr().err

    assert "--tree takes depth,topk,N (e.g. 5,4,16), got '5x4'" in error(["--tree", "5x4"])
    assert "--tree takes depth,topk,N" in error(["--tree", "5,4"])
    assert "--tree: tree N=99 exceeds the 68 candidates" in error(["--tree", "5,4,99"])
    assert "--tree: a top-k 1 tree is a chain" in error(["--tree", "5,1,3"])
    assert "give one speculation shape, not --num_speculative_tokens and --tree together" in error(
        ["--tree", "5,4,16", "-k", "4"])
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"num_prompts": 3, "tau": 1.2}))
    err = error(["--from_report", str(empty)])
    assert f"--from_report {empty}: the report has no speculation shape" in err
    plain = _auto_report(tmp_path / "plain.json", "plain", None, 1)
    assert f"--from_report {plain}: the cost model chose plain decoding" in error(["--from_report", str(plain)])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert f"--from_report {broken}: not a JSON evaluate report" in error(["--from_report", str(broken)])
    assert "no such report file" in error(["--from_report", str(tmp_path / "missing.json")])
    edited = _auto_report(tmp_path / "edited.json", "5,4,16", {"depth": 5, "topk": 4, "num_nodes": 8}, 5)
    assert "disagrees with the report's shape '5,4,8'" in error(["--from_report", str(edited)])
    # TensorRT-LLM's dynamic tree takes D <= N <= K * D
    assert export([str(ckpt), str(tmp_path / "out"), "--to", "trtllm", "--tree", "2,4,10"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT-LLM's dynamic tree needs" in err and "2 <= N <= 8, got N = 10" in err
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json")) == ["head.ckpt"]


def test_engine_without_tree_support_exports_chains_only(tiny_checkpoint, tmp_path):
    from draftkit.export import ENGINES, vllm

    engine = types.ModuleType("chain_only_engine")
    for name in ("ENGINE_VERSION", "LAYER_PREFIX", "build_files", "read_view", "from_engine_ids"):
        setattr(engine, name, getattr(vllm, name))
    engine.ENGINE = "chain-only"
    engine.launch_command = lambda source, out_dir, k: f"serve {out_dir} -k {k}"
    ckpt, _ = tiny_checkpoint
    ENGINES["chain-only"] = engine
    try:
        out = export_checkpoint(ckpt, "chain-only", tmp_path / "c", speculation=Speculation.parse("4,1,4"))
        assert sidecar(out)["launch"] == f"serve {out} -k 4"
        with pytest.raises(ValueError, match="engine 'chain-only' takes no tree shape"):
            export_checkpoint(ckpt, "chain-only", tmp_path / "t", speculation=Speculation.parse("5,4,16"))
        with pytest.raises(ValueError, match="num_speculative_tokens 3 and the speculation shape 5,4,16"):
            export_checkpoint(ckpt, "vllm", tmp_path / "v", num_speculative_tokens=3,
                              speculation=Speculation.parse("5,4,16"))
    finally:
        del ENGINES["chain-only"]


# The default k and a frozen shape (issue 36).


def test_resolve_without_a_shape_defaults_to_3_or_the_given_k():
    assert resolve_speculation(None) == (3, None)
    assert resolve_speculation(num_speculative_tokens=5) == (5, None)


def test_speculation_is_frozen():
    shape = Speculation.parse("2,3,4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.tree = None


def test_a_report_of_another_head_is_refused(tiny_checkpoint, tiny_target_dir, tmp_path, capsys):
    """``--from_report`` took the shape (and recorded the τ and speedup) of whatever head the report measured: a
    report of another checkpoint exported silently. evaluate now records the head's fingerprint, the same for the
    checkpoint, its bf16 and float32 exports and the head evaluate loads; export compares it."""
    from export_helpers import make_head, write_checkpoint

    from draftkit.export.head_target import load_head_and_target
    from draftkit.heads.checkpoint import head_fingerprint, read_checkpoint

    ckpt, _ = tiny_checkpoint
    mine = head_fingerprint(read_checkpoint(ckpt).state)
    for dtype in ("bfloat16", "float32"):
        out = export_checkpoint(ckpt, "vllm", tmp_path / dtype, dtype=dtype, target_name=NAME)
        assert load_head_and_target(out).meta["head_fingerprint"] == mine
    assert load_head_and_target(ckpt).meta["head_fingerprint"] == mine
    other = write_checkpoint(tmp_path / "other.ckpt", make_head(tiny_target_dir, seed=2)[0], tiny_target_dir,
                             [2, 4, 5])
    theirs = head_fingerprint(read_checkpoint(other).state)
    assert len(theirs) == 16 and theirs != mine

    report = json.loads(_auto_report(tmp_path / "r.json", "chain k=3", None, 3).read_text())
    report["setup"].update(checkpoint="other.ckpt", head_fingerprint=theirs)
    (tmp_path / "r.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert export([str(ckpt), str(tmp_path / "x"), "--to", "vllm", "--from_report", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == (
        f"draftkit export: error: --from_report {tmp_path / 'r.json'} measured another head (other.ckpt, weights "
        f"{theirs}) than the one exported ({ckpt}, weights {mine}); its shape, τ and speedup are that head's: run "
        f"`draftkit evaluate --checkpoint {ckpt} --k auto --output REPORT.json` and export with --from_report "
        "REPORT.json, or give the shape with --tree / --num_speculative_tokens\n")
    assert not (tmp_path / "x").exists()
    # the report of this head (here through its bf16 export) passes and is recorded
    report["setup"].update(checkpoint=str(tmp_path / "bfloat16"), head_fingerprint=mine)
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert export([str(ckpt), str(tmp_path / "y"), "--to", "vllm", "--from_report", str(tmp_path / "r.json"),
                   "--target_name", NAME]) == 0
    assert sidecar(tmp_path / "y")["speculation"]["report"]["head_fingerprint"] == mine
