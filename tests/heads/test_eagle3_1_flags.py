"""EAGLE-3.1 head options (issue 34 item 1): each flag changes the forward as the engines compute it.

Hand-computed cases on a tiny head (H = H_t = 2, two aux states) for ``norm_before_fc`` and ``fc_norm``, the
``norm_output`` recurrence against a written-out RMSNorm, and the TTT path against cached decoding with every
flag on.
"""

import math

import pytest
import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead, KVCache
from draftkit.testing import tiny_llama_config

EPS = 1e-6


def _tiny(**flags) -> Eagle3LlamaHead:
    cfg = Eagle3Config(hidden_size=2, target_hidden_size=2, num_aux_layers=2, intermediate_size=4,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=2, vocab_size=8, draft_vocab_size=8,
                       rms_norm_eps=EPS, **flags)
    head = Eagle3LlamaHead(cfg).double()
    with torch.no_grad():
        head.fc.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]]))  # picks F[0] and F[3]
    return head


F = torch.tensor([[[3.0, 4.0, 0.0, 2.0]]], dtype=torch.float64)  # (1, 1, n*H_t): aux states [3, 4] and [0, 2]


def test_no_flag_fc_reads_the_raw_aux_states():
    torch.testing.assert_close(_tiny().project(F), torch.tensor([[[3.0, 2.0]]], dtype=torch.float64))


def test_norm_before_fc_is_one_rmsnorm_over_the_concatenation():
    """vLLM/SGLang/speculators/TRT-LLM ``input_norm``: rms([3, 4, 0, 2]) = sqrt(29/4); fc picks F[0], F[3]."""
    head = _tiny(norm_before_fc=True)
    with torch.no_grad():
        head.input_norm.weight.copy_(torch.tensor([1.0, 1.0, 1.0, 0.5]))
    rms = math.sqrt(29 / 4 + EPS)
    torch.testing.assert_close(head.project(F), torch.tensor([[[3 / rms, 0.5 * 2 / rms]]], dtype=torch.float64))
    assert tuple(head.input_norm.weight.shape) == (4,) and head.fc_norm is None
    assert "input_norm.weight" in head.export_state_dict()


def test_fc_norm_is_one_rmsnorm_per_aux_state():
    """``fc_norm.{i}``: rms([3, 4]) = sqrt(12.5), rms([0, 2]) = sqrt(2), each with its own weight."""
    head = _tiny(fc_norm=True)
    with torch.no_grad():
        head.fc_norm[1].weight.copy_(torch.tensor([1.0, 0.5]))
    want = [[[3 / math.sqrt(12.5 + EPS), 0.5 * 2 / math.sqrt(2 + EPS)]]]
    torch.testing.assert_close(head.project(F), torch.tensor(want, dtype=torch.float64))
    assert head.input_norm is None
    assert {k for k in head.export_state_dict() if k.startswith("fc_norm.")} == {"fc_norm.0.weight", "fc_norm.1.weight"}


def test_norm_before_fc_and_fc_norm_are_exclusive():
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm are exclusive"):
        _tiny(norm_before_fc=True, fc_norm=True)


def _pair(**flags):
    """Two heads with the same random weights, one with the flags (engines' tiny test shape)."""
    cfg = Eagle3Config.from_target_config(tiny_llama_config(), [2, 4, 5], 320)
    torch.manual_seed(0)
    plain = Eagle3LlamaHead(cfg).double()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    flagged = Eagle3LlamaHead(Eagle3Config(**{**cfg.__dict__, **flags})).double()
    flagged.load_state_dict(plain.state_dict(), strict=False)
    return plain, flagged


