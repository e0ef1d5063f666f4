"""The frozen target: loading (``frozen``), the one layer hook, the one KV-cache session every decoding loop runs
on, with dual precision's optional precision switch (``session.TargetSession``), the offline LM head
(``lm_head``) and the tokenizer facts every verb shares (``tokens``). Layer ids are HF ``hidden_states`` indices."""

from draftkit.target.frozen import FrozenTarget, TargetOutput, capture_hidden_states, load_target
from draftkit.target.lm_head import TargetLMHead, load_target_lm_head
from draftkit.target.tokens import encode_chat, ids_to_skip, pad_token_id, stop_token_ids

__all__ = [
    "FrozenTarget",
    "TargetLMHead",
    "TargetOutput",
    "capture_hidden_states",
    "encode_chat",
    "ids_to_skip",
    "load_target",
    "load_target_lm_head",
    "pad_token_id",
    "stop_token_ids",
]
