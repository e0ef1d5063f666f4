"""Final-logit soft-capping (Gemma 2/3/4 ``final_logit_softcapping``): every path where draftkit applies the
target's LM head itself (FrozenTarget, the KV-cache session, the offline TargetLMHead, the training teacher, the
layer analysis' entropy keys) gives the logits of the model's own forward, ``tanh(z / c) * c``."""

import pytest
import torch

from draftkit.target.frozen import FrozenTarget, load_target, logit_softcap, target_logits
from draftkit.testing import build_tiny_target, tiny_family_config

CAP = 5.0  # small, and weights drawn wider (std 0.2): the tiny target's raw |z| reach ~5.6, the cap moves them ~1.6


@pytest.fixture(scope="module")
def capped_dir(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("softcap") / "gemma3", family="gemma3_text",
                             final_logit_softcapping=CAP, initializer_range=0.2)


@pytest.fixture(scope="module")
def capped(capped_dir):
    model, tok = load_target(str(capped_dir), "float32")
    ids = torch.tensor([tok("the cap bends large logits toward plus or minus five")["input_ids"]])  # (1, T)
    with torch.no_grad():
        reference = model(ids).logits  # (1, T, V), transformers' own soft-capped logits
        uncapped = model.lm_head(model.model(ids).last_hidden_state)  # (1, T, V)
    return model, ids, reference, uncapped


def test_the_cap_is_read_where_the_config_sets_it(capped):
    model, _, reference, uncapped = capped
    assert logit_softcap(model.config) == CAP
    assert logit_softcap(tiny_family_config("llama")) is None  # no such field
    assert logit_softcap(tiny_family_config("gemma3_text")) is None  # Gemma 3 text: None by default
    assert (reference - uncapped).abs().max() > 0.5  # the test target's cap matters
    torch.testing.assert_close(reference, torch.tanh(uncapped / CAP) * CAP, rtol=0, atol=1e-6)


def test_target_logits_of_a_weight_and_of_a_module_agree(capped):
    model, ids, reference, _ = capped
    last = model.model(ids).last_hidden_state
    torch.testing.assert_close(target_logits(model.lm_head, last, model.config), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(target_logits(model.lm_head.weight, last, model.config), reference, rtol=0, atol=1e-6)
    cfg = tiny_family_config("llama")  # no cap: the plain projection
    torch.testing.assert_close(target_logits(model.lm_head, last, cfg), model.lm_head(last), rtol=0, atol=0)


def test_frozen_target_logits_equal_the_model_forward(capped):
    model, ids, reference, uncapped = capped
    out = FrozenTarget(model)(ids)
    torch.testing.assert_close(out.logits, reference, rtol=0, atol=1e-6)
    assert (out.logits - uncapped).abs().max() > 0.5
    torch.testing.assert_close(FrozenTarget(model).lm_logits(out.last_hidden_state), reference, rtol=0, atol=1e-6)


def test_session_logits_equal_the_model_forward(capped):
    """Both session paths: the full forward's logits and the LM head over the kept rows (``logits_to_keep``)."""
    from draftkit.target.session import TargetSession

    model, ids, reference, _ = capped
    every, _ = TargetSession(FrozenTarget(model)).forward(ids[0])  # (T, V) float32
    torch.testing.assert_close(every, reference[0], rtol=0, atol=1e-6)
    last, _ = TargetSession(FrozenTarget(model)).forward(ids[0], logits_to_keep=1)  # (1, V)
    torch.testing.assert_close(last, reference[0, -1:], rtol=0, atol=1e-6)


def test_offline_lm_head_logits_equal_the_model_forward(capped, capped_dir):
    """The offline teacher (LM head read from safetensors, hidden states from a cache) caps as the model does."""
    from draftkit.target.lm_head import load_target_lm_head

    model, ids, reference, uncapped = capped
    head = load_target_lm_head(str(capped_dir), "float32")
    z = head.logits(model.model(ids).last_hidden_state)
    torch.testing.assert_close(z, reference, rtol=0, atol=1e-6)
    assert (z - uncapped).abs().max() > 0.5


def test_training_teacher_logits_equal_the_model_forward(capped, capped_dir, tiny_chat_jsonl):
    """``Eagle3Module._teacher``'s LM head (online) is the soft-capped one: the labels and P come from it."""
    from draftkit.data.datamodule import ChatDataModule
    from draftkit.models.eagle3 import Eagle3Module

    model, *_ = capped
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(capped_dir), max_length=32, val_size=2, batch_size=2)
    dm.setup("fit")
    module = Eagle3Module(str(capped_dir), target_dtype="float32", draft_vocab_size=200)
    module.build(dm)
    batch = next(iter(dm.train_dataloader()))
    _, last, lm_head = module._teacher(batch)
    with torch.no_grad():
        reference = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        uncapped = model.lm_head(last)
    torch.testing.assert_close(lm_head(last), reference, rtol=0, atol=1e-6)
    assert (lm_head(last) - uncapped).abs().max() > 0.5


def test_layer_analysis_entropy_keys_read_capped_logits(capped, monkeypatch):
    """The analysis' entropy key of row p is H(z_{p+1}) of the model's own (capped) logits."""
    from draftkit.analysis import collect
    from draftkit.analysis.token_entropy import token_entropy

    model, ids, reference, uncapped = capped
    seen = []
    orig = collect.LayerStatsCollector.add
    monkeypatch.setattr(collect.LayerStatsCollector, "add",
                        lambda self, s, k=None: (seen.append(k.clone()), orig(self, s, k))[1])
    t = ids.shape[1]
    loss = torch.zeros(1, t, dtype=torch.long)
    loss[:, 4:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss}
    cfg = collect.LayerAnalysisConfig(num_tokens=10_000, min_tokens=1, cka="exact", sink_factor=None,
                                      warmup_rows=64, rerank_rows=64, entropy_threshold=0.0)
    collect.collect_layer_statistics(model, [batch], cfg, exclude_token_ids=[])
    (keys,) = seen
    rows = [p for p in range(1, t - 2) if loss[0, p + 2]]  # row p (m_{p+2} = 1, p >= 1) keys H(z_{p+1})
    expected = torch.stack([token_entropy(reference[0, p + 1]) for p in rows])
    torch.testing.assert_close(keys, expected, rtol=0, atol=1e-5)
    wrong = torch.stack([token_entropy(uncapped[0, p + 1]) for p in rows])
    assert (keys - wrong).abs().max() > 1e-2


def test_gemma2_default_cap_reaches_frozen_target_logits(tmp_path):
    """A tiny Gemma 2 keeps its config's default cap (30.0); FrozenTarget's logits equal its forward's."""
    path = build_tiny_target(tmp_path / "gemma2", family="gemma2", initializer_range=1.0)
    model, _ = load_target(str(path), "float32")
    assert logit_softcap(model.config) == 30.0
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        reference = model(ids).logits
        uncapped = model.lm_head(model.model(ids).last_hidden_state)
    torch.testing.assert_close(FrozenTarget(model)(ids).logits, reference, rtol=0, atol=1e-5)
    assert (reference - uncapped).abs().max() > 1.0