def test_norm_output_feeds_the_normed_state_and_keeps_the_logits():
    """vLLM ``aux_output = hidden_states if norm_output``; SGLang ``aux = hidden_states_to_logits``: the next step
    reads w * h / rms(h) (the final norm's output); the logits are lm_head of the same normed state."""
    plain, flagged = _pair(norm_output=True)
    torch.manual_seed(1)
    aux = torch.randn(1, 3, 192, dtype=torch.float64)
    ids = torch.randint(0, 320, (1, 3))
    pos = torch.arange(3)[None]
    logits_a, h = plain(ids, plain.project(aux), pos)
    logits_b, feat = flagged(ids, flagged.project(aux), pos)
    torch.testing.assert_close(logits_b, logits_a, rtol=0, atol=0)
    by_hand = plain.norm.weight * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + plain.config.rms_norm_eps)
    torch.testing.assert_close(feat, by_hand, rtol=1e-6, atol=1e-6)  # RMSNorm runs in fp32, as Llama's
    assert not torch.allclose(feat, h)
    # the second step differs because it reads norm(h), and equals the plain head fed norm(h) by hand
    nxt = torch.randint(0, 320, (1, 1))
    step_b, _ = flagged(nxt, feat[:, -1:], torch.tensor([[3]]))
    step_a, _ = plain(nxt, by_hand[:, -1:], torch.tensor([[3]]))
    torch.testing.assert_close(step_b, step_a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
                                   {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}])
def test_ttt_with_flags_equals_cached_decoding(flags):
    """Training (TTT) and serving (KV cache) compute the same function under every flag."""
    _, head = _pair(**flags)
    for p in head.parameters():  # the new norms too, off their ones
        torch.nn.init.normal_(p, mean=1.0, std=0.2) if p.dim() == 1 else None
    b, t, steps = 1, 5, 3
    torch.manual_seed(3)
    aux = torch.randn(b, t, 192, dtype=torch.float64)
    ids = torch.randint(0, 320, (b, t + steps))
    pos = torch.arange(t)[None]
    mask = torch.ones(b, t, dtype=torch.bool)
    cache, feature, outs = [], head.project(aux), []
    for k in range(steps):
        logits, feature = head.ttt_step(ids[:, 1 + k:1 + k + t], feature, pos + k, cache, mask)
        outs.append(logits)
    p = t - 2
    kv = KVCache()
    logits, f = head(ids[:, 1:p + 2], head.project(aux[:, :p + 1]), pos[:, :p + 1], kv)
    torch.testing.assert_close(logits[0, -1], outs[0][0, p], rtol=1e-9, atol=1e-9)
    f = f[:, -1:]
    for k in range(1, steps):
        logits, f = head(ids[:, p + 1 + k:p + 2 + k], f, pos[:, p:p + 1] + k, kv)
        torch.testing.assert_close(logits[0, -1], outs[k][0, p], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("flags", [{}, {"norm_before_fc": True, "norm_output": True}, {"fc_norm": True, "norm_output": True},
                                   {"norm_output": True, "norm_before_residual": True}])
def test_ttt_under_bf16_autocast_keeps_one_dtype_across_steps(flags):
    """bf16-mixed training (float32 head under bfloat16 autocast, a bfloat16 target's aux states): every TTT step's
    feature is bfloat16 like step 0's, so the fused attention sees one dtype (norm_output's float32 norm product
    once reached it as float32 and the CPU flash kernel refused the mixed keys), and the loss and gradients are
    finite."""
    cfg = Eagle3Config.from_target_config(tiny_llama_config(), [2, 4, 5], 320)
    head = Eagle3LlamaHead(Eagle3Config(**{**cfg.__dict__, **flags}))
    b, t, steps = 2, 6, 3
    torch.manual_seed(4)
    aux = torch.randn(b, t, 192).to(torch.bfloat16)
    ids = torch.randint(0, 320, (b, t + steps))
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 4:] = False  # a right-padded row, as the collator pads
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache, feature, loss, dtypes = [], head.project(aux), 0.0, []
        for k in range(steps):
            dtypes.append(feature.dtype)
            logits, feature = head.ttt_step(ids[:, 1 + k:1 + k + t], feature, torch.arange(t)[None] + k, cache, mask)
            loss = loss + logits.float().logsumexp(-1)[mask].mean()
    assert dtypes == [torch.bfloat16] * steps
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters() if p.requires_grad
               and p is not head.embed_tokens.weight)
