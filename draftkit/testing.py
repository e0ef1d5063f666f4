"""Tiny offline targets for recipes and tests: a seeded random Llama with a byte-level tokenizer.

``tiny:llama`` in a recipe's ``model.target`` builds (once, into the draftkit cache) a Llama with
vocab 320, hidden 64, 8 layers (default aux ids [2, 4, 5]), 4 heads, 2 KV heads, and a byte-level BPE
tokenizer with a ChatML template; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from draftkit.jsonio import atomic_path

__all__ = ["TINY_LLAMA", "build_tiny_target", "tiny_llama_config"]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_LLAMA = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False,
)


def tiny_llama_config(**overrides):
    """``LlamaConfig`` of the tiny target."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<pad>"})
    fast.chat_template = CHATML
    return fast


def build_tiny_target(dest: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a seeded tiny ``LlamaForCausalLM`` and its tokenizer to ``dest`` (atomic); return the path."""
    import torch
    from transformers import LlamaForCausalLM

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    with atomic_path(dest, directory=True) as tmp:
        with torch.random.fork_rng():  # leave the caller's random state alone
            torch.manual_seed(seed)
            model = LlamaForCausalLM(tiny_llama_config(**overrides))
        model.save_pretrained(tmp)
        _byte_tokenizer().save_pretrained(tmp)
    return dest
