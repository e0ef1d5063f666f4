"""Muon + AdamW as one optimizer: the split, steps equal to the two torch optimizers, exact state round trip."""

import copy

import pytest
import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.models.eagle3 import OptimConfig
from draftkit.models.muon import MuonWithAdamW, split_muon_params


def _head() -> Eagle3LlamaHead:
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=96, draft_vocab_size=48, target_hidden_size=24, num_aux_layers=3, head_dim=8)
    head = Eagle3LlamaHead(cfg)
    head.embed_tokens.weight.requires_grad_(False)
    return head


def _grads(head: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.grad = torch.randn(p.shape, generator=g) if p.requires_grad else None


def test_split_gives_hidden_matrices_to_muon():
    head = _head()
    muon, adamw = split_muon_params(head)
    names = {id(p): n for n, p in head.named_parameters()}
    muon_names = sorted(names[id(p)] for p in muon)
    assert muon_names == sorted(["fc.weight", *(f"midlayer.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))])
    assert "lm_head.weight" in {names[id(p)] for p in adamw}
    assert all(p.ndim == 1 for p in adamw if names[id(p)] != "lm_head.weight")  # norms
    trainable = {id(p) for p in head.parameters() if p.requires_grad}
    assert {id(p) for p in muon} | {id(p) for p in adamw} == trainable and not {id(p) for p in muon} & {id(p) for p in adamw}


def test_step_equals_muon_then_adamw_and_follows_the_schedule(fake_precision):
    """Three steps under a LambdaLR equal torch's Muon and AdamW stepped separately, bit for bit (where bf16 is
    fast, so Muon keeps its own bfloat16 Newton-Schulz)."""
    fake_precision("bfloat16")
    head, ref = _head(), _head()
    opt = MuonWithAdamW(*split_muon_params(head), lr=2e-3, weight_decay=0.01)
    muon, adamw = split_muon_params(ref)
    ref_opts = [torch.optim.Muon(muon, lr=2e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(adamw, lr=2e-3, weight_decay=0.01, betas=(0.9, 0.95))]
    factors = [0.5, 1.0, 0.25, 0.1]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factors[s])
    for step in range(3):
        for o in ref_opts:
            for group in o.param_groups:
                group["lr"] = 2e-3 * factors[step]
        assert [g["lr"] for g in opt.param_groups] == [2e-3 * factors[step]] * 2
        _grads(head, step), _grads(ref, step)
        opt.step()
        for o in ref_opts:
            o.step()
        sched.step()
    for (name, a), b in zip(head.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(head.fc.weight, _head().fc.weight)


def test_state_dict_round_trip_resumes_exactly():
    head = _head()
    opt = MuonWithAdamW(*split_muon_params(head), lr=1e-3)
    for step in range(2):
        _grads(head, step)
        opt.step()
    saved_head, saved = copy.deepcopy(head), copy.deepcopy(opt.state_dict())
    assert len(saved["state"]) == len(list(p for p in head.parameters() if p.requires_grad))
    _grads(head, 2)
    opt.step()
    fresh = MuonWithAdamW(*split_muon_params(saved_head), lr=1e-3)
    fresh.load_state_dict(saved)
    _grads(saved_head, 2)
    fresh.step()  # the inner optimizers step with the loaded momentum buffers
    for a, b in zip(head.parameters(), saved_head.parameters()):
        assert torch.equal(a, b)


def test_bad_settings_name_the_option():
    with pytest.raises(ValueError, match="model.optim.optimizer must be adamw or muon"):
        OptimConfig(optimizer="sgd")
    head = _head()
    opt = MuonWithAdamW(*split_muon_params(head), lr=1e-3)
    with pytest.raises(NotImplementedError, match="no parameter group after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2))]})
    with pytest.raises(ValueError, match="no 2-D trainable matrix"):
        MuonWithAdamW([], [torch.nn.Parameter(torch.zeros(3))], lr=1e-3)


def test_both_groups_take_the_given_decay_not_a_default():
    head = _head()
    for wd in (0.0, 0.2):
        opt = MuonWithAdamW(*split_muon_params(head), lr=1e-3, weight_decay=wd, betas=(0.5, 0.6))
        assert [g["weight_decay"] for g in opt.param_groups] == [wd, wd]
        assert opt.param_groups[1]["betas"] == (0.5, 0.6) and [g["muon"] for g in opt.param_groups] == [True, False]
    # a custom AdamW name list moves the matrix to AdamW (name match, not prefix of another name)
    muon, adamw = split_muon_params(head, adamw_names=("lm_head", "embed_tokens", "fc"))
    names = {id(p): n for n, p in head.named_parameters()}
    assert "fc.weight" in {names[id(p)] for p in adamw} and "fc.weight" not in {names[id(p)] for p in muon}


def test_newton_schulz_in_float32_equals_a_float64_reference():
    """The float32 iteration against the same quintic iteration written plainly in float64, wide and tall."""
    from draftkit.models.muon import newton_schulz

    coeffs = (3.4445, -4.775, 2.0315)
    def reference(g):
        x = g.double().T if g.shape[0] > g.shape[1] else g.double()
        x = x / x.norm()
        for _ in range(5):
            a = x @ x.T
            x = coeffs[0] * x + (coeffs[1] * a + coeffs[2] * a @ a) @ x
        return x.T if g.shape[0] > g.shape[1] else x

    for shape in [(6, 10), (10, 6)]:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        for given in (g, g.bfloat16()):  # any input dtype; the iterations in float32
            out = newton_schulz(given, coeffs, 5, 1e-7)
            assert out.dtype == torch.float32 and out.shape == shape
            assert torch.allclose(out.double(), reference(given), atol=1e-5)
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.ones(2, 2, 2), coeffs, 5, 1e-7)


@pytest.mark.parametrize("policy,float32_calls", [("float32", 1), ("bfloat16", 0)])
def test_muon_runs_newton_schulz_in_float32_where_bf16_is_slow(fake_precision, monkeypatch, policy, float32_calls):
    """Where the precision policy chose float32 (an AVX2 CPU: a bf16 matmul ~70x slower), a step orthogonalises
    each Muon matrix with the float32 iteration and equals torch's Muon run with it; elsewhere torch's own."""
    import torch.optim._muon as torch_muon

    from draftkit.models import muon as dk_muon

    fake_precision(policy)
    calls = []
    real = dk_muon.newton_schulz

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(dk_muon, "newton_schulz", counted)
    head, ref = _head(), _head()
    opt = MuonWithAdamW(*split_muon_params(head), lr=2e-3, weight_decay=0.01)
    muon, _ = split_muon_params(ref)
    ref_opt = torch.optim.Muon(muon, lr=2e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    _grads(head, 0), _grads(ref, 0)
    opt.step()
    assert len(calls) == float32_calls * len(muon)
    if float32_calls:
        monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", real)
    ref_opt.step()
    for a, b in zip(split_muon_params(head)[0], muon):
        assert torch.equal(a, b)
