"""The precision policy (draftkit.precision): the decision with its checks faked both ways, the cache, explicit
dtypes winning, the slow-bf16 warning, and DraftkitCLI resolving ``auto`` before instantiation."""

import logging
import math
import time
from pathlib import Path

import pytest

from draftkit import precision
from draftkit.cli import DraftkitCLI
from draftkit.precision import (
    PrecisionChoice,
    choose_precision,
    precision_record,
    probe_bf16_slowdown,
    resolve_dtype,
    resolve_trainer_precision,
)

REPO = Path(__file__).resolve().parents[1]
AUTO = ["--trainer.precision=null", "--model.target_dtype=auto"]


def _never():
    raise AssertionError("must not be called")


def test_cpu_without_native_bf16_is_float32_without_probing():
    c = choose_precision("cpu", onednn_bf16=lambda: False, probe=_never, capability=lambda: "AVX2")
    assert c == PrecisionChoice("cpu", "float32", "cpu AVX2 without native bf16 -> float32", None)
    assert c.lightning_precision == "32-true"


@pytest.mark.parametrize("ratio, dtype", [(0.43, "bfloat16"), (1.0, "bfloat16"), (1.01, "float32"), (33.0, "float32")])
def test_cpu_probe_decides(ratio, dtype):
    c = choose_precision("cpu", onednn_bf16=lambda: True, probe=lambda: ratio, capability=lambda: "AVX512")
    assert (c.dtype, c.bf16_slowdown) == (dtype, ratio)
    assert c.reason == f"cpu AVX512: bf16 matmul {ratio:.2f}x the float32 time -> {dtype}"
    assert c.lightning_precision == ("bf16-mixed" if dtype == "bfloat16" else "32-true")


def test_cuda_and_other_devices():
    assert choose_precision("cuda", cuda_bf16=lambda: True, probe=_never).dtype == "bfloat16"
    c = choose_precision("cuda", cuda_bf16=lambda: False, probe=_never)
    assert (c.dtype, c.reason) == ("float32", "cuda cuda device without bf16 -> float32")
    assert choose_precision("mps", probe=_never).dtype == "float32"


def test_decided_once_per_process_and_logged_once(monkeypatch, caplog):
    calls = []

    def fake(device, **kw):
        calls.append(device)
        return PrecisionChoice(device, "float32", "fake -> float32")

    monkeypatch.setattr(precision, "choose_precision", fake)
    precision._decide.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="draftkit.precision"):
            assert [precision.auto_precision(d).dtype for d in ("cpu", "cpu", "cpu:0")] == ["float32"] * 3
        assert calls == ["cpu"]
        assert caplog.text.count("precision auto: fake -> float32") == 1
    finally:
        precision._decide.cache_clear()


def test_auto_follows_the_policy_both_ways(fake_precision):
    fake_precision("float32")
    assert resolve_dtype("auto") == "float32" and resolve_trainer_precision(None) == "32-true"
    assert resolve_trainer_precision("auto") == "32-true"
    fake_precision("bfloat16", 0.5)
    assert resolve_dtype("auto") == "bfloat16" and resolve_trainer_precision(None) == "bf16-mixed"
    assert precision.as_torch_dtype("auto") is __import__("torch").bfloat16


def test_explicit_dtype_wins(fake_precision, caplog):
    fake_precision("bfloat16", 0.5)
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("float32") == "float32" and resolve_dtype("float16") == "float16"
        assert resolve_trainer_precision("32-true") == "32-true"
        assert resolve_dtype("bfloat16") == "bfloat16"  # fast here: no warning
    assert caplog.text == ""
    fake_precision("float32", 30.0)
    assert resolve_dtype("bfloat16", option="--dtype") == "bfloat16"
    assert resolve_trainer_precision("bf16-mixed") == "bf16-mixed"


def test_explicit_bf16_on_slow_cpu_warns_with_the_slowdown(fake_precision, caplog):
    fake_precision("float32", 30.0, "cpu AVX2 without native bf16 -> float32")
    with caplog.at_level(logging.WARNING, logger="draftkit.precision"):
        resolve_dtype("bfloat16", option="model.target_dtype")
        resolve_dtype("bfloat16", option="model.target_dtype")  # once per option
        resolve_trainer_precision("bf16-mixed")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "model.target_dtype=bfloat16 asks for bf16, but this CPU computes it slowly (cpu AVX2 without native bf16 "
        "-> float32): a bf16 matmul took 30.0x the float32 time here; leave it to auto or set float32",
        "trainer.precision=bf16-mixed asks for bf16, but this CPU computes it slowly (cpu AVX2 without native bf16 "
        "-> float32): a bf16 matmul took 30.0x the float32 time here; leave it to auto or set float32",
    ]


def test_bad_dtype_names_the_option():
    with pytest.raises(ValueError, match=r"--dtype must be one of auto, bfloat16, float32, float16, got 'fp8'"):
        resolve_dtype("fp8", option="--dtype")


def test_precision_record(fake_precision):
    choice = fake_precision("float32", 30.0)
    assert precision_record("auto") == {"requested": "auto", "dtype": "float32", "auto": choice.as_dict()}
    assert precision_record("bfloat16")["dtype"] == "bfloat16"


def test_real_probe_is_fast_and_positive():
    t0 = time.perf_counter()
    ratio = probe_bf16_slowdown()
    assert time.perf_counter() - t0 < 1.0
    assert math.isfinite(ratio) and ratio > 0


@pytest.mark.parametrize("dtype, lightning", [("float32", "32-true"), ("bfloat16", "bf16-mixed")])
def test_cli_resolves_auto_before_instantiation(fake_precision, monkeypatch, dtype, lightning):
    monkeypatch.chdir(REPO)
    choice = fake_precision(dtype, 0.5 if dtype == "bfloat16" else None)
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml", *AUTO], run=False)
    assert str(cli.trainer.precision) == lightning and cli.model.hparams.target_dtype == dtype
    assert cli.precision == {
        "trainer_precision": lightning, "target_dtype": dtype,
        "requested": {"trainer_precision": None, "target_dtype": "auto"}, "auto": choice.as_dict(),
    }


def test_cli_keeps_the_recipes_explicit_precision(fake_precision, monkeypatch):
    monkeypatch.chdir(REPO)
    fake_precision("bfloat16", 0.5)
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml"], run=False)  # 32-true, float32
    assert str(cli.trainer.precision) == "32-true" and cli.model.hparams.target_dtype == "float32"


def test_module_resolves_auto_when_built_without_the_cli(fake_precision, tiny_target_dir):
    from draftkit.models.eagle3 import Eagle3Module

    fake_precision("float32")
    model = Eagle3Module(str(tiny_target_dir), draft_vocab_size=320)
    assert model.hparams.target_dtype == "auto"
    model.build()
    assert model.hparams.target_dtype == "float32" and model.target.config.vocab_size == 320
    with pytest.raises(ValueError, match="model.target_dtype must be one of auto"):
        Eagle3Module(str(tiny_target_dir), target_dtype="bf16")


def test_resolve_device(monkeypatch):
    import torch

    from draftkit.precision import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="--device cuda:1: no CUDA device is available here"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:0") == "cuda:0"
