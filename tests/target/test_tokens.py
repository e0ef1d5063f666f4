"""Tokenizer facts: the one EOS rule, pad id, skipped ids, chat-prompt encoding and the one stored tokenizer identity."""

from __future__ import annotations

import copy
from types import SimpleNamespace

from transformers import GenerationConfig

from draftkit.target.tokens import (
    encode_chat,
    ids_to_skip,
    pad_token_id,
    stop_token_ids,
    tokenizer_identity,
)


def test_stop_ids_join_tokenizer_and_generation_config():
    tok = SimpleNamespace(eos_token_id=257)
    assert stop_token_ids(tok) == [257]
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[259, 257])) == [257, 259]
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=12)) == [12, 257]
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), GenerationConfig(eos_token_id=5)) == [5]
    assert stop_token_ids(None, None) == []


def test_pad_and_skipped_ids():
    assert pad_token_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0
    assert ids_to_skip(SimpleNamespace(bos_token_id=1, eos_token_id=2)) == [1]
    assert ids_to_skip(SimpleNamespace(bos_token_id=2, eos_token_id=2)) == []
    assert ids_to_skip(SimpleNamespace(bos_token_id=None, eos_token_id=2)) == [] and ids_to_skip(None) == []


def test_encode_chat_renders_generation_prompt_without_extra_specials(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi there"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = encode_chat(tiny_tokenizer, messages)
    assert ids == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text and text.endswith("assistant\n")


def test_tokenizer_identity_keeps_its_value_and_sees_what_changes_ids(tiny_tokenizer):
    """The value is stored in checkpoints, export sidecars, hidden-state cache keys and generate headers: the tiny
    tokenizer's is pinned. It follows the chat template, and a normaliser that changes which ids a text becomes
    changes it even though the id -> token table is the same."""
    from tokenizers import normalizers

    assert tokenizer_identity(tiny_tokenizer) == "93952bfd912bb840"
    assert tokenizer_identity(tiny_tokenizer, "{{x}}") == "4993a301a0be11ae"
    lower = copy.deepcopy(tiny_tokenizer)
    lower.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert lower.convert_ids_to_tokens(list(range(len(lower)))) == tiny_tokenizer.convert_ids_to_tokens(
        list(range(len(tiny_tokenizer))))
    assert lower("Hi")["input_ids"] != tiny_tokenizer("Hi")["input_ids"]
    assert tokenizer_identity(lower) != tokenizer_identity(tiny_tokenizer)
