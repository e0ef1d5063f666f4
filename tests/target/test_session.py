"""draftkit.target.session.TargetSession: the one KV-cache session of the target. With a precision switch its
logits are exactly the model's own at each precision, cached or not; ``logits_to_keep`` keeps the last rows;
a crop rolls the cache back to what a fresh session holds (issue 31, issue 36)."""

import pytest
import torch

from draftkit.quant import QuantConfig, precision, weight_bytes
from draftkit.target.frozen import cache_kwarg
from draftkit.target.session import TargetSession

IDS = [5, 9, 3, 7, 11, 2]


def _session(dtype: str, path) -> TargetSession:
    from draftkit.target.frozen import load_target

    model, _ = load_target(str(path), dtype)
    return TargetSession.with_precision_switch(model)


@pytest.fixture(scope="module")
def lm(tiny_target_dir):
    return _session("float64", tiny_target_dir)


@pytest.fixture(scope="module", params=["float32", "float64"])
def lm_exact(request, tiny_target_dir):
    return _session(request.param, tiny_target_dir)


def test_logits_to_keep_one_returns_last_position_only(lm):
    ids = IDS[:4]
    lm.reset()
    out, _ = lm.forward(ids, 1, precision="high")
    lm.reset()
    full, _ = lm.forward(ids, precision="high")
    assert out.shape == (1, full.shape[1]) and out.dtype == torch.float32
    assert torch.equal(out[0], full[-1])


def test_cached_forward_equals_cache_free(lm):
    """Prefix then one token through the cache == the whole sequence without one: the cache was filled and used."""
    model = lm.target.model
    ids = IDS[:4]
    lm.reset()
    lm.forward(ids[:3], 1, precision="low")
    assert lm.cache.get_seq_length() == 3 and lm.length == 3
    step, _ = lm.forward(ids[3:], 1, precision="low")
    assert lm.cache.get_seq_length() == 4 and lm.length == 4
    with precision(model, "low"):
        free = model(torch.tensor([ids]), use_cache=False).logits[0, -1:].float()
    torch.testing.assert_close(step, free, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("prec", ["high", "low"])
def test_precision_switch_is_the_model_at_that_precision(lm_exact, prec):
    """Every forward of the session == the quantized HF model run directly at that precision, bit for bit:
    a cache-free forward, its last rows, and a prefill-then-extend through transformers' own cache."""
    lm, model = lm_exact, lm_exact.target.model
    other = "low" if prec == "high" else "high"
    ids = torch.tensor([IDS])
    kw = cache_kwarg(model.forward)
    with precision(model, prec):
        ref = model(ids, use_cache=False).logits[0].float()  # (6, V)
        ref_last = model(ids, use_cache=False, logits_to_keep=3).logits[0].float()  # (3, V)
        first = model(ids[:, :4], use_cache=True)
        cache = first.cache if "cache" in first else first.past_key_values
        ref_step = model(ids[:, 4:], logits_to_keep=2, **{kw: cache}).logits[0].float()  # (2, V)
    lm.forward([1], precision=other)  # whatever the switch held before, the forward sets it
    lm.reset()
    full, aux = lm.forward(IDS, precision=prec)
    assert torch.equal(full, ref) and aux.shape == (6, model.config.hidden_size)
    lm.reset()
    assert torch.equal(lm.forward(IDS, 3, precision=prec)[0], ref_last)
    torch.testing.assert_close(ref_last, ref[-3:], rtol=1e-5, atol=1e-6)  # (bitwise only with the same row count)
    lm.reset()
    lm.forward(IDS[:4], 1, precision=prec)
    step, _ = lm.forward(IDS[4:], 2, precision=prec)
    assert torch.equal(step, ref_step)
    with precision(model, other):
        assert not torch.equal(ref, model(ids, use_cache=False).logits[0].float())  # the switch matters
    lm.reset()


def test_crop_round_trip_equals_a_fresh_session(lm_exact):
    """Drafts at 4 bits, crop them, re-run at 8 bits: the logits and the cache are those of a session that only
    ever ran the 8-bit forwards (the verified-speculation rollback)."""
    lm = lm_exact
    lm.reset()
    lm.forward(IDS[:4], 1, precision="high")
    lm.forward(IDS[4:5], 1, precision="low")
    lm.forward(IDS[5:], 1, precision="low")
    assert lm.length == 6
    lm.crop(4)
    assert lm.length == 4 and lm.cache.get_seq_length() == 4
    again, _ = lm.forward(IDS[4:], precision="high")
    keys = [layer.keys.clone() for layer in lm.cache.layers]
    lm.reset()
    lm.forward(IDS[:4], 1, precision="high")
    fresh, _ = lm.forward(IDS[4:], precision="high")
    assert torch.equal(again, fresh)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys, lm.cache.layers))
    with pytest.raises(ValueError, match="cannot crop a cache of 6 positions to 7"):
        lm.crop(7)
    lm.reset()


