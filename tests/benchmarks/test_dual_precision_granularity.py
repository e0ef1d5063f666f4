"""benchmarks/dual_precision_granularity.py ``--kernels`` (issue 35): on the tiny target, onednn packs the float
LM head left after quantization in every slicing's copy, the packed kernel runs in the decode and the replays, and
every replay figure equals the stock run's; the choice is recorded per entry and a bad value is refused."""

from __future__ import annotations

import json

import pytest

from draftkit.data.prompts import Prompt
from draftkit.kernels import linears as kernels

needs_onednn = pytest.mark.skipif(not kernels._onednn_available(), reason="torch without oneDNN")

VOLATILE = ("timing_s", "load_average", "kernels")
"""Entry fields that differ between two runs of the same configuration."""


def _run(mod, tmp_path, kernel: str) -> dict:
    out = tmp_path / f"{kernel}.json"
    mod.main(["--target", "tiny", "--num_prompts", "3", "--max_new_tokens", "8", "--groups", "none,32",
              "--slicings", "midpoint,round", "--bootstrap_samples", "20", "--kernels", kernel, "--output", str(out)])
    return json.loads(out.read_text())


@needs_onednn
def test_kernels_option_packs_the_lm_head_and_keeps_every_figure(tmp_path, tiny_target_dir, monkeypatch,
                                                                  benchmark_module):
    mod = benchmark_module("dual_precision_granularity")
    monkeypatch.setitem(mod.TARGETS, "tiny", (str(tiny_target_dir), True))  # ChatML template
    prompts = [Prompt(str(i), [{"role": "user", "content": f"count to {i} and stop"}]) for i in range(24)]
    monkeypatch.setattr(mod, "load_prompts", lambda source: prompts)  # 20 calibration + 4 evaluation, offline
    monkeypatch.setattr(kernels, "PACK_MIN_ELEMENTS", 0)  # the tiny LM head (320 x 64) is under the size floor
    calls = []
    real = kernels._packed_linear
    monkeypatch.setattr(kernels, "_packed_linear", lambda x, w, b: calls.append(x.shape[:-1]) or real(x, w, b))

    stock = _run(mod, tmp_path, "stock")
    assert calls == []
    packed = _run(mod, tmp_path, "onednn")
    keys = ["tiny/sym/none/midpoint", "tiny/sym/none/round", "tiny/sym/32/midpoint", "tiny/sym/32/round"]
    assert list(stock["entries"]) == list(packed["entries"]) == keys
    assert (stock["setup"]["kernels"], packed["setup"]["kernels"]) == ("stock", "onednn")
    # per group: 3 all-high decodes of 8 tokens on the first slicing (8 forwards each: the prompt, 7 one-token
    # steps), then a high and a low teacher-forced replay forward per prompt and slicing
    assert len(calls) == 2 * (3 * 8 + 2 * 3 * 2)
    for key in keys:
        s, p = stock["entries"][key], packed["entries"][key]
        assert s["kernels"]["kernel"] == "stock" and s["kernels"]["packed_linears"] == 0
        assert p["kernels"]["kernel"] == "onednn" and p["kernels"]["packed_linears"] == 1
        assert p["kernels"]["packed_bytes"] > 0 and p["kernels"]["weight_bytes"] == 320 * 64 * 4
        assert s["num_steps"] == 3 * 8
        assert {k: v for k, v in p.items() if k not in VOLATILE} == {k: v for k, v in s.items() if k not in VOLATILE}


def test_kernels_option_refuses_an_unknown_value(tmp_path, benchmark_module, capsys):
    mod = benchmark_module("dual_precision_granularity")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--kernels", "fast", "--output", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.replace("'", "")  # Python 3.12+ quotes the choices
    assert "argument --kernels: invalid choice: fast (choose from auto, onednn, stock)" in err
