"""One decoding stream of the frozen target over a Hugging Face KV cache: prefill, extend, roll back, compact.

Used by every loop that decodes with the target (``draftkit.decoding``: plain, chain and tree speculative
decoding, the cost model). Shapes: T new tokens, V target vocab, H_t target hidden, A number of aux layers.
Batch size is 1 (single-stream latency).
"""

from __future__ import annotations

import torch

from draftkit.quant.bytes import param_bytes

__all__ = ["TargetSession"]


class TargetSession:
    """One decoding stream of a ``FrozenTarget`` over a Hugging Face KV cache.

    Args:
        target: a ``draftkit.target.frozen.FrozenTarget``.
    """

    def __init__(self, target) -> None:
        self.target = target
        self.cache = None
        self.length = 0
        # {n: m}: a forward over n new rows runs m > n rows (dummy rows after the real ones, dropped again);
        # set from ``decoding.cost.CostTable.padding`` where a kernel makes m rows cheaper than n
        self.pad_rows: dict[int, int] = {}
        model = target.model
        tied = model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
        embed = model.get_input_embeddings().weight
        # an untied input embedding is a row gather, not a weight read
        self.weight_bytes = param_bytes(model) - (0 if tied else embed.numel() * embed.element_size())

    @property
    def max_length(self) -> int:
        """Context window in tokens (``max_position_embeddings``)."""
        return int(getattr(self.target.config, "max_position_embeddings", 1 << 30))

    def reset(self) -> None:
        self.cache = None
        self.length = 0

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        last_only: bool = False,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the cache by T tokens.

        Args:
            input_ids: (T,) int64 tokens, by default at positions length..length+T-1.
            last_only: compute the LM head for the last row only (prefill).
            position_ids: (T,) int64 RoPE positions (tree verification), or None for the default.
            attn_mask: (T, length+T) bool, True where a new row may attend (a tree mask over the cache),
                or None for causal attention.

        Returns:
            logits (T, V) float32 (or (1, V) with ``last_only``) and aux (T, A*H_t) in the target dtype.

        With T in ``pad_rows`` (and not ``last_only``) the forward runs ``pad_rows[T] - T`` dummy rows after the
        real ones (the last token again, attending to the cache and itself; no real row attends to them) and
        crops them from the cache, so the result and the cache are those of the unpadded forward.
        """
        T = input_ids.shape[0]
        pad = 0 if last_only else self.pad_rows.get(T, T) - T
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
            mask = torch.zeros(attn_mask.shape, dtype=dtype, device=input_ids.device)
            mask = mask.masked_fill(~attn_mask, torch.finfo(dtype).min)[None, None]  # (1, 1, T, length+T)
        pos = None if position_ids is None else position_ids[None]
        out = self.target(
            input_ids[None], attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True,
            compute_logits=not last_only,
        )
        self.cache = out.cache
        self.length += input_ids.shape[0]
        if last_only:
            logits = self.target.model.get_output_embeddings()(out.last_hidden_state[:, -1:])  # (1, 1, V)
        else:
            logits = out.logits[:, :T]  # (1, T, V)
        if pad > 0:
            self.crop(self.length - pad)
        return logits[0].float(), out.aux_hidden_states[0, :T]

    def crop(self, length: int) -> None:
        """Roll the cache back to its first ``length`` positions."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if drop:
            self.cache.crop(-drop)  # transformers 5: a negative count removes that many positions
            self.length = length

    def keep(self, rows: torch.Tensor) -> None:
        """Compact the cache to the given positions, in order (a tree's accepted path).

        Args:
            rows: (R,) int64 ascending cache rows to keep; row i of the new cache is old row ``rows[i]``.
        """
        for layer in self.cache.layers:  # transformers 5 ``DynamicLayer``: keys/values (B, A_kv, S, d)
            layer.keys = layer.keys.index_select(-2, rows)
            layer.values = layer.values.index_select(-2, rows)
        self.length = rows.shape[0]