def test_precision_bytes_and_bad_precision(lm, tiny_target):
    from draftkit.target.frozen import FrozenTarget

    wb = weight_bytes(lm.target.model, QuantConfig())
    assert lm.precision_bytes == wb and len(lm.precision_layers) == 8 * 7  # q k v o gate up down per layer
    with pytest.raises(ValueError, match="unknown precision 'mid'"):
        lm.forward([1], precision="mid")
    plain = TargetSession(FrozenTarget(tiny_target))
    assert plain.precision_bytes is None and plain.precision_layers == []
    with pytest.raises(ValueError, match="no precision switch"):
        plain.forward([1], precision="high")


def test_forward_runs_in_inference_mode_and_the_cache_still_rolls_back(lm_exact):
    """The model runs under ``torch.inference_mode`` (issue 35: no autograd bookkeeping per op): its cache holds
    inference tensors, the returned logits and aux are ordinary tensors (a caller may modify them in place or feed
    them to a module that requires grad), and a crop or a ``keep`` (the tree's compaction) made outside inference
    mode still leaves a cache whose next forward is that of a session that never ran the dropped position."""
    lm = lm_exact
    runs = {}
    for how in ("crop", "keep", "never"):
        lm.reset()
        logits, aux = lm.forward(IDS[:4], 1, precision="high")
        assert lm.cache.layers[0].keys.is_inference() and not (logits.is_inference() or aux.is_inference())
        assert not torch.is_inference_mode_enabled()  # left again on return
        if how == "never":
            lm.forward(IDS[4:5], precision="high")
        else:
            lm.forward(IDS[4:6], precision="high")
            lm.crop(5) if how == "crop" else lm.keep(torch.arange(5))
        assert lm.length == 5 and lm.cache.get_seq_length() == 5
        runs[how], _ = lm.forward(IDS[5:], precision="high")
    assert torch.equal(runs["crop"], runs["keep"])
    torch.testing.assert_close(runs["crop"], runs["never"], rtol=1e-5, atol=1e-5)
    runs["crop"][0, 0] = 1.0  # an ordinary tensor: in place is allowed outside inference mode
    assert runs["crop"][0, 0] == 1.0
    weight = torch.ones(aux.shape[-1], 2, dtype=aux.dtype, requires_grad=True)
    (aux @ weight).sum().backward()  # autograd may save it
    torch.testing.assert_close(weight.grad[:, 0], aux.sum(0))
    lm.reset()


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_leave_out_an_untied_input_embedding_only(tied):
    """Bytes read per forward: every parameter once; an untied input embedding is a row gather, left out; a tied
    one is the LM head, read in full (issue 56)."""
    from types import SimpleNamespace

    from transformers import LlamaForCausalLM

    from draftkit.testing import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tied))
    total = sum(p.numel() for p in model.parameters()) * 4  # float32, each shared tensor once
    session = TargetSession(SimpleNamespace(model=model))
    assert session.weight_bytes == total - (0 if tied else 320 * 64 * 4)


def test_padded_rows_are_dropped_from_the_cache(lm):
    """pad_rows {2: 4}: a 2-row forward runs 4 rows, returns 2 and keeps 2 in the cache; what follows equals an
    unpadded session's (issue 56)."""
    try:
        lm.reset()
        plain, _ = lm.forward(IDS[:2], precision="high")
        after_plain, _ = lm.forward(IDS[2:5], precision="high")
        lm.pad_rows = {2: 4}
        lm.reset()
        padded, _ = lm.forward(IDS[:2], precision="high")
        assert lm.length == 2 and padded.shape == plain.shape
        after_padded, _ = lm.forward(IDS[2:5], precision="high")
        assert lm.length == 5
        torch.testing.assert_close(padded, plain)
        torch.testing.assert_close(after_padded, after_plain)
    finally:
        lm.pad_rows = {}


def test_a_tree_mask_keeps_the_sliding_window_exactly(tmp_path):
    """Gemma 3's sliding layers (window 8) under an explicit (T, length+T) mask: a causal mask given by hand
    gives the logits of the model's own causal forward, past the window (a row reading one position more or
    less than the window differs; issue 56)."""
    from draftkit.target.frozen import FrozenTarget, load_target
    from draftkit.testing import build_tiny_target

    model, _ = load_target(str(build_tiny_target(tmp_path / "gemma3", family="gemma3_text", seed=0)), "float32")
    session = TargetSession(FrozenTarget(model, [2, 4, 5]))
    ids = [5, 9, 3, 7, 11, 2, 8, 6, 4, 10, 12, 13, 14]
    session.forward(ids[:10])
    own, _ = session.forward(ids[10:])
    session.reset()
    session.forward(ids[:10])
    causal = torch.ones(3, 13, dtype=torch.bool)
    causal[:, 10:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    given, _ = session.forward(ids[10:], attn_mask=causal)
    torch.testing.assert_close(given, own)
