"""The frozen target wrapper captures exactly HF hidden_states[i]."""

import copy

import pytest
import torch

from draftkit.target.frozen import FrozenTarget


def test_captured_aux_states_equal_hf_hidden_states(tiny_target):
    target = FrozenTarget(tiny_target, [3, 1, 7])
    x = torch.randint(0, 320, (2, 9))
    out = target(x)
    ref = tiny_target(x, output_hidden_states=True)
    assert target.aux_layer_ids == [1, 3, 7]
    assert out.aux_hidden_states.shape == (2, 9, 3 * 64)
    assert torch.equal(out.aux_hidden_states, torch.cat([ref.hidden_states[i] for i in (1, 3, 7)], -1))
    assert torch.equal(out.last_hidden_state, ref.hidden_states[8])
    assert torch.equal(out.logits, ref.logits)
    assert not any(p.requires_grad for p in target.parameters())


def test_default_ids_and_bad_ids(tiny_target):
    assert FrozenTarget(tiny_target).aux_layer_ids == [2, 4, 5]
    with pytest.raises(ValueError, match="out of range"):
        FrozenTarget(tiny_target, [2, 8])


def test_cached_target_forward_equals_full(tiny_target):
    target = FrozenTarget(tiny_target)
    x = torch.randint(0, 320, (1, 10))
    full = target(x)
    first = target(x[:, :6], use_cache=True)
    rest = target(x[:, 6:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(rest.logits, full.logits[:, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest.aux_hidden_states, full.aux_hidden_states[:, 6:], rtol=1e-5, atol=1e-5)


def test_head_init_from_target_reproduces_target_logits_on_draft_vocab(tiny_target, tiny_target_dir, tmp_path):
    """After init_from_target, head.logits(x) == target LM head(final norm(x)) at the draft vocab's target ids,
    from the online target and from the offline (safetensors-only) loader alike."""
    from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
    from draftkit.target.frozen import FrozenTarget
    from draftkit.target.lm_head import load_target_lm_head
    from draftkit.selection.vocab import VocabMap

    model = copy.deepcopy(tiny_target)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.linspace(0.5, 2.0, 64))  # not ones: the copy must be visible
    model.save_pretrained(tmp_path / "t")
    ids = torch.tensor([1, 3, 4, 8, 40, 319])
    vocab = VocabMap.from_ids(ids, 320)
    x = torch.randn(2, 5, 64)
    expected = model.lm_head(model.model.norm(x))[..., ids]  # (2, 5, 6)
    for target in (FrozenTarget(model), load_target_lm_head(str(tmp_path / "t"), "float32")):
        cfg = Eagle3Config.from_target_config(target.config, target.aux_layer_ids, len(ids))
        head = Eagle3LlamaHead(cfg)
        head.set_vocab(vocab.d2t, vocab.t2d)
        head.init_from_target(target.lm_head_weight(), target.final_norm_weight())
        torch.testing.assert_close(head.logits(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match the head"):
        head.init_from_target(torch.zeros(320, 32))


@pytest.mark.parametrize("family", ["gemma3_text", "gemma2"])
def test_init_from_target_copies_the_norm_scale_gemma_stores_as_one_plus_weight(family, tmp_path):
    """Gemma's RMSNorm multiplies by 1 + w (weights stored around 0), the head's (Llama's) by w: the head must
    start from 1 + w, online and offline, so that its logits equal the target's LM head on its final norm."""
    from transformers import AutoModelForCausalLM

    from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
    from draftkit.selection.vocab import VocabMap
    from draftkit.target.frozen import rms_norm_scale
    from draftkit.target.lm_head import load_target_lm_head
    from draftkit.testing import build_tiny_target

    path = build_tiny_target(tmp_path / family, family=family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    w = torch.linspace(-0.5, 1.0, 64)
    with torch.no_grad():
        model.model.norm.weight.copy_(w)
    model.save_pretrained(path)
    torch.testing.assert_close(rms_norm_scale(model.model.norm), 1.0 + w, rtol=0, atol=1e-6)
    ids = torch.tensor([1, 3, 4, 8, 40, 319])
    vocab = VocabMap.from_ids(ids, 320)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        expected = model.lm_head(model.model.norm(x))[..., ids]  # (2, 5, 6), before any soft-cap
    for target in (FrozenTarget(model), load_target_lm_head(str(path), "float32")):
        torch.testing.assert_close(target.final_norm_weight(), 1.0 + w, rtol=0, atol=1e-6)
        cfg = Eagle3Config.from_target_config(target.config, target.aux_layer_ids, len(ids))
        head = Eagle3LlamaHead(cfg)
        head.set_vocab(vocab.d2t, vocab.t2d)
        head.init_from_target(target.lm_head_weight(), target.final_norm_weight())
        torch.testing.assert_close(head.logits(x), expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_scale_of_a_llama_norm_is_its_weight(tiny_target):
    from draftkit.target.frozen import rms_norm_scale

    norm = copy.deepcopy(tiny_target.model.norm)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 64))
    torch.testing.assert_close(rms_norm_scale(norm), torch.linspace(0.5, 2.0, 64), rtol=0, atol=1e-6)
