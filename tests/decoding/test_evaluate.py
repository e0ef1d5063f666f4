"""``draftkit evaluate`` on the tiny target: report keys and values, prompt files, bad input."""

import dataclasses
import json

import pytest
import torch
from decoding_stubs import make_head

from draftkit.commands import main as draftkit_main
from draftkit.decoding.harness import _first_diff, evaluate_head
from draftkit.heads.checkpoint import check_head_matches_target
from draftkit.decoding.tree import TreeConfig
from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.target.frozen import FrozenTarget, load_target


def main(args):
    return draftkit_main(["evaluate", *args])


ISSUE_KEYS = {
    "num_prompts", "k", "temperature", "tau", "acceptance_per_position", "acceptance_rate", "kl_per_position",
    "bytes_per_token", "target_forwards_per_token", "tokens_per_s", "baseline_tokens_per_s", "speedup",
    "greedy_equal", "prompt_lookup_tau", "per_prompt",
}


def write_ckpt(path, head, target_ref):
    meta = {
        "head_config": dataclasses.asdict(head.config), "target": str(target_ref), "target_dtype": "float32",
        "aux_layer_ids": list(head.config.aux_layer_ids), "chat_template": None, "ttt": {"steps": 7, "decay": 0.8},
    }
    state = {f"head.{k}": v for k, v in head.export_state_dict().items()}
    torch.save({"state_dict": state, "draftkit": meta}, path)
    return path


@pytest.fixture()
def ckpt(tmp_path, tiny, tiny_target_dir):
    return write_ckpt(tmp_path / "head.ckpt", make_head(tiny[0]), tiny_target_dir)


def test_main_writes_report(tmp_path, ckpt, prompts_file, capsys):
    out = tmp_path / "sub" / "report.json"
    tb = tmp_path / "tb"
    rc = main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out),
               "--max_new_tokens", "12", "--k", "4", "--tensorboard", str(tb), "--dtype", "float32"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["setup"]["precision"]["requested"] == "float32" and report["setup"]["target_dtype"] == "float32"
    assert set(report["setup"]["precision"]["auto"]) == {"device", "dtype", "reason", "bf16_slowdown"}
    assert ISSUE_KEYS <= set(report)
    assert report["num_prompts"] == 3 and report["k"] == 4 and report["temperature"] == 0.0
    assert report["greedy_equal"] == 3  # float32 greedy: lossless
    assert [r["id"] for r in report["per_prompt"]] == ["7", "2", "3"]
    assert all(r["equal"] and r["first_diff"] is None for r in report["per_prompt"])
    assert len(report["acceptance_per_position"]) == 4 and len(report["kl_per_position"]) == 4
    assert report["kl_definition"].startswith("KL(P_d || Q) in nats at temperature 1 over the draft vocab only")
    outside, expected = report["outside_mass_per_position"], report["expected_accept_per_position"]
    assert len(outside) == len(expected) == 4 and all(0 < x < 1 for x in outside + expected)
    assert all(e <= 1 - o + 1e-6 for e, o in zip(expected, outside))  # sum min(p, q) <= mass p puts on the draft vocab
    assert report["tau"] == pytest.approx(1 + sum(report["acceptance_per_position"]))  # chain identity
    assert report["target_forwards_per_token"] == pytest.approx(
        report["rounds"] / sum(r["new_tokens"] - 1 for r in report["per_prompt"]))
    assert report["bytes_per_token"]["plain"] > 0 and report["bytes_per_token"]["speculative"] > 0
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["baseline_tokens_per_s"])
    assert report["prompt_lookup_tau"] >= 1
    assert list(tb.glob("events.out.tfevents.*"))
    printed = capsys.readouterr().out
    assert "(target mass outside the draft vocab)" in printed and "E[acc]_i" in printed
    assert "tau (bonus counted)" in printed and "greedy_equal               3/3" in printed


def test_evaluate_head_token_ids_and_bytes(tiny, tiny_head):
    target, _ = tiny
    report = evaluate_head(
        tiny_head, target, None, [[256, 1, 2, 3], [256, 9, 9, 9, 9]], k=3, max_new_tokens=7,
        eos_token_ids=[257], baseline=False, prompt_lookup=False, warmup=False,
    )
    assert report["speedup"] is None and report["greedy_equal"] is None and report["prompt_lookup_tau"] is None
    assert report["num_prompts"] == 2
    # weights read per round: target (untied embedding excluded) + fc once + 3 x (layer, norm, lm_head)
    cfg = tiny_head.config
    layer = sum(p.numel() for p in tiny_head.midlayer.parameters()) + cfg.hidden_size
    draft_round = 4 * (cfg.num_aux_layers * cfg.target_hidden_size * cfg.hidden_size
                       + 3 * (layer + cfg.draft_vocab_size * cfg.hidden_size))
    target_bytes = 4 * (sum(p.numel() for p in target.model.parameters()) - 320 * 64)
    assert report["bytes_per_token"]["plain"] == target_bytes
    decode_tokens = sum(r["new_tokens"] - 1 for r in report["per_prompt"])
    assert report["bytes_per_token"]["speculative"] == pytest.approx(
        report["rounds"] * (target_bytes + draft_round) / decode_tokens)
    assert tiny_head.training is False


