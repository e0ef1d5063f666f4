"""``kernels compiled`` (issue 35 item 4): the target's decoder stack under ``torch.compile`` gives the eager
outputs (float32 allclose 1e-5 for prefill, one row, a verify and a tree verify with its 4-D mask; greedy plain,
chain and tree decoding token-identical), compiles every graph in its warm-up (decoding afterwards compiles
nothing), is refused while a parameter requires grad, runs only under inference mode (decoding; never in training), and
releases back to eager."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftkit.decoding.drafters import Eagle3Drafter
from draftkit.decoding.tree import Eagle3TreeDrafter, TreeConfig, generate_tree
from draftkit.decoding.verify import generate_plain, generate_speculative
from draftkit.sampling import DecodeConfig
from draftkit.target.frozen import FrozenTarget
from draftkit.kernels.compile import compile_target
from draftkit.kernels.option import use_kernels
from draftkit.target.session import TargetSession

PROMPTS = [[256, 10, 72, 101, 108, 108, 111, 257, 10], [256, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 8, 9, 10]]


def _target(tiny_target_dir) -> FrozenTarget:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    return FrozenTarget(model.eval().requires_grad_(False))


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled(tiny_target_dir):
    """(compiled FrozenTarget, its handle, an eager FrozenTarget of the same weights).

    Compiled on one thread, as every test runs (conftest): the graphs guard on torch's thread count."""
    target = _target(tiny_target_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    handle = compile_target(target)
    torch.set_num_threads(before)
    yield target, handle, _target(tiny_target_dir)
    handle.release()


def test_compiled_forward_matches_eager_for_every_shape_class(compiled):
    target, handle, eager = compiled
    info = handle.as_dict()
    assert info["kernel"] == "compiled" and info["graphs"] == handle.graphs >= 3 and info["compile_s"] > 0
    assert target.compiled_forward is not None and eager.compiled_forward is None
    graphs = _graphs()
    sessions = TargetSession(target), TargetSession(eager)
    g = torch.Generator().manual_seed(0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [
        dict(input_ids=torch.randint(0, 320, (17,), generator=g)),
        dict(input_ids=torch.randint(0, 320, (1,), generator=g)),
        dict(input_ids=torch.randint(0, 320, (5,), generator=g)),
        dict(input_ids=torch.randint(0, 320, (4,), generator=g), position_ids=torch.tensor([23, 24, 24, 25]),
             attn_mask=torch.cat([torch.ones(4, 23, dtype=torch.bool), tree], 1)),
    ]
    for step in steps:
        (got_logits, got_aux), (want_logits, want_aux) = (s.forward(**step) for s in sessions)
        assert got_logits.shape == want_logits.shape == (step["input_ids"].shape[0], 320)
        assert got_aux.shape == want_aux.shape == (step["input_ids"].shape[0], 3 * 64)
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_aux, want_aux, rtol=1e-5, atol=1e-5)
    assert sessions[0].length == sessions[1].length == 27
    assert _graphs() == graphs  # the warm-up compiled every shape class


def test_compiled_greedy_decoding_is_token_identical_and_compiles_nothing(compiled):
    from decoding_stubs import make_head

    target, _, eager = compiled
    head = make_head(eager)
    cfg = DecodeConfig(max_new_tokens=20)
    graphs = _graphs()
    runs = {}
    for name, t in (("compiled", target), ("eager", eager)):
        session = TargetSession(t)
        runs[name] = [
            (generate_plain(session, torch.tensor(p), cfg).tokens,
             generate_speculative(session, Eagle3Drafter(head), torch.tensor(p), 3, cfg).tokens,
             generate_tree(session, Eagle3TreeDrafter(head), torch.tensor(p), TreeConfig(3, 2, 5), cfg).tokens)
            for p in PROMPTS
        ]
    assert runs["compiled"] == runs["eager"]
    assert all(len(plain) == 20 and plain == chain == tree for plain, chain, tree in runs["compiled"])
    assert _graphs() == graphs


def test_training_forward_keeps_the_eager_path(compiled, monkeypatch):
    target, _, eager = compiled
    calls = []
    graph = target.compiled_forward
    monkeypatch.setattr(target, "compiled_forward", lambda **kw: calls.append(1) or graph(**kw))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        got = target(ids)  # a training forward: hooks, not the compiled graph
        want = eager(ids)
    assert calls == []
    with torch.inference_mode():
        compiled_out = target(ids)  # a decoding forward
    assert calls == [1]
    for out in (got, compiled_out):
        torch.testing.assert_close(out.aux_hidden_states, want.aux_hidden_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_refused_while_a_parameter_requires_grad_and_released_to_eager(tiny_target_dir):
    target = _target(tiny_target_dir)
    target.model.model.layers[3].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"kernels=compiled: target parameter model.layers.3.mlp.up_proj.weight "
                                         r"requires grad; compile only a frozen target"):
        compile_target(target)
    assert target.compiled_forward is None
    with pytest.raises(ValueError, match="kernels must be one of auto, onednn, stock, compiled, got 'fast'"):
        use_kernels("fast", target, torch.nn.Linear(2, 2))


def test_release_restores_eager(tiny_target_dir, monkeypatch):
    from draftkit.kernels import compile as kernels

    target = _target(tiny_target_dir)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # compile nothing: only the handle's bookkeeping
    monkeypatch.setattr(kernels.torch, "compile", lambda fn, **kw: fn)
    with compile_target(target) as handle:
        assert handle.active and target.compiled_forward is not None
    assert not handle.active and target.compiled_forward is None and not handle.lm_head.active
