"""One decoding stream of the frozen target over a Hugging Face KV cache: prefill, extend, roll back, compact,
and optionally a precision switch per forward.

Used by every loop that decodes with the target: ``draftkit.decoding`` (plain, chain and tree speculative
decoding, the cost model) and ``draftkit.dual_precision`` (single-precision, gated and verified decoding,
teacher forcing), whose target holds nested int8 linears (``draftkit.quant``) and runs each forward on the
int8 codes (``high``) or their 4-bit slice (``low``), nothing reloaded (dual-precision.md §1-2).

Shapes: T new tokens, V target vocab, H_t target hidden, A number of aux layers. Batch size is 1
(single-stream latency).
"""

from __future__ import annotations

from typing import Sequence

import torch

from draftkit.quant import QuantConfig, WeightBytes, nested_linears, quantize_model, set_precision, weight_bytes
from draftkit.quant.bytes import param_bytes

__all__ = ["TargetSession"]


class TargetSession:
    """One decoding stream of a ``FrozenTarget`` over a Hugging Face KV cache.

    Args:
        target: a ``draftkit.target.frozen.FrozenTarget``.
        quant_config: give one for a precision switch: the target's linears it selects become
            ``NestedInt8Linear`` IN PLACE (unless the model already holds some; pass a ``copy.deepcopy`` of the
            model when the float one is still needed) and :meth:`forward` takes ``precision``. None = a plain
            session.

    Attributes:
        cache: the transformers ``DynamicCache`` (None before the first forward); ``length`` its positions.
        weight_bytes: bytes of the weights one forward reads as stored (``quant.bytes.param_bytes``, an untied
            input embedding left out: it is a row gather), decoding's bytes-read figures.
        precision_layers: the ``NestedInt8Linear`` the precision switch flips (empty without one).
        precision_bytes: ``quant.weight_bytes`` of the quantized target, the bytes of one forward at each
            precision (``WeightBytes``), or None without a precision switch.

    Raises:
        ValueError: if ``quant_config`` selects no linear of the target.
    """

    def __init__(self, target, quant_config: QuantConfig | None = None) -> None:
        self.target = target
        self.cache = None
        self.length = 0
        # {n: m}: a forward over n new rows runs m > n rows (dummy rows after the real ones, dropped again);
        # set from ``decoding.cost.CostTable.padding`` where a kernel makes m rows cheaper than n
        self.pad_rows: dict[int, int] = {}
        model = target.model
        self.precision_layers = []
        self.precision_bytes: WeightBytes | None = None
        if quant_config is not None:
            self.precision_layers = nested_linears(model) or list(quantize_model(model, quant_config).values())
            self.precision_bytes = weight_bytes(model, quant_config)
        tied = model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
        embed = model.get_input_embeddings().weight
        self.device = embed.device
        # an untied input embedding is a row gather, not a weight read
        self.weight_bytes = param_bytes(model) - (0 if tied else embed.numel() * embed.element_size())

    @classmethod
    def with_precision_switch(cls, model, quant_config: QuantConfig | None = None) -> TargetSession:
        """The session of dual precision over a Hugging Face causal LM (Llama-style, ``model.model.layers``).

        Args:
            model: e.g. ``LlamaForCausalLM``, quantized IN PLACE as in the class (``quant_config`` default:
                decoder linears, 16-bit LM head, mid-point slice).

        Raises:
            ValueError: if the target has no quantizable linears, or fewer than 2 layers.
        """
        from draftkit.target.frozen import FrozenTarget

        # dual precision reads no aux states: capture the one cheapest layer the hook accepts
        return cls(FrozenTarget(model, aux_layer_ids=[1]), quant_config or QuantConfig())

    @property
    def max_length(self) -> int:
        """Context window in tokens (``max_position_embeddings``)."""
        return int(getattr(self.target.config, "max_position_embeddings", 1 << 30))

    def reset(self) -> None:
        """Start a new stream: an empty cache."""
        self.cache = None
        self.length = 0

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | Sequence[int],
        logits_to_keep: int = 0,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        precision: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the cache by T tokens.

        Args:
            input_ids: (T,) int64 tokens (a tensor or a list of ids), by default at positions
                length..length+T-1.
            logits_to_keep: 0 = the LM head over every row; n >= 1 = over the last n rows only (1 for a
                prefill; the rows before are never read), as ``logits_to_keep`` of transformers' causal LMs.
            position_ids: (T,) int64 RoPE positions (tree verification), or None for the default.
            attn_mask: (T, length+T) bool, True where a new row may attend (a tree mask over the cache),
                or None for causal attention.
            precision: ``high`` (int8 codes) or ``low`` (4-bit slice) for every layer of the precision switch
                from this forward on, or None to leave them as they are.

        Returns:
            logits (T, V) float32 (or (min(n, T), V) with ``logits_to_keep`` n) and aux (T, A*H_t) in the target
            dtype: ordinary tensors (copies; the model runs under ``torch.inference_mode``, as Hugging Face
            ``generate()`` does, and its cache holds inference tensors).

        Raises:
            ValueError: on a ``precision`` for a session without a precision switch, or an unknown one.

        With T in ``pad_rows`` (and ``logits_to_keep`` 0) the forward runs ``pad_rows[T] - T`` dummy rows after
        the real ones (the last token again, attending to the cache and itself; no real row attends to them) and
        crops them from the cache, so the result and the cache are those of the unpadded forward.
        """
        if precision is not None:
            if not self.precision_layers:
                raise ValueError(f"precision={precision!r}: this session has no precision switch "
                                 "(build it with a quant_config, TargetSession.with_precision_switch)")
            set_precision(self.precision_layers, precision)
        input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        T = input_ids.shape[0]
        pad = 0 if logits_to_keep else self.pad_rows.get(T, T) - T
        if pad > 0:
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad)])
            if position_ids is not None:
                position_ids = torch.cat([position_ids, position_ids[-1:].expand(pad)])
            if attn_mask is not None:
                full = attn_mask.new_zeros(T + pad, attn_mask.shape[1] + pad)
                full[:T, :-pad] = attn_mask
                full[T:, :self.length] = True
                full[T:, -pad:] = torch.eye(pad, dtype=torch.bool, device=attn_mask.device)
                attn_mask = full
        mask = None
        if attn_mask is not None:
            # a 4-D mask reaches the attention as-is (transformers ``masking_utils``); additive, so that
            # both the eager and the SDPA kernels read it
            dtype = self.target.model.dtype
            mask = self._additive(attn_mask, dtype)
            config = self.target.config
            if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
                # a 4-D mask replaces the model's own, window included: sliding-window layers (Gemma 3, GPT-OSS)
                # get theirs, a new row at position q reading only cached positions > q - window (transformers
                # ``masking_utils.sliding_window_overlay``); cache row r holds position r
                q = (torch.arange(self.length, self.length + attn_mask.shape[0], device=attn_mask.device)
                     if position_ids is None else position_ids)
                kv = torch.cat([torch.arange(self.length, device=attn_mask.device), q])  # (length+T,)
                window = attn_mask & (kv[None, :] > q[:, None] - config.sliding_window)
                mask = {"full_attention": mask, "sliding_attention": self._additive(window, dtype)}
        pos = None if position_ids is None else position_ids[None]
        if self.cache is None:
            # every layer keeps all its positions, sliding-window ones too (Gemma 3, GPT-OSS: the model still
            # applies the window through its mask), so :meth:`crop` and :meth:`keep` can roll any layer back;
            # the cache the model builds itself drops a sliding layer's old positions, and cannot be cropped
            from transformers import DynamicCache

            self.cache = DynamicCache()
        # inference mode, not only no_grad: autograd's per-op bookkeeping was 6-8 % of a SmolLM2 decode step on
        # an AVX512 core (issue 35); the outputs are copied out of it so that callers get ordinary tensors
        with torch.inference_mode():
            out = self.target(
                input_ids[None], attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True,
                compute_logits=not logits_to_keep,
            )
            if logits_to_keep:
                # the LM head over the kept rows only, as transformers' ``logits_to_keep`` slices before it
                logits = self.target.lm_logits(out.last_hidden_state[:, -logits_to_keep:])
            else:
                logits = out.logits[:, :T]  # (1, T, V)
        self.cache = out.cache
        self.length += input_ids.shape[0]
        self._settle()
        if pad > 0:
            self.crop(self.length - pad)
        return logits[0].to(torch.float32, copy=True), out.aux_hidden_states[0, :T].clone()

    @staticmethod
    def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(T, S) bool -> (1, 1, T, S) additive mask of ``dtype``: 0 where allowed, the dtype's min elsewhere."""
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]

    def crop(self, length: int) -> None:
        """Roll the cache back to its first ``length`` positions (``DynamicCache.crop``).

        Raises:
            ValueError: if ``length`` exceeds the cache's positions.
        """
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if drop:
            with torch.inference_mode():  # the cache holds inference tensors; so do its crops
                self.cache.crop(-drop)  # transformers 5: a negative count removes that many positions
            self.length = length
            self._settle()

    def keep(self, rows: torch.Tensor) -> None:
        """Compact the cache to the given positions, in order (a tree's accepted path).

        Args:
            rows: (R,) int64 ascending cache rows to keep; row i of the new cache is old row ``rows[i]``.
        """
        with torch.inference_mode():  # inference tensors, as the forward's (a compiled graph guards on it)
            for layer in self.cache.layers:  # transformers 5 ``DynamicLayer``: keys/values (B, A_kv, S, d)
                at = rows.to(layer.keys.device)  # a layer on another GPU (load_target's device_map)
                layer.keys = layer.keys.index_select(-2, at)
                layer.values = layer.values.index_select(-2, at)
        self.length = rows.shape[0]
        self._settle()

    def _settle(self) -> None:
        """Under a compiled target (``kernels=compiled``), give every cached key and value tensor the plain
        row-major strides of its shape.

        The compiled graph guards on the cache's strides, and three layouts reach it otherwise: a prefill stores
        the attention's transposed view, a crop keeps the longer tensor's strides, and a size-1 head axis keeps
        whatever stride it had (``Tensor.contiguous`` ignores size-1 axes; ``torch.cat`` and ``index_select``
        write row-major ones). Each would compile a new graph. Eager decoding keeps the views as they are.
        """
        if getattr(self.target, "compiled_forward", None) is None:
            return
        with torch.inference_mode():
            for layer in self.cache.layers:
                layer.keys, layer.values = _row_major(layer.keys), _row_major(layer.values)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its strides are the row-major ones of its shape, else a row-major copy."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    if t.stride() == tuple(reversed(strides)):
        return t
    return t.clone(memory_format=torch.contiguous_format)