class LossyVerifyTarget(FrozenTarget):
    """A deliberately lossy target: in multi-row (verify) forwards, the row that predicts absolute position
    ``at`` puts all its mass on ``wrong``; single-token (plain decoding) forwards are exact."""

    def __init__(self, model, at: int, wrong: int) -> None:
        super().__init__(model)
        self.at, self.wrong = at, wrong

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                compute_logits=True):
        start = 0 if cache is None else cache.get_seq_length()
        out = super().forward(input_ids, attention_mask, position_ids, cache, use_cache, compute_logits)
        row = self.at - 1 - start
        if compute_logits and input_ids.shape[1] > 1 and 0 <= row < input_ids.shape[1]:
            out.logits[0, row, self.wrong] = 1e4
        return out


def test_greedy_equal_flags_a_lossy_decoder(tiny_target_dir, tiny_head):
    """Speculative output that differs from plain greedy at new token 3 of prompt 0 is reported as not
    equal, at position 3 with the plain top-2 gap there; prompt 1 never reaches the lossy position."""
    long, short = [256, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 8], [256, 1, 2, 3]
    model, _ = load_target(str(tiny_target_dir), "float32")
    plain = evaluate_head(tiny_head, FrozenTarget(model), None, [long], k=3, max_new_tokens=8, eos_token_ids=[],
                          prompt_lookup=False, warmup=False, collect_kl=False)
    assert plain["greedy_equal"] == 1
    lossy = LossyVerifyTarget(model, at=len(long) + 3, wrong=300)
    report = evaluate_head(tiny_head, lossy, None, [long, short], k=3, max_new_tokens=8, eos_token_ids=[],
                           prompt_lookup=False, warmup=False, collect_kl=False)
    assert report["greedy_equal"] == 1
    first, second = report["per_prompt"]
    assert (first["equal"], first["first_diff"]) == (False, 3)
    assert first["top2_gap"] > 0 and second["top2_gap"] is None
    assert (second["equal"], second["first_diff"]) == (True, None)


def test_first_diff_counts_a_length_difference():
    assert _first_diff([1, 2, 3], [1, 2, 3]) is None
    assert _first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert _first_diff([1, 2, 3], [1, 2]) == 2 and _first_diff([1], [1, 2, 3]) == 1
    assert _first_diff([], [4]) == 0


def test_sampled_report(tiny, tiny_head):
    report = evaluate_head(tiny_head, tiny[0], tiny[1], ["hello"], k=2, temperature=0.7, top_p=0.9,
                           max_new_tokens=6, warmup=False)
    assert report["greedy_equal"] is None and report["temperature"] == 0.7
    assert 1 <= report["tau"] <= 3


