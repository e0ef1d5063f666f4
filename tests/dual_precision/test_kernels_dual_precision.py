"""Kernels in dual precision (issue 35): with the precision switch in place only the float ``nn.Linear`` left (the
16-bit LM head) is packed, never a ``NestedInt8Linear``; float32 logits at both precisions agree with stock to
1e-5 and single-precision, gated and verified decoding emit the same tokens; ``evaluate-dual-precision
--kernels`` reports which ran and the same figures."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from draftkit.dual_precision import Gate, greedy_decode, verified_decode
from draftkit.quant import QuantConfig
from draftkit.quant.linear import NestedInt8Linear
from draftkit.sampling import DecodeConfig
from draftkit.kernels import linears as kernels
from draftkit.target.session import TargetSession

needs_onednn = pytest.mark.skipif(not kernels._onednn_available(), reason="torch without oneDNN")


def _session(tiny_target_dir, quant=None):
    from draftkit.target.frozen import load_target

    model, _ = load_target(str(tiny_target_dir), "float32")
    return TargetSession.with_precision_switch(model, quant)


def _runs(lm):
    """(tokens, logits) of high, low, gated and verified decoding of two prompts, 12 tokens each."""
    cfg = DecodeConfig(12)
    gate = Gate("entropy", 5.7555)  # the tiny target's 4-bit entropies lie in 5.7544-5.7574 nats: both sides
    out = []
    for prompt in ([256, 10, 72, 101, 108], [256, 33] + list(range(40, 60))):
        for traj in (greedy_decode(lm, prompt, cfg, "high"), greedy_decode(lm, prompt, cfg, "low"),
                     greedy_decode(lm, prompt, cfg, gate=gate), verified_decode(lm, prompt, 3, cfg)):
            out.append((traj.tokens, traj.escalated, traj.logits))
    return out


@needs_onednn
def test_only_the_float_lm_head_is_packed_and_decoding_is_unchanged(tiny_target_dir):
    lm = _session(tiny_target_dir)
    model = lm.target.model
    want = _runs(lm)
    with kernels.pack_linears(model, "onednn", min_elements=0) as packed:
        assert packed.modules == [model.lm_head] and type(model.lm_head) is nn.Linear
        assert all("forward" not in vars(m) for m in lm.precision_layers)
        assert all(isinstance(m, NestedInt8Linear) for m in lm.precision_layers) and len(lm.precision_layers) == 56
        got = _runs(lm)
    for (w_tokens, w_esc, w_logits), (g_tokens, g_esc, g_logits) in zip(want, got, strict=True):
        assert g_tokens == w_tokens and g_esc == w_esc
        torch.testing.assert_close(g_logits, w_logits, rtol=1e-5, atol=1e-5)
    escalated = [sum(esc) for _, esc, _ in want if esc]  # the gated runs: some steps escalate, not all
    assert len(escalated) == 2 and all(0 < e < 12 for e in escalated)


@needs_onednn
def test_quantized_lm_head_leaves_nothing_to_pack(tiny_target_dir):
    lm = _session(tiny_target_dir, QuantConfig(quantize_lm_head=True))
    packed = kernels.pack_linears(lm.target.model, "onednn", min_elements=0)
    assert not packed.active and packed.as_dict()["packed_linears"] == 0


@needs_onednn
def test_command_kernels_option(tmp_path, tiny_target_dir, monkeypatch):
    from draftkit.commands.evaluate_dual_precision import evaluate_dual_precision

    monkeypatch.setattr(kernels, "PACK_MIN_ELEMENTS", 0)  # the tiny LM head is under the size floor
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"count to {i}"}) + "\n" for i in range(4)))
    kw = dict(target=str(tiny_target_dir), prompts=str(prompts), calibration_prompts=2, max_new_tokens=6,
              bootstrap_samples=0, dtype="float32")
    reports = {kernel: evaluate_dual_precision(kernels=kernel, **kw) for kernel in ("onednn", "stock")}
    assert reports["onednn"]["kernels"]["packed_linears"] == 1 and reports["onednn"]["kernels"]["kernel"] == "onednn"
    assert reports["stock"]["kernels"]["packed_linears"] == 0
    for name, method in reports["stock"]["methods"].items():
        fast = reports["onednn"]["methods"][name]
        for key in ("bytes_per_token", "escalation_rate", "argmax_agreement", "exact_match"):
            assert fast[key] == method[key], (name, key)
        assert fast["kl_mean"] == pytest.approx(method["kl_mean"], rel=1e-3, abs=1e-7)
    with pytest.raises(ValueError, match="--kernels must be one of auto, onednn, stock, got 'fast'"):
        evaluate_dual_precision(kernels="fast", **kw)
