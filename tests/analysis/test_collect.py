"""Streaming collection over a tiny random Llama: alignment, streaming = one shot, filters, bad input."""

import pytest
import torch

from draftkit.analysis.cka import linear_cka
from draftkit.analysis.collect import (
    LayerAnalysisConfig,
    LayerStatsCollector,
    collect_layer_statistics,
)
from draftkit.analysis.entropy import centered_second_moment, entropy_h1, entropy_h2
from draftkit.analysis.token_entropy import token_entropy
from draftkit.target.frozen import capture_hidden_states

N_LAYERS, D = 8, 64


def _batches(num=6, b=2, t=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(0, 256, (b, t), generator=g)
        attn = torch.ones(b, t, dtype=torch.long)
        attn[1, t - 7:] = 0  # right padding on the second row
        loss = torch.zeros(b, t, dtype=torch.long)
        loss[:, 10:25] = 1
        loss[:, 30:] = 1
        out.append({"input_ids": ids, "attention_mask": attn, "loss_mask": loss * attn})
    return out


def _cfg(**kw):
    base = dict(num_tokens=10_000, min_tokens=8, cka="exact", sink_factor=None, warmup_rows=64, rerank_rows=64)
    base.update(kw)
    return LayerAnalysisConfig(**base)


def test_rows_keys_and_states_are_aligned(tiny_llama, monkeypatch):
    """Row p (m_{p+2} = 1, p >= 1) carries hidden_states[k][p] for every k and the key H(z_{p+1})."""
    model, _ = tiny_llama
    seen = []
    orig = LayerStatsCollector.add

    def spy(self, states, keys=None):
        seen.append((states.clone(), None if keys is None else keys.clone()))
        return orig(self, states, keys)

    monkeypatch.setattr(LayerStatsCollector, "add", spy)
    batches = _batches(num=1)
    collect_layer_statistics(model, batches, _cfg(entropy_threshold=0.0, min_tokens=1), exclude_token_ids=[256])
    (states, keys), = seen
    batch = batches[0]
    with torch.no_grad():
        out = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True)
    m = batch["loss_mask"].bool()
    expect = [(b, p) for b in range(2) for p in range(1, 38) if m[b, p + 2]]
    assert states.shape == (N_LAYERS - 1, len(expect), D)
    for j, (b, p) in enumerate(expect):
        for k in range(1, N_LAYERS):
            assert torch.allclose(states[k - 1, j], out.hidden_states[k][b, p], atol=1e-6)
        assert float(keys[j]) == pytest.approx(float(token_entropy(out.logits[b, p + 1])), abs=1e-5)


def test_rows_mask_mode_and_bos_exclusion(tiny_llama, monkeypatch):
    model, _ = tiny_llama
    seen = []
    orig = LayerStatsCollector.add
    monkeypatch.setattr(LayerStatsCollector, "add", lambda self, s, k=None: (seen.append(s.shape[1]), orig(self, s, k))[1])
    batch = _batches(num=1)[0]
    batch["input_ids"][0, 12] = 256  # a BOS id inside the assistant span
    collect_layer_statistics(model, [batch], _cfg(rows="mask", min_tokens=1), exclude_token_ids=[256])
    m = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    expected = sum(1 for b in range(2) for p in range(1, 39) if m[b, p] and batch["attention_mask"][b, p + 1]) - 1
    assert seen == [expected]