def test_bad_input_errors(tiny, tiny_head):
    target, tokenizer = tiny
    with pytest.raises(ValueError, match="prompt list is empty"):
        evaluate_head(tiny_head, target, tokenizer, [])
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        evaluate_head(tiny_head, target, tokenizer, ["hi"], k=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        evaluate_head(tiny_head, target, tokenizer, ["hi"], temperature=-0.5)
    with pytest.raises(ValueError, match=r"prompt 0: 600 tokens .* context window of 512"):
        evaluate_head(tiny_head, target, tokenizer, [[5] * 600], max_new_tokens=4)


def test_context_window_check_uses_the_depth_that_runs(tiny, tiny_head):
    target, tokenizer = tiny
    window = target.model.config.max_position_embeddings
    prompt = [5] * (window - 4 - 7)  # prompt + max_new_tokens 4 + k 7 fills the window exactly
    # --k/--tree auto may pick depth 8 (cost.candidate_topologies), not the k = 5 passed in: refused up front,
    # before the calibration runs, naming the prompt
    for auto in ("k", "tree"):
        with pytest.raises(ValueError, match=rf"prompt 0: {len(prompt)} tokens \+ max_new_tokens 4 \+ the deepest "
                                             rf"--{auto} auto depth 8 = {window + 1} does not fit .* of {window}"):
            evaluate_head(tiny_head, target, tokenizer, [prompt], k=5, max_new_tokens=4, auto=auto, warmup=False)
    with pytest.raises(ValueError, match=rf"prompt 0: .* \+ tree depth 8 = {window + 1} does not fit"):
        evaluate_head(tiny_head, target, tokenizer, [prompt], k=5, max_new_tokens=4, tree=TreeConfig(8, 2, 8))
    with pytest.raises(ValueError, match=rf"prompt 0: .* \+ tree depth 8 = {window + 1} does not fit"):  # a hybrid's
        evaluate_head(tiny_head, target, tokenizer, [prompt], k=5, max_new_tokens=4,  # lookup branch counts
                      tree=TreeConfig(3, 2, 4, 8))
    with pytest.raises(ValueError, match=r"prompt 0: 500 tokens \+ calibration_tokens 48 = 548 does not fit"):
        evaluate_head(tiny_head, target, tokenizer, [[5] * 500], max_new_tokens=4, auto="k", warmup=False)
    report = evaluate_head(tiny_head, target, tokenizer, [prompt], k=5, max_new_tokens=4, baseline=False,
                           prompt_lookup=False, warmup=False)  # the chain k = 5 itself fits
    assert report["k"] == 5 and report["new_tokens"] == 4


def test_head_target_mismatch_names_both(tiny, tiny_head):
    target, _ = tiny
    fields = dataclasses.asdict(tiny_head.config)
    wrong_vocab = Eagle3LlamaHead(Eagle3Config(**{**fields, "vocab_size": 300, "draft_vocab_size": 256}))
    with pytest.raises(ValueError, match=r"head V=300, target V=320"):
        check_head_matches_target(wrong_vocab, target)
    wrong_hidden = Eagle3LlamaHead(Eagle3Config(**{**fields, "target_hidden_size": 32}))
    with pytest.raises(ValueError, match=r"head was trained on H_t=32, target has H_t=64"):
        evaluate_head(wrong_hidden, target, None, [[1, 2]])


def test_main_bad_input_exit_code(tmp_path, ckpt, prompts_file, tiny, capsys):
    out = tmp_path / "r.json"
    base = ["--prompts", str(prompts_file), "--output", str(out)]
    assert main(["--checkpoint", str(tmp_path / "nope.ckpt"), *base]) == 2
    assert "nope.ckpt does not exist" in capsys.readouterr().err
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    assert main(["--checkpoint", str(garbage), *base]) == 2
    assert "could not be read" in capsys.readouterr().err
    assert main(["--checkpoint", str(ckpt), *base, "--k", "0"]) == 2
    assert "--k must be >= 1" in capsys.readouterr().err
    # two topologies: one of them was silently not run
    assert main(["--checkpoint", str(ckpt), *base, "--k", "3", "--tree", "2,2,4"]) == 2
    assert '--k 3 and --tree 2,2,4 are two topologies: give one (the other is not run); measure both in one run ' \
           'with --sweep "k=3 tree=2,2,4"' in capsys.readouterr().err
    assert main(["--checkpoint", str(ckpt), *base, "--k", "auto", "--tree", "auto"]) == 2
    assert "give one (--tree auto rates chains too)" in capsys.readouterr().err
    assert main(["--checkpoint", str(ckpt), *base, "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    other = make_head(tiny[0])
    other_ckpt = write_ckpt(tmp_path / "other.ckpt", other, tmp_path / "missing-target")
    assert main(["--checkpoint", str(other_ckpt), *base]) == 2
    assert "missing-target" in capsys.readouterr().err
    assert not out.exists()  # nothing partial written


def test_exported_head_directory(tmp_path, ckpt, prompts_file):
    import draftkit.export as export
    directory = export.export_checkpoint(ckpt, "vllm", tmp_path / "export", dtype="float32")
    out = tmp_path / "report.json"
    rc = main(["--checkpoint", str(directory), "--prompts", str(prompts_file), "--output", str(out),
               "--max_new_tokens", "6", "--num_prompts", "1", "--prompt_lookup", "false", "--dtype", "float32"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["greedy_equal"] == 1 and report["prompt_lookup_tau"] is None


def test_main_tree_report(tmp_path, ckpt, prompts_file, capsys):
    out = tmp_path / "tree.json"
    rc = main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out),
               "--max_new_tokens", "12", "--tree", "3,2,6", "--prompt_lookup", "false"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert ISSUE_KEYS - {"prompt_lookup_tau"} <= set(report)
    assert report["tree"] == {"depth": 3, "topk": 2, "num_nodes": 6} and report["k"] == 3
    assert report["setup"]["topology"] == "tree depth=3 topk=2 N=6"
    assert report["greedy_equal"] == 3
    assert report["verified_tokens_per_round"] == 7.0
    hist = report["accepted_length_histogram"]
    assert len(hist) == 4 and sum(hist) == report["rounds"]
    assert report["tau"] == pytest.approx(sum((a + 1) * c for a, c in enumerate(hist)) / report["rounds"])
    assert report["kl_per_position"] is None and report["auto"] is None
    assert main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out),
                 "--tree", "3,2,99"]) == 2
    assert "--tree: tree N=99 exceeds the 10 candidates" in capsys.readouterr().err


def test_main_tree_auto(tmp_path, ckpt, prompts_file):
    out = tmp_path / "auto.json"
    tb = tmp_path / "tb"
    rc = main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out),
               "--max_new_tokens", "8", "--tree", "auto", "--calibration_prompts", "1", "--calibration_tokens", "8",
               "--prompt_lookup", "false", "--tensorboard", str(tb)])
    assert rc == 0
    report = json.loads(out.read_text())
    auto = report["auto"]
    preds = auto["predictions"]
    assert len(preds) > 6 and any(not p["chain"] for p in preds)
    assert preds == sorted(preds, key=lambda p: -p["tokens_per_s"])
    best = preds[0]
    if best["speedup"] > 1:
        assert auto["predicted_speedup"] == best["speedup"]
        assert auto["measured_speedup"] == pytest.approx(report["speedup"])
    else:  # a random head on one thread: plain decoding usually wins
        assert auto["choice"] == "plain" and auto["measured_speedup"] == 1.0
    assert report["greedy_equal"] == 3
    assert auto["costs_ms"]["verify"]["1"] > 0
    assert auto["costs_ms"]["draft_step_measured"].keys() == auto["costs_ms"]["draft_step"].keys()
    verify = {int(n): ms for n, ms in auto["costs_ms"]["verify"].items()}
    for n, m in auto["verify_padding"].items():  # padded only to a measured, cheaper row count
        assert int(n) < m and verify[m] < min((v for r, v in verify.items() if int(n) <= r < m), default=1e9)
    assert list(tb.glob("events.out.tfevents.*"))


