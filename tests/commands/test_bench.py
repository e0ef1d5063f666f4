"""``draftkit bench train --dtypes``: the recipe timed once per compute dtype in one run."""

from pathlib import Path

import pytest
import torch

from draftkit.commands import main as draftkit_main
from draftkit.commands.bench import dtype_overrides

REPO = Path(__file__).resolve().parents[2]


def main(args):
    return draftkit_main(["bench", *args])


def test_dtype_overrides():
    assert dtype_overrides("auto") == ["--model.target_dtype=auto", "--trainer.precision=null"]
    assert dtype_overrides("bfloat16") == ["--model.target_dtype=bfloat16", "--trainer.precision=bf16-mixed"]
    assert dtype_overrides("float32") == ["--model.target_dtype=float32", "--trainer.precision=32-true"]
    with pytest.raises(ValueError, match="--dtypes: unknown dtype 'fp8'"):
        dtype_overrides("fp8")


def test_bench_train_dtypes_side_by_side(monkeypatch, capsys, fake_precision):
    monkeypatch.chdir(REPO)
    fake_precision("float32", 30.0, "fake cpu AVX2 without native bf16 -> float32")
    assert main(["train", "--recipe", "recipes/tiny-debug.yaml", "--dtypes", "auto,bfloat16",
                 "--steps", "1", "--warmup", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("auto: fake cpu AVX2 without native bf16 -> float32)")
    rows = {line.split()[0]: line.split()[1:3] for line in lines[2:]}
    assert rows == {"auto": ["32-true", "float32"], "bfloat16": ["bf16-mixed", "bfloat16"]}
    assert main(["train", "--recipe", "recipes/tiny-debug.yaml", "--dtypes", "auto,fp8"]) == 2
    assert "--dtypes: unknown dtype 'fp8'" in capsys.readouterr().err


def test_bench_decode_reports_hf_generate_and_the_kernels(tmp_path):
    """bench decode on the tiny target: draftkit's plain decoding beside HF generate() (identical greedy tokens)
    and the kernel choice in every result."""
    import json

    out = tmp_path / "decode.json"
    assert main(["decode", "--target", "tiny:llama", "--dtype", "[float32]", "--k", "2", "--max_new_tokens", "6",
                 "--num_prompts", "2", "--pattern", "1,2", "--kernels", "stock", "--draft_vocab_size", "256",
                 "--output", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["hf_outputs_equal_plain"] == 2 and result["outputs_equal_plain"] == 2
    assert result["plain_vs_hf_generate"] == pytest.approx(
        result["plain_tokens_per_s"] / result["hf_generate_tokens_per_s"])
    assert result["kernels"]["kernel"] == "stock" and result["kernels"]["packed_linears"] == 0


def test_bench_decode_packed_reports_what_it_packed_and_hf_generate_on_stock_kernels(tmp_path, monkeypatch):
    """With the target packed (--kernels onednn, the size floor lifted for the tiny target) the report counts
    every linear layer of the target and its packed bytes (read before the release), and HF generate() is timed
    again on stock kernels: plain_vs_hf_generate_stock is plain tokens/s over that figure."""
    import json

    from draftkit.artifacts import resolve_model_dir
    from draftkit.kernels import linears as kernels
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(kernels, "PACK_MIN_ELEMENTS", 0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir("tiny:llama"))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    out = tmp_path / "decode.json"
    assert main(["decode", "--target", "tiny:llama", "--dtype", "[float32]", "--k", "2", "--max_new_tokens", "6",
                 "--num_prompts", "2", "--pattern", "1,2", "--kernels", "onednn", "--draft_vocab_size", "256",
                 "--output", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["kernels"]["kernel"] == "onednn"
    assert result["kernels"]["packed_linears"] == len(linears)
    assert result["kernels"]["weight_bytes"] == sum(m.weight.numel() * 4 for m in linears)
    assert result["kernels"]["packed_bytes"] > 0
    assert result["head_kernels"]["kernel"] == "onednn" and result["head_kernels"]["packed_linears"] > 0
    assert result["hf_outputs_equal_plain"] == 2 and result["outputs_equal_plain"] == 2
    assert result["plain_vs_hf_generate_stock"] == pytest.approx(
        result["plain_tokens_per_s"] / result["hf_generate_stock_tokens_per_s"])


def test_bench_decode_takes_one_dtype_as_evaluate_does(tmp_path, monkeypatch, capsys):
    """``bench decode --dtype float32`` (evaluate's spelling) stopped in the parser: "Does not validate against any
    of the Union subtypes ... Expected a <class 'list'>"; only ``--dtype [float32]`` ran. One dtype and a
    comma-separated list now reach the loader (here: each dtype asked for, in order)."""
    import draftkit.export.head_target as head_target

    seen = []

    def fake_load(checkpoint, target, dtype, *args, **kwargs):
        seen.append(dtype)
        raise ValueError(f"stop at {dtype}")

    monkeypatch.setattr(head_target, "load_head_and_target", fake_load)
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    for given, first in (("float32", "float32"), ("bfloat16,float32", "bfloat16"), ("[float32]", "float32")):
        seen.clear()
        assert main(["decode", "--target", "tiny:llama", "--dtype", given]) == 2
        assert capsys.readouterr().err == f"draftkit bench decode: error: stop at {first}\n"
        assert seen == [first]
