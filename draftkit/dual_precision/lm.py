"""The two-precision target: one model whose quantized linears run their int8 codes or their 4-bit slice.

Definitions: shared/reference/dual-precision.md §1-2. Nothing is reloaded between precisions: a forward flips
``precision`` on every ``NestedInt8Linear`` (``draftkit.quant``) and runs.

Shapes: T tokens, V target vocab.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import nn

from draftkit.quant import QuantConfig, WeightBytes, nested_linears, quantize_model, set_precision, weight_bytes
from draftkit.target.frozen import cache_kwarg

__all__ = ["DualLM", "DualPrecisionLM"]


class DualLM(Protocol):
    """What the decoding loops need; :class:`DualPrecisionLM` for HF targets, stubs in tests."""

    bytes: WeightBytes

    def new_cache(self): ...

    def forward(self, input_ids: Sequence[int], cache, precision: str, logits_to_keep: int = 1) -> torch.Tensor: ...

    def rollback(self, cache, num_tokens: int): ...


class DualPrecisionLM:
    """A Hugging Face causal LM (Llama-style, DynamicCache) with nested int8/int4 linears.

    Args:
        model: e.g. ``LlamaForCausalLM``; quantized IN PLACE unless it already holds ``NestedInt8Linear``
            (pass ``copy.deepcopy(model)`` when the float model is still needed, e.g. from a callback).
        quant_config: module selection and scheme (default: decoder linears, 16-bit LM head, mid-point).

    Raises:
        ValueError: if the target has no quantizable linears.
    """

    def __init__(self, model: nn.Module, quant_config: QuantConfig | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.quant_config = quant_config or QuantConfig()
        self.layers = nested_linears(model) or list(quantize_model(model, self.quant_config).values())
        self.bytes = weight_bytes(model, self.quant_config)
        self._cache_kw = cache_kwarg(model.forward)
        self._device = model.get_input_embeddings().weight.device

    def new_cache(self):
        """An empty ``DynamicCache`` for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int], cache, precision: str, logits_to_keep: int = 1) -> torch.Tensor:
        """Run ``input_ids`` after the tokens in ``cache`` (appending their K/V) at one precision.

        Args:
            input_ids: T token ids.
            cache: a ``DynamicCache`` (extended in place), or None for a cache-free forward.
            precision: ``high`` (int8 codes) or ``low`` (4-bit slice).
            logits_to_keep: last positions whose logits are returned.

        Returns:
            (logits_to_keep, V) float32 logits.
        """
        set_precision(self.layers, precision)
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self._device)[None]  # (1, T)
        out = self.model(
            input_ids=ids, use_cache=cache is not None, logits_to_keep=logits_to_keep, **{self._cache_kw: cache}
        )
        return out.logits[0].float()  # (logits_to_keep, V)

    @staticmethod
    def rollback(cache, num_tokens: int):
        """Drop the last ``num_tokens`` positions of ``cache`` (``DynamicCache.crop(-n)``); returns the cache."""
        if num_tokens > 0:
            cache.crop(-num_tokens)
        return cache