def test_main_tree_auto_at_a_temperature_picks_on_sampled_rounds(tmp_path, ckpt, prompts_file):
    """--tree auto at T > 0: greedy tau overrates fixed drafts (a tree's, prompt lookup's), so the best three shapes
    by the greedy prediction and the best chain are decoded at the temperature and the pick is made among them on
    those rounds (recorded with the temperature)."""
    out = tmp_path / "auto.json"
    assert main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out),
                 "--max_new_tokens", "8", "--tree", "auto", "--calibration_prompts", "2",
                 "--calibration_tokens", "16", "--temperature", "0.8"]) == 0
    auto = json.loads(out.read_text())["auto"]
    sampled = auto["calibration"]["sampled"]
    assert auto["calibration"]["temperature"] == 0.8 and auto["calibration"]["prompts"] == 2
    assert 2 <= len(sampled) <= 4 and any(name.startswith("chain k=") and "+" not in name for name in sampled)
    assert len(auto["predictions"]) == len(sampled)
    assert auto["choice"] == "plain" or auto["choice"] in sampled


def test_a_chain_spelled_as_a_tree_is_named_as_a_tree(tmp_path, ckpt, prompts_file):
    """--sweep "k=3 tree=3,1,3": two runs (the chain's and the tree's verification), two names in the report."""
    out = tmp_path / "sweep.json"
    assert main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out), "--num_prompts", "1",
                 "--max_new_tokens", "4", "--prompt_lookup", "false", "--k", "3", "--sweep", "k=3 tree=3,1,3"]) == 0
    names = [r["topology"] for r in json.loads(out.read_text())["sweep"]]
    assert names == ["chain k=3", "tree depth=3 topk=1 N=3"]


@pytest.mark.parametrize("policy", ["float32", "bfloat16"])
def test_main_default_dtype_is_the_policy(tmp_path, ckpt, prompts_file, fake_precision, policy):
    choice = fake_precision(policy, 0.5 if policy == "bfloat16" else None)
    out = tmp_path / "report.json"
    assert main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out),
                 "--max_new_tokens", "4", "--num_prompts", "1", "--prompt_lookup", "false", "--baseline", "false"]) == 0
    setup = json.loads(out.read_text())["setup"]
    assert setup["target_dtype"] == policy and setup["draft_dtype"] == policy
    assert setup["precision"] == {"requested": "auto", "dtype": policy, "auto": choice.as_dict()}