def test_streaming_equals_one_shot(tiny_llama):
    model, _ = tiny_llama
    batches = _batches()
    stream = collect_layer_statistics(model, batches, _cfg())
    # one shot: every row of every batch at once, through the plain reference estimators
    rows = []
    with torch.no_grad(), capture_hidden_states(model, list(range(1, N_LAYERS))) as cap:
        for batch in batches:
            model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            sel = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
            sel[:, :-2] = batch["loss_mask"][:, 2:].bool()
            sel[:, :1] = False
            bi, ti = torch.nonzero(sel, as_tuple=True)
            rows.append(torch.stack([cap[k][bi, ti] for k in range(1, N_LAYERS)]))
    z = torch.cat(rows, 1).double()  # (P, n, d)
    z = z / z.norm(dim=-1, keepdim=True)
    assert stream.num_rows == z.shape[1]
    covs = torch.stack([centered_second_moment(zl) for zl in z])
    assert torch.allclose(stream.h1, entropy_h1(covs), atol=1e-6)
    assert torch.allclose(stream.h2, entropy_h2(covs), atol=1e-6)
    ref_cka = torch.tensor([[float(linear_cka(a, b)) for b in z] for a in z], dtype=torch.float64)
    assert torch.allclose(stream.cka, ref_cka, atol=1e-6)
    # the same rows in other batch shapes give the same statistics
    merged = [{k: torch.cat([batches[i][k], batches[i + 1][k]]) for k in batches[0]} for i in range(0, 6, 2)]
    again = collect_layer_statistics(model, merged, _cfg())
    assert torch.allclose(again.h1, stream.h1, atol=1e-6) and torch.allclose(again.cka, stream.cka, atol=1e-6)


def test_collector_chunks_equal_one_add():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 500, 16, generator=g) @ torch.randn(16, 16, generator=g)
    cfg = LayerAnalysisConfig(min_tokens=8, cka="exact", sink_factor=None)
    one = LayerStatsCollector(4, 16, cfg)
    one.add(z)
    many = LayerStatsCollector(4, 16, cfg)
    for chunk in z.split(37, dim=1):
        many.add(chunk)
    a, b = one.finalize(), many.finalize()
    assert torch.allclose(a.h1, b.h1, atol=1e-9) and torch.allclose(a.cka, b.cka, atol=1e-9)
    mb_cfg = LayerAnalysisConfig(min_tokens=8, cka="minibatch", sink_factor=None, cka_batch_size=64, rerank_rows=100)
    mb = LayerStatsCollector(4, 16, mb_cfg)
    for chunk in z.split(37, dim=1):
        mb.add(chunk)
    c = mb.finalize()
    assert torch.allclose(c.h1, a.h1, atol=1e-9)  # entropies do not depend on the CKA method
    assert float((c.cka - a.cka).abs().max()) < 0.05
    assert c.reservoir.shape == (3, 100, 16)
    zn = z / z.norm(dim=-1, keepdim=True)
    for j in range(100):  # every reservoir row is a row of the stream
        assert bool((zn[0] - c.reservoir[0, j]).abs().amax(1).min() < 1e-6)


def test_sink_and_entropy_filters_count_rows():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 400, 8, generator=g)
    z[1, 7, 3] = 1e5  # a massive activation at layer id 2
    keys = torch.arange(400, dtype=torch.float32)
    cfg = LayerAnalysisConfig(min_tokens=8, cka="exact", sink_factor=100.0, warmup_rows=200, entropy_quantile=0.75,
                              entropy_sweep=[0.5])
    col = LayerStatsCollector(3, 8, cfg)
    for s in range(0, 400, 100):
        col.add(z[:, s:s + 100], keys[s:s + 100])
    stats = col.finalize()
    assert stats.counts["sink"] == 1
    # threshold: the 0.75 quantile of the 200 warm-up keys (0..199, row 7 included) = 149.25
    assert stats.entropy["threshold_nats"] == pytest.approx(149.25)
    assert stats.counts["low_entropy"] == 149  # keys 0..149 minus the sink row 7
    assert stats.num_rows == 400 - 1 - 149
    (half,) = stats.sweep
    assert half.entropy["threshold_nats"] == pytest.approx(99.5) and half.num_rows == 400 - 1 - 99


def test_too_few_rows_names_the_threshold(tiny_llama):
    model, _ = tiny_llama
    with pytest.raises(ValueError, match=r"only 0 rows are left after filtering.*lower entropy_threshold \(now 100.0"):
        collect_layer_statistics(model, _batches(num=2), _cfg(entropy_threshold=100.0))
    # the data ran out before num_tokens: "raise num_tokens" could not help (select-layers on one conversation)
    with pytest.raises(ValueError, match=r"fewer than min_tokens=100000; give more data \(all \d+ candidate rows of "
                                         r"it were read\) or lower min_tokens \(a smaller sample"):
        collect_layer_statistics(model, _batches(num=2), _cfg(min_tokens=100_000))
    with pytest.raises(ValueError, match=r"fewer than min_tokens=100000; raise num_tokens \(now 10\)$"):
        collect_layer_statistics(model, _batches(num=2), _cfg(min_tokens=100_000, num_tokens=10))


