"""Tokenizer facts every verb needs: stop ids, pad id, ids whose rows are skipped, chat-prompt encoding.

One rule each, so that ``evaluate``, the dual-precision evaluator, the layer analysis and the data module
agree: a target whose end-of-turn token is named only in its ``generation_config.json`` stops at that token
in every verb.

Shapes: T tokens.
"""

from __future__ import annotations

__all__ = [
    "encode_chat", "ids_to_skip", "pad_token_id", "stop_token_ids", "tokenizer_identity",
]


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids that end generation: the tokenizer's EOS and every EOS of the generation config, sorted.

    Chat models often name their end-of-turn token (e.g. ``<|im_end|>``, ``<|eot_id|>``) only in
    ``generation_config.json``; Hugging Face ``generate`` stops on those too, so every draftkit decoder does.

    Args:
        tokenizer: a Hugging Face tokenizer, or None.
        generation_config: the target's ``GenerationConfig`` (``model.generation_config``), or None.

    Returns:
        Sorted, distinct token ids (may be empty).
    """
    return sorted(_ids(getattr(tokenizer, "eos_token_id", None)) | _ids(getattr(generation_config, "eos_token_id", None)))


def pad_token_id(tokenizer) -> int:
    """The id right-padding uses: the tokenizer's pad id, else its EOS id, else 0 (masked out either way)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if eos is not None else 0


def tokenizer_identity(tokenizer, chat_template: str | None = None) -> str:
    """The one fingerprint (16 hex digits) of a tokenizer: everything that decides which ids a text becomes
    and what an id means. It hashes the tokenizer's whole serialisation (fast tokenizers: vocabulary, merges,
    normaliser, pre-tokenizer and added tokens with their ids, ``backend_tokenizer.to_str()``; others: the
    id -> token table), its length, the special tokens with their ids, and the chat template
    (``chat_template`` when given, else the tokenizer's own). Two tokenizers of equal size whose ids are
    permuted, or whose merges differ, differ here.

    Stored in training checkpoints and export sidecars (``tokenizer_fingerprint``, compared with the target's
    tokenizer on load by ``draftkit.heads.checkpoint.check_tokenizer``), in hidden-state cache keys
    (``draftkit.data.datamodule.DataModule.cache_fingerprint``) and in ``draftkit generate`` headers
    (``target_fingerprint.tokenizer``).
    """
    import json

    from draftkit.jsonio import short_hash

    backend = getattr(tokenizer, "backend_tokenizer", None)
    serial = backend.to_str() if backend is not None else tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in tokenizer.all_special_tokens}
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    blob = json.dumps([serial, len(tokenizer), sorted(special.items()), template], sort_keys=True, default=str)
    return short_hash(blob.encode("utf-8", "surrogatepass"))


def ids_to_skip(tokenizer) -> list[int]:
    """Token ids whose rows the layer analysis drops: BOS (an attention sink), unless BOS is also EOS."""
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    return [int(bos)] if bos is not None and bos != getattr(tokenizer, "eos_token_id", None) else []


def encode_chat(tokenizer, messages: list[dict], chat_template: str | None = None) -> list[int]:
    """Token ids of a chat prompt, ready for generation: the template rendered with
    ``add_generation_prompt=True``, then tokenized without extra special tokens (exactly as the training
    data is tokenized, ``draftkit.data.chat.tokenize_conversation``).

    Args:
        tokenizer: the target's Hugging Face tokenizer.
        messages: ``[{"role", "content"}]`` ending with a user turn.
        chat_template: a Jinja template, or None for the tokenizer's own.

    Returns:
        T token ids.
    """
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=chat_template
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]