def test_main_sweep_measures_every_topology_as_its_own_run(tmp_path, ckpt, prompts_file, capsys):
    """--sweep: one plain run per prompt, then every topology; each entry equals that topology evaluated alone
    (greedy float32 is deterministic), the given one first, and the table and TensorBoard plot are written."""
    out, tb = tmp_path / "sweep.json", tmp_path / "tb"
    common = ["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--max_new_tokens", "12",
              "--dtype", "float32", "--prompt_lookup", "false"]
    assert main(common + ["--output", str(out), "--k", "2", "--sweep", "k=1 k=2 tree=3,2,5 k=1", "--tensorboard", str(tb)]) == 0
    report = json.loads(out.read_text())
    sweep = report["sweep"]
    assert [r["topology"] for r in sweep] == ["chain k=2", "chain k=1", "tree depth=3 topk=2 N=5"]
    assert {key: report[key] for key in ("tau", "speedup", "greedy_equal", "k")} == {
        key: sweep[0][key] for key in ("tau", "speedup", "greedy_equal", "k")}
    assert report["per_prompt"] == sweep[0]["per_prompt"]
    for entry, alone_args in zip(sweep[1:], (["--k", "1"], ["--tree", "3,2,5"])):
        alone = tmp_path / "alone.json"
        assert main(common + ["--output", str(alone)] + alone_args) == 0
        single = json.loads(alone.read_text())
        assert single["sweep"] is None and entry["greedy_equal"] == single["greedy_equal"] == 3
        for key in ("tau", "acceptance_per_position", "accepted_length_histogram", "verified_tokens_per_round",
                    "rounds", "tree", "k"):
            assert entry[key] == single[key], key
        assert entry["speedup"] == pytest.approx(entry["tokens_per_s"] / report["baseline_tokens_per_s"])
        assert [r["id"] for r in entry["per_prompt"]] == ["7", "2", "3"]
    printed = capsys.readouterr().out
    assert "sweep (same prompts, interleaved)" in printed and "tree depth=3 topk=2 N=5" in printed
    assert list(tb.glob("events.out.tfevents.*"))


@pytest.mark.parametrize("entry", ["k=0", "chain=3", "tree=3,2", "k3", "k=²"])
def test_main_sweep_bad_entry_names_it(tmp_path, ckpt, prompts_file, capsys, entry):
    rc = main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(tmp_path / "r.json"),
               "--sweep", f"k=1 {entry}"])
    assert rc != 0 and entry in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_main_sweep_with_no_round_writes_its_tensorboard(tmp_path, ckpt, prompts_file):
    """One new token per prompt: no speculative round, tau None in every entry; the plot and scalars still work."""
    out = tmp_path / "r.json"
    assert main(["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out), "--max_new_tokens",
                 "1", "--dtype", "float32", "--sweep", "k=1 k=2", "--tensorboard", str(tmp_path / "tb")]) == 0
    assert [r["tau"] for r in json.loads(out.read_text())["sweep"]] == [None, None, None]


def test_main_times_in_the_policy_dtype_and_checks_losslessness_in_float32(
        tmp_path, ckpt, prompts_file, fake_precision, monkeypatch, capsys):
    """Speed in the policy's dtype (bf16 here), greedy_equal from a float32 pass over every topology that ran;
    at float32 the timed run is the check; --lossless_check false skips it."""
    import draftkit.target.frozen as frozen_mod

    fake_precision("bfloat16", 0.5)
    loads = []
    real = frozen_mod.load_target
    monkeypatch.setattr(frozen_mod, "load_target", lambda ref, dtype, *a, **kw: loads.append(dtype) or real(ref, dtype, *a, **kw))
    out = tmp_path / "report.json"
    common = ["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--max_new_tokens", "8", "--prompt_lookup", "false"]
    assert main([*common, "--output", str(out), "--k", "3", "--sweep", "k=1 tree=2,2,3"]) == 0
    report = json.loads(out.read_text())
    assert report["setup"]["target_dtype"] == "bfloat16" and loads == ["bfloat16", "float32"]
    ll = report["lossless"]
    assert (ll["dtype"], ll["source"], ll["greedy_equal"]) == ("float32", "float32 pass", 3)
    assert [t["topology"] for t in ll["per_topology"]] == ["chain k=3", "chain k=1", "tree depth=2 topk=2 N=3"]
    assert all(t["greedy_equal"] == 3 for t in ll["per_topology"])
    assert "lossless (float32, float32 pass): greedy_equal 3/3 (speed above in bfloat16)" in capsys.readouterr().out

    loads.clear()
    assert main([*common, "--output", str(out), "--dtype", "float32"]) == 0
    report = json.loads(out.read_text())
    assert loads == ["float32"] and report["lossless"]["source"] == "timed run"
    assert report["lossless"]["greedy_equal"] == report["greedy_equal"] == 3
    assert main([*common, "--output", str(out), "--lossless_check", "false", "--kernels", "stock"]) == 0
    report = json.loads(out.read_text())
    assert "lossless" not in report
    assert report["setup"]["kernels"] == {"kernel": "stock", "reason": "kernels=stock on cpu -> stock",
                                          "packed_ratio": None, "packed_linears": 0, "fused_groups": 0, "packed_bytes": 0,
                                          "weight_bytes": 0, "attention": None}
    assert report["setup"]["head_kernels"]["kernel"] == "stock"
    assert main([*common, "--output", str(out), "--kernels", "fast"]) == 2
    assert "kernels must be one of auto, onednn, stock, compiled, got 'fast'" in capsys.readouterr().err


