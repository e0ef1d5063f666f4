"""``draftkit select-layers`` on the tiny target: report keys, figures, TensorBoard, recipe defaults, bad input."""

import json
import random
import re

import pytest

from draftkit.commands import main as draftkit_main


def main(args):
    return draftkit_main(["select-layers", *args])

REPORT_KEYS = {"num_tokens", "entropy_filter", "layer_entropy_h1", "layer_entropy_h2", "cka", "top_subsets", "chosen",
               "heuristic", "heuristic_rank"}


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    rng = random.Random(0)
    words = ["the", "draft", "head", "reads", "aux", "states", "and", "predicts", "next", "token", "of", "target", "quickly"]
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with open(path, "w") as f:
        for _ in range(24):
            turns = []
            for _ in range(2):
                turns.append({"role": "user", "content": " ".join(rng.choices(words, k=6))})
                turns.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(8, 20)))})
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def _args(target, data, out, *extra):
    return ["--target", str(target), "--target_dtype", "float32", "--data", str(data), "--output", str(out),
            "--analysis.num_tokens", "3000", "--analysis.min_tokens", "64", "--analysis.warmup_rows", "128",
            "--batch_size", "4", "--max_length", "256", "--analysis.rerank_top", "4", *extra]


def test_cli_writes_report_figures_and_tensorboard(tiny_target_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "run" / "layers.json"
    assert main(_args(tiny_target_dir, chat_jsonl, out, "--analysis.entropy_quantile", "0.2", "--analysis.entropy_sweep", "[0.5]",
                      "--extra_sets", "[[1,2,3]]")) == 0
    report = json.loads(out.read_text())
    assert REPORT_KEYS <= set(report)
    assert report["layer_ids"] == list(range(1, 8))
    cka = report["cka"]
    assert all(cka[i][i] == 1.0 for i in range(7))
    assert all(cka[i][j] == cka[j][i] for i in range(7) for j in range(7))
    assert report["cka_method"] == "exact"  # P*d = 448 <= exact_max_width
    assert len(report["chosen"]) == 3 and report["chosen"] == report["top_subsets"][0]["ids"]
    assert report["heuristic"]["ids"] == [2, 4, 5] and 1 <= report["heuristic_rank"] <= 35
    # exact route: the screening score equals the exact H2(S)
    assert report["heuristic"]["h2_closed"] == pytest.approx(report["heuristic"]["h2"], abs=1e-9)
    ef = report["entropy_filter"]
    assert ef["quantile"] == 0.2 and 0.7 < ef["kept_fraction"] < 0.9
    assert report["num_tokens"] == report["filters"]["counts"]["kept"] < 3000
    assert report["entropy_sweep"][0]["quantile"] == 0.5 and report["entropy_sweep"][0]["num_tokens"] < report["num_tokens"]
    assert report["extra_sets"][0]["ids"] == [1, 2, 3]
    assert (out.parent / "layers_cka.png").stat().st_size > 1000
    assert (out.parent / "layers_entropy.png").stat().st_size > 1000
    assert list((out.parent / "tb").glob("events.out.tfevents.*"))
    assert "select-layers: chosen" in capsys.readouterr().out


def test_cli_recipe_supplies_target_data_and_options(tiny_target_dir, chat_jsonl, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model:\n  target: {tiny_target_dir}\n  target_dtype: float32\ndata:\n  path: {chat_jsonl}\n  max_length: 256\n"
        "trainer:\n  callbacks:\n    - class_path: draftkit.callbacks.layer_selection.LayerSelection\n"
        "      init_args: {num_tokens: 500, k: 2, options: {min_tokens: 16, cka: minibatch, cka_batch_size: 64}}\n"
    )
    out = tmp_path / "layers.json"
    assert main(["--recipe", str(recipe), "--output", str(out), "--tensorboard", "false", "--analysis.rerank_top", "2"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["num_tokens"] == 500 and len(report["chosen"]) == 2
    assert report["cka_method"] == "minibatch" and report["heuristic_rank"] is None  # k = 2
    assert report["filters"]["counts"]["candidates"] == 500
    assert report["meta"]["target_dtype"] == "float32"
    assert report["meta"]["precision"]["requested"] == "float32" and report["meta"]["precision"]["dtype"] == "float32"


def test_cli_bad_input_writes_nothing(tiny_target_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "bad" / "layers.json"
    assert main(_args(tiny_target_dir, chat_jsonl, out, "--analysis.entropy_threshold", "50", "--tensorboard", "false")) == 2
    assert re.search(r"only \d+ rows are left after filtering.*lower entropy_threshold \(now 50.0", capsys.readouterr().err)
    assert not out.exists() and not out.with_name("layers_cka.png").exists()
    assert main(_args(tiny_target_dir, chat_jsonl, out, "--analysis.k", "8", "--tensorboard", "false")) == 2
    assert "--analysis.k 8 exceeds the 7 candidate layers" in capsys.readouterr().err
    assert not out.exists()
