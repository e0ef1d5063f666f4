"""Decode-time attention of a Hugging Face target: transformers' ``sdpa`` with the query groups folded into rows
(:func:`draftkit.kernels.attention.grouped_query_attention`), registered in transformers' attention interface as
:data:`DECODE_ATTENTION`.

:func:`switch_attention` switches a model's ``sdpa`` attention to it and returns the switch as its own handle
(:class:`AttentionSwitch`, released to ``sdpa``); :func:`draftkit.kernels.linears.pack_linears` holds one for every
kernel option but ``stock``, on any device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from draftkit.kernels.attention import grouped_query_attention

__all__ = ["DECODE_ATTENTION", "FOLD_MAX_ROWS", "AttentionSwitch", "decode_attention", "register_decode_attention",
           "switch_attention"]

DECODE_ATTENTION = "draftkit_gqa"
"""The name :func:`decode_attention` is registered under in transformers' ``AttentionInterface`` (its masks are
``sdpa``'s)."""

FOLD_MAX_ROWS = 128
"""Forwards of more rows (a prefill with a padding mask) stay on transformers' ``sdpa``: folding repeats the
(B, 1, T, S) mask g times, which for long prompts costs more than ``repeat_kv``'s key/value copies (g*B*T*S mask
entries against 2*B*A*S*d key/value entries). Decoding's steps, verifies and trees are far below it."""

_UNFOLDED = ("softcap", "s_aux", "position_bias")
"""Attention kwargs that change the math (Gemma 2's logit soft-capping, GPT-OSS's sinks, T5-style biases):
:func:`decode_attention` leaves those calls to transformers' ``sdpa``."""


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers attention-interface function (registered as :data:`DECODE_ATTENTION`): SDPA with the query
    groups folded into rows (:func:`draftkit.kernels.attention.grouped_query_attention`) wherever a forward has a mask
    or one row and at most :data:`FOLD_MAX_ROWS` rows, i.e. every decode step, verify and tree verify;
    transformers' own ``integrations.sdpa_attention.sdpa_attention_forward`` otherwise (a prefill without a mask
    relies on its causal flag; a long masked prefill; no grouped-query heads; dropout; the kwargs in
    ``_UNFOLDED``).

    Args:
        module: the attention layer.
        query: (B, A, T, d); key: (B, A_kv, S, d); value: (B, A_kv, S, d_v).
        attention_mask: None or (B|1, 1, T, S) bool or additive, from transformers' ``sdpa_mask`` or the caller.
        dropout, scaling, is_causal: as transformers' ``sdpa_attention_forward``.

    Returns:
        ((B, T, A, d_v) attention output, None), as every transformers attention function.
    """
    t = query.shape[2]
    mask = attention_mask
    folded = (key.shape[1] < query.shape[1] and not dropout and (mask is not None or t == 1) and t <= FOLD_MAX_ROWS
              and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[-1] == key.shape[2]))
              and all(kwargs.get(name) is None for name in _UNFOLDED))
    if not folded:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return grouped_query_attention(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


@functools.cache
def register_decode_attention() -> None:
    """Register :func:`decode_attention` in transformers' attention and mask interfaces as :data:`DECODE_ATTENTION`
    (once per process), so that ``model.set_attn_implementation(DECODE_ATTENTION)`` selects it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


@dataclass
class AttentionSwitch:
    """A transformers model's ``sdpa`` attention switched to :data:`DECODE_ATTENTION` (a handle: use it as a context
    manager or call :meth:`release`); inactive (``model`` None) when the model's attention was left as it was.

    Attributes:
        model: the switched model, or None.
        previous: the attention it ran before (``sdpa``), restored by :meth:`release`.
    """

    model: nn.Module | None = field(default=None, repr=False)
    previous: str | None = None

    @property
    def active(self) -> bool:
        """Whether the model runs :data:`DECODE_ATTENTION` through this switch."""
        return self.model is not None

    def release(self) -> None:
        """Restore the model's attention (idempotent)."""
        if self.model is not None:
            self.model.set_attn_implementation(self.previous)
            self.model = None

    def __enter__(self) -> AttentionSwitch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def switch_attention(model: nn.Module) -> AttentionSwitch:
    """Switch a transformers ``model`` running ``sdpa`` to :data:`DECODE_ATTENTION` (registered first).

    Args:
        model: a transformers model, or any module (a draft head: left as it is).

    Returns:
        :class:`AttentionSwitch`: active when the model ran ``sdpa``; inactive for another attention (``eager``,
        ...) or a module without a transformers config.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return AttentionSwitch()
    register_decode_attention()
    model.set_attn_implementation(DECODE_ATTENTION)
    return AttentionSwitch(model, "sdpa")