def test_each_head_load_is_checked_against_its_target_once(tmp_path, ckpt, prompts_file, fake_precision, monkeypatch):
    """The head-vs-target check runs once per load: once for a float32 run (one load), twice for a bfloat16 run
    whose lossless pass loads the head and the target again in float32 (the harness does not check again)."""
    import draftkit.decoding.harness as harness
    import draftkit.heads.checkpoint as checkpoint

    calls = []
    real = checkpoint.check_head_matches_target
    counted = lambda *a, **kw: calls.append(a[1]) or real(*a, **kw)  # noqa: E731
    for module in (harness, checkpoint):  # the harness imports it by name; the loader reads it from heads.checkpoint
        monkeypatch.setattr(module, "check_head_matches_target", counted)
    common = ["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--max_new_tokens", "4", "--num_prompts",
              "1", "--k", "2", "--prompt_lookup", "false", "--output", str(tmp_path / "report.json")]
    assert main([*common, "--dtype", "float32"]) == 0 and len(calls) == 1
    calls.clear()
    fake_precision("bfloat16", 0.5)
    assert main(common) == 0 and len(calls) == 2
    assert [next(t.parameters()).dtype for t in calls] == [torch.bfloat16, torch.float32]


def test_main_packs_the_target_and_the_head_with_the_same_results(tmp_path, ckpt, prompts_file, monkeypatch):
    """--kernels onednn (the size floor lifted for the tiny models) packs every linear of the target and of the
    draft head, reports both, and decodes as stock kernels do in float32: the same tau, acceptance per position
    and greedy_equal."""
    from draftkit.export.head_target import load_head_and_target
    from draftkit.kernels import linears as kernels

    monkeypatch.setattr(kernels, "PACK_MIN_ELEMENTS", 0)
    head, frozen, *_ = load_head_and_target(ckpt, None, "float32", "cpu")
    linears = {name: sum(type(m) is torch.nn.Linear for m in mod.modules())
               for name, mod in (("target", frozen.model), ("head", head))}
    common = ["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--max_new_tokens", "8", "--prompt_lookup",
              "false", "--dtype", "float32", "--k", "3"]
    reports = {}
    for kernel in ("stock", "onednn"):
        out = tmp_path / f"{kernel}.json"
        assert main([*common, "--output", str(out), "--kernels", kernel]) == 0
        reports[kernel] = json.loads(out.read_text())
    setup = reports["onednn"]["setup"]
    assert setup["kernels"]["packed_linears"] == linears["target"] > 0
    assert setup["head_kernels"]["packed_linears"] == linears["head"] > 0
    assert setup["head_kernels"]["packed_bytes"] > 0
    for key in ("tau", "acceptance_per_position", "greedy_equal"):
        assert reports["onednn"][key] == reports["stock"][key]
    assert reports["onednn"]["greedy_equal"] == 3