def test_nan_states_name_the_layer(tiny_llama):
    model, _ = tiny_llama
    handle = model.model.layers[3].register_forward_hook(lambda m, i, o: (o[0] * float("nan"),) + tuple(o[1:])
                                                         if isinstance(o, tuple) else o * float("nan"))
    try:
        with pytest.raises(ValueError, match=r"NaN or inf at layer ids \[4, 5, 6, 7\]"):
            collect_layer_statistics(model, _batches(num=1), _cfg())
    finally:
        handle.remove()


def test_hooks_are_removed_and_batches_checked(tiny_llama):
    model, _ = tiny_llama

    def hooks():  # transformers may keep its own output-capturing hooks; ours must all go
        return [dict(layer._forward_hooks) for layer in model.model.layers]

    before = hooks()
    collect_layer_statistics(model, _batches(num=1), _cfg(min_tokens=1))
    assert hooks() == before
    with pytest.raises(ValueError, match="missing \\['loss_mask'\\]"):
        collect_layer_statistics(model, [{"input_ids": torch.zeros(1, 4, dtype=torch.long),
                                          "attention_mask": torch.ones(1, 4)}], _cfg())
    assert hooks() == before


def test_budget_stops_at_num_tokens(tiny_llama):
    model, _ = tiny_llama
    stats = collect_layer_statistics(model, _batches(), _cfg(num_tokens=50, min_tokens=1))
    assert stats.counts["candidates"] == 50 and stats.num_rows == 50


@pytest.mark.parametrize("kw,match", [
    (dict(entropy_quantile=0.5, entropy_threshold=1.0), "at most one"),
    (dict(cka_batch_size=2), ">= 4"),
    (dict(cka="fast"), "cka must be"),
    (dict(k=0), "k must be"),
    (dict(entropy_sweep=[1.5]), "entropy_sweep"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        LayerAnalysisConfig(**kw)


def test_minibatch_cka_uses_the_levels_reservoir_rows():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 400, 8, generator=g)
    keys = torch.arange(400, dtype=torch.float32)
    cfg = LayerAnalysisConfig(min_tokens=8, cka="minibatch", cka_batch_size=32, sink_factor=None, warmup_rows=100,
                              entropy_quantile=0.5, entropy_sweep=[0.75], cka_rows=1000)
    col = LayerStatsCollector(3, 8, cfg)
    for s in range(0, 400, 50):
        col.add(z[:, s:s + 50], keys[s:s + 50])
    stats = col.finalize()
    # the warm-up keys are 0..99: thresholds 49.5 and 74.25
    assert stats.num_rows == 350 and stats.cka_rows == 350 and stats.cka_batches == 11  # 10 full + one of 30
    assert stats.sweep[0].num_rows == stats.sweep[0].cka_rows == 325


def test_reservoir_is_uniform_over_the_stream():
    from draftkit.analysis.collect import _Reservoir

    res = _Reservoir(1000, torch.Generator().manual_seed(0))
    idx = torch.arange(20_000, dtype=torch.float32)
    for chunk in idx.split(700):
        res.add(chunk.view(1, -1, 1).expand(2, -1, 1).contiguous(), chunk)
    picked = res.rows[0, :, 0]
    assert res.seen == 20_000 and picked.numel() == 1000 and picked.unique().numel() == 1000
    assert torch.equal(res.keys, picked)
    # mean of 1000 uniform draws from 0..19999: 9999.5 +- 183 (one standard error)
    assert abs(float(picked.mean()) - 9999.5) < 4 * 183
    assert 0.4 < float((picked < 10_000).float().mean()) < 0.6