def test_main_device_option(tmp_path, ckpt, prompts_file, capsys, monkeypatch):
    """--device auto runs on the CPU here (setup.device), and a CUDA device on a machine without one is a
    clear error (exit 2) before anything is loaded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    common = ["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--max_new_tokens", "4", "--num_prompts", "1",
              "--prompt_lookup", "false", "--output", str(out), "--dtype", "float32"]
    assert main([*common, "--device", "auto"]) == 0
    assert json.loads(out.read_text())["setup"]["device"] == "cpu"
    out.unlink()
    assert main([*common, "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err and not out.exists()


def test_main_device_map_places_the_target_as_it_loads(tmp_path, ckpt, prompts_file, capsys):
    """``--device_map`` (a target larger than one GPU) loads the target through accelerate's placement; here, with
    no GPU, every layer lands on the CPU and the report equals the one-device run's token for token, and records the
    placement. A strategy accelerate lacks, or compiled kernels (one device), are refused before anything loads."""
    common = ["--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--max_new_tokens", "6", "--k", "3",
              "--prompt_lookup", "false", "--dtype", "float32", "--device", "cpu"]
    one, placed = tmp_path / "one.json", tmp_path / "placed.json"
    assert main([*common, "--output", str(one)]) == 0
    assert main([*common, "--output", str(placed), "--device_map", "auto"]) == 0
    a, b = json.loads(one.read_text()), json.loads(placed.read_text())
    assert b["setup"]["device_map"] == {"strategy": "auto", "decoder_layers_per_device": {"cpu": 8}}
    assert a["setup"]["device_map"] is None
    assert [r["new_tokens"] for r in a["per_prompt"]] == [r["new_tokens"] for r in b["per_prompt"]]
    assert (a["tau"], a["acceptance_per_position"], a["greedy_equal"]) == (
        b["tau"], b["acceptance_per_position"], b["greedy_equal"])
    capsys.readouterr()
    assert main([*common, "--output", str(tmp_path / "x.json"), "--device_map", "everywhere"]) == 2
    assert ("--device_map must be one of auto, balanced, balanced_low_0, sequential, got 'everywhere'"
            in capsys.readouterr().err)
    assert main([*common, "--output", str(tmp_path / "x.json"), "--device_map", "auto", "--kernels", "compiled"]) == 2
    assert "--kernels compiled compiles a target on one device" in capsys.readouterr().err


def test_load_head_and_target_pairs_them(ckpt, tiny_target_dir):
    from draftkit.export.head_target import load_head_and_target

    head, target, tokenizer, meta, ref = load_head_and_target(ckpt, None, "float32", "cpu", "bfloat16")
    assert ref == str(tiny_target_dir) == meta["target"] and tokenizer is not None
    assert target.aux_layer_ids == list(head.config.aux_layer_ids) == meta["aux_layer_ids"]
    assert next(head.parameters()).dtype == torch.bfloat16 and not head.training
    assert torch.equal(head.embed_tokens.weight, target.input_embeddings().to(torch.bfloat16))
    assert next(target.model.parameters()).dtype == torch.float32
    fresh, t2, _, meta2, _ = load_head_and_target(None, str(tiny_target_dir), draft_vocab_size=32)
    assert meta2 == {} and fresh.config.draft_vocab_size == 32 and list(fresh.config.aux_layer_ids) == t2.aux_layer_ids
    with pytest.raises(ValueError, match="no target given"):
        load_head_and_target(None, None)


def test_prompts_longer_than_the_trained_length_are_named(tmp_path, tiny, tiny_target_dir, prompts_file, caplog):
    """A head trained on 20-token sequences: each prompt whose tokens + max_new_tokens exceed 20 is warned about
    (index, id, both lengths) and listed; the length survives export and re-export (the sidecar); a head without
    it is evaluated with a note and no list."""
    import logging

    from draftkit.export import export_checkpoint
    from draftkit.target.tokens import encode_chat

    head = make_head(tiny[0])
    ckpt = write_ckpt(tmp_path / "head.ckpt", head, tiny_target_dir)
    blob = torch.load(ckpt, weights_only=False)
    blob["draftkit"]["trained_length"] = 20
    torch.save(blob, ckpt)
    messages = [[{"role": "user", "content": "Tell me a story."}], [{"role": "user", "content": "abc abc abc abc"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]]  # prompts_file's 3
    lengths = [len(encode_chat(tiny[1], m)) for m in messages]
    common = ["--prompts", str(prompts_file), "--max_new_tokens", "6", "--prompt_lookup", "false", "--dtype", "float32"]
    first = export_checkpoint(ckpt, "vllm", tmp_path / "export", dtype="float32")
    again = export_checkpoint(first, "speculators", tmp_path / "reexport", dtype="float32")
    for source in (ckpt, first, again):
        out = tmp_path / "report.json"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="draftkit.decoding.harness"):
            assert main(["--checkpoint", str(source), "--output", str(out), *common]) == 0
        setup = json.loads(out.read_text())["setup"]
        over = [(i, pid, n) for i, (pid, n) in enumerate(zip(["7", "2", "3"], lengths)) if n + 6 > 20]
        assert setup["trained_length"] == 20 and setup["prompts_over_trained_length"] == [pid for _, pid, _ in over]
        assert len(over) == 3 and caplog.text.count("exceed the head's trained length") == 3
        for i, pid, n in over:
            assert f"prompt {i} ({pid}): {n} tokens + max_new_tokens 6 = {n + 6} exceed the head's trained length " \
                   "of 20 tokens" in caplog.text
    assert json.loads((again / "draftkit_export.json").read_text())["trained_length"] == 20

    old = write_ckpt(tmp_path / "old.ckpt", head, tiny_target_dir)
    assert main(["--checkpoint", str(old), "--output", str(tmp_path / "old.json"), *common]) == 0
    setup = json.loads((tmp_path / "old.json").read_text())["setup"]
    assert setup["trained_length"] is None and setup["prompts_over_trained_length"] == []


def test_tally_report_values_on_hand_built_runs():
    """One topology's report keys from two hand-built prompts (issue 56): near ties below NEAR_TIE only (a gap
    exactly at it is not one), greedy_equal, the histogram up to a = k, the verified rows counting the root,
    bytes and forwards per decoded token, and speedup = tokens/s over the baseline's."""
    from types import SimpleNamespace

    from draftkit.decoding.harness import NEAR_TIE, Topology, _Tally
    from draftkit.decoding.metrics import AcceptanceStats

    def spec(rounds, tokens, seconds):
        stats = AcceptanceStats(2)
        for a, d in rounds:
            stats.update(a, d)
        return SimpleNamespace(stats=stats, tokens=tokens, seconds=seconds, decode_tokens=len(tokens) - 1,
                               weight_bytes=100 * len(rounds), target_forwards=len(rounds), draft_seconds=0.5,
                               verify_seconds=1.0)

    tally = _Tally(Topology(2))
    # prompt 1 differs at 1, where plain's top-2 gap is a near tie; prompt 2 differs at 0, gap exactly NEAR_TIE
    tally.add(spec([(2, 2), (0, 2)], [5, 6, 7, 8], 2.0), SimpleNamespace(tokens=[5, 9, 7, 8],
              top2_gaps=[1.0, NEAR_TIE / 2, 1.0, 1.0]), {"id": "a"}, greedy=True)
    tally.add(spec([(1, 1), (2, 2)], [1, 2, 3, 4, 5], 2.0), SimpleNamespace(tokens=[0, 2, 3, 4, 5],
              top2_gaps=[NEAR_TIE, 1.0, 1.0, 1.0, 1.0]), {"id": "b"}, greedy=True)
    tally.add(spec([(0, 2)], [4, 4], 1.0), SimpleNamespace(tokens=[4, 4], top2_gaps=[1.0, 1.0]), {"id": "c"}, True)
    report = tally.report(baseline_tps=2.0, plain_bytes=123.0, greedy_check=True)
    assert report["greedy_near_ties"] == 1 and report["greedy_equal"] == 1
    assert [(r["first_diff"], r["top2_gap"]) for r in report["per_prompt"]] == [(1, NEAR_TIE / 2), (0, NEAR_TIE),
                                                                                 (None, None)]
    assert report["accepted_length_histogram"] == [2, 1, 2]  # a = 0, 1, 2 (= k)
    assert report["verified_tokens_per_round"] == 1 + (2 + 2 + 1 + 2 + 2) / 5
    assert report["tau"] == (3 + 1 + 2 + 3 + 1) / 5
    assert report["tokens_per_s"] == 11 / 5.0 and report["speedup"] == pytest.approx(11 / 5.0 / 2.0)
    assert report["bytes_per_token"] == {"speculative": 500 / 8, "plain": 123.0}
    assert report["target_forwards_per_token"] == 5 / 8
    assert report["draft_ms_per_round"] == 1000 * 1.5 / 5 and report["verify_ms_per_round"] == 1000 * 3.0 / 5


def test_trained_length_counts_the_new_tokens_and_is_exceeded_only_past_it(tiny, tiny_head):
    """prompt + max_new_tokens > trained_length: 4 + 7 = 11 > 10 is over, 3 + 7 = 10 is not (issue 56)."""
    target, _ = tiny
    report = evaluate_head(
        tiny_head, target, None, [[256, 1, 2, 3], [256, 9, 9]], k=2, max_new_tokens=7, eos_token_ids=[257],
        baseline=False, prompt_lookup=False, warmup=False, trained_length=10,
    )
    assert report["setup"]["prompts_over_trained_length"] == [report["per_prompt"][0]["id"]]
