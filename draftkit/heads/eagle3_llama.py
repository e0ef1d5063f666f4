"""EAGLE3 draft head for Llama-style targets (arXiv 2503.01840), readable top to bottom.

Notable:
- one decoder layer; attention reads cat(input_layernorm(embedding), hidden_norm(feature)), width 2H
- ``fc`` fuses the target's aux hidden states (HF ``hidden_states`` indices, default [2, N//2, N-3])
- the next TTT step / draft step receives the pre-norm output h, or norm(h) with EAGLE-3.1 ``norm_output``
- EAGLE-3.1 input norms (``norm_before_fc``: one RMSNorm over the n*H_t concatenation, weight ``input_norm``;
  ``fc_norm``: one RMSNorm per aux state, weights ``fc_norm.{i}``) run before ``fc``, as speculators
  ``models/eagle3/core.py``, vLLM and SGLang ``models/llama_eagle3.py`` and TensorRT-LLM
  ``_torch/models/modeling_speculative.py`` apply them
- module names equal the checkpoint keys that vLLM, SGLang and TensorRT-LLM load
  (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, buffers ``d2t``/``t2d``); the frozen ``embed_tokens``
  copy of the target embedding is kept out of exports when H == H_t
- RoPE comes from the target config through transformers' ``LlamaRotaryEmbedding`` (all rope types)
- attention has two entry points that compute the same function: :meth:`Eagle3Attention.forward_cached`
  (serving: a plain causal KV cache) and :meth:`Eagle3Attention.forward_ttt` (training-time test: a dense
  causal block over step-0 keys plus one diagonal key per later step, SpecForge's ``cache_hidden`` scheme)

Shapes: B batch, T tokens, H draft hidden, H_t target hidden, A heads, A_kv kv heads, d head dim,
V target vocab, V_d draft vocab, S cached positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftkit.heads.config import SUPPORTED_MODEL_TYPES, UNSUPPORTED_NOTES, Eagle3Config
from draftkit.kernels.attention import grouped_query_attention
from draftkit.kernels.ttt_attention import ttt_attention

__all__ = ["Eagle3Config", "Eagle3LlamaHead", "KVCache", "RMSNorm", "SUPPORTED_MODEL_TYPES", "UNSUPPORTED_NOTES"]

class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Llama does. Input/output (..., H)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class KVCache:
    """Keys and values of the draft layer for the positions decoded so far.

    ``k``/``v`` have shape (B, A_kv, S, d) after RoPE. :meth:`crop` rolls back to the first ``length``
    positions, which is what speculative decoding does after a rejection.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)  # (B, A_kv, S+T, d)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)  # (B, A_kv, S+T, d)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k = self.k[:, :, :length]
            self.v = self.v[:, :, :length]


class Eagle3MLP(nn.Module):
    """SiLU-gated MLP, keys ``gate_proj``/``up_proj``/``down_proj``. (..., H) -> (..., H)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v read the 2H concatenation of embedding and feature."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def _qkv(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = u.shape
        q = self.q_proj(u).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, A, T, d)
        k = self.k_proj(u).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, A_kv, T, d)
        v = self.v_proj(u).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, A_kv, T, d)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))  # (B, T, H)

    def forward_cached(
        self,
        u: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of T new positions over the cache plus themselves.

        Args:
            u: (B, T, 2H) layer input.
            cos, sin: (B, T, d) RoPE tables of the new positions.
            cache: the draft KV cache (appended to in place), or None for a cache-free pass.
            key_padding_mask: (B, S+T) bool, True for real keys; None when there is no padding.
            attn_mask: (T, S+T) bool, True where a new row may attend, replacing the causal mask (tree
                drafting: each node sees the cache, its ancestors and itself); None = causal.

        Returns:
            (B, T, H) attention output after ``o_proj``.
        """
        q, k, v = self._qkv(u, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, A_kv, S+T, d)
        t, s = q.shape[2], k.shape[2]
        if attn_mask is None:
            mask = torch.ones(t, s, dtype=torch.bool, device=u.device).tril(diagonal=s - t)  # (T, S+T)
        elif attn_mask.shape != (t, s):
            raise ValueError(f"attn_mask must be (T, S+T) = ({t}, {s}), got {tuple(attn_mask.shape)}")
        else:
            mask = attn_mask
        if key_padding_mask is not None:
            mask = mask[None, None] & key_padding_mask[:, None, None, :]  # (B, 1, T, S+T)
        return self._out(grouped_query_attention(q, k, v, mask))

    def forward_ttt(
        self,
        u: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ttt_cache: list[tuple[torch.Tensor, torch.Tensor]],
        key_padding_mask: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One training-time-test step (eagle3-format.md §4.2).

        Row p at step k attends to the step-0 keys of rows q <= p (pads masked) and to its own keys from
        steps 1..k, joined in one softmax (the ``cache_hidden`` scheme of SpecForge ``llama3_eagle.py``);
        computed by :func:`ttt_attention` (O(T) memory, any device and padding).

        With ``rows``, only those rows are computed (their q/k/v projections and ``o_proj``); the other rows
        of this step's keys are zero and never read, because a row computed at step k was computed at every
        step before it (the caller keeps the row sets nested).

        Args:
            u: (B, T, 2H) layer input of this step, or (n, 2H) for ``rows``.
            cos, sin: (B, T, d) RoPE tables at positions pos_p + step, or (1, n, d) for ``rows``.
            ttt_cache: [(K_0, V_0), (K_1, V_1), ...], each (B, A_kv, T, d); appended to in place.
            key_padding_mask: (B, T) bool, True for real tokens.
            rows: optional (n,) int64 flat indices into B*T of the rows to compute (steps >= 1 only).

        Returns:
            (B, T, H) attention output after ``o_proj``, or (n, H) for ``rows``.
        """
        b, t = key_padding_mask.shape
        if rows is None:
            q, k, v = self._qkv(u, cos, sin)  # (B, A, T, d), (B, A_kv, T, d) x2
        else:
            if not ttt_cache:
                raise ValueError("forward_ttt: step 0 computes every row (its keys are the context of all rows)")
            q, k, v = (_scatter_rows(x, rows, b, t) for x in self._qkv(u[None], cos, sin))  # (B, A|A_kv, T, d)
        ttt_cache.append((k, v))
        o = ttt_attention(q, ttt_cache, key_padding_mask, 1.0 / math.sqrt(self.head_dim))  # (B, A, T, d)
        if rows is None:
            return self._out(o)
        o = o.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim)[rows]  # (n, A*d)
        return self.o_proj(o)


def _scatter_rows(x: torch.Tensor, rows: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """(1, heads, n, d) values of flat rows -> (B, heads, T, d) with zeros elsewhere (differentiable)."""
    src = x[0].transpose(0, 1)  # (n, heads, d)
    full = src.new_zeros(b * t, *src.shape[1:]).index_copy(0, rows, src)  # (B*T, heads, d)
    return full.view(b, t, *src.shape[1:]).transpose(1, 2)  # (B, heads, T, d)


class Eagle3DecoderLayer(nn.Module):
    """The EAGLE3 ``midlayer``: attention over cat(norm(embedding), norm(feature)) and an MLP."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, emb: torch.Tensor, feature: torch.Tensor, attend) -> torch.Tensor:
        """(B, T, H) embedding and feature -> (B, T, H) pre-norm output h in the feature's dtype; ``attend(u)``
        runs attention. (Under mixed precision ``norm_before_residual``'s residual is the float32 norm product;
        h is cast back so that the next TTT step's keys and values keep step 0's dtype.)"""
        g = self.hidden_norm(feature)
        u = torch.cat([self.input_layernorm(emb), g], dim=-1)  # (B, T, 2H), embedding half first
        residual = g if self.norm_before_residual else feature
        h = residual + attend(u)
        return (h + self.mlp(self.post_attention_layernorm(h))).to(feature.dtype)


class Eagle3LlamaHead(nn.Module):
    """EAGLE3 draft head: ``fc`` + one decoder layer + ``norm`` + ``lm_head`` over the draft vocab.

    Args:
        cfg: the head shape (:class:`Eagle3Config`).

    Buffers ``d2t`` (V_d,) int64 and ``t2d`` (V,) bool hold the draft-vocab map (see
    ``draftkit.selection.vocab``); they start as the identity and must be set with :meth:`set_vocab`
    when V_d < V. ``embed_tokens`` (V, H) is a frozen copy of the target embedding (:meth:`load_embedding`).
    With ``cfg.norm_before_fc`` the head has ``input_norm`` (n*H_t), with ``cfg.fc_norm`` ``fc_norm`` (n norms
    of H_t); both start at ones.
    """

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.input_norm = (RMSNorm(cfg.num_aux_layers * cfg.target_hidden_size, cfg.rms_norm_eps)
                           if cfg.norm_before_fc else None)
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                      for _ in range(cfg.num_aux_layers)) if cfg.fc_norm else None)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())

    # -- set-up -------------------------------------------------------------------------------------------
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft-vocab map. d2t: (V_d,) int64 offsets; t2d: (V,) bool.

        Raises:
            ValueError: on a shape mismatch with the head (names both shapes).
        """
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the head "
                f"(V_d={self.config.draft_vocab_size}, V={self.config.vocab_size})"
            )
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    @torch.no_grad()
    def load_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding (V, H_t) into the frozen ``embed_tokens``."""
        if weight.shape != self.embed_tokens.weight.shape:
            raise ValueError(
                f"target embedding {tuple(weight.shape)} does not match the head's "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        self.embed_tokens.weight.copy_(weight)

    @torch.no_grad()
    def init_from_target(self, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor | None = None) -> None:
        """Start ``lm_head`` from the target's LM head rows of the draft vocab and ``norm`` from its final norm.

        Call after :meth:`set_vocab`. Row i of the head's ``lm_head`` becomes row ``i + d2t[i]`` of the target's,
        so at step 0 the head's logits are the target's own logits restricted to the draft vocab, applied to the
        head's hidden state.

        Args:
            lm_head_weight: (V, H) target output projection (any float dtype; copied as the head's dtype).
            final_norm_weight: (H,) target final RMSNorm weight, or None to leave ``norm`` at ones.

        Raises:
            ValueError: when the shapes do not match the head's (V, H) (names both).
        """
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head_weight.shape) != expected or (
            final_norm_weight is not None and tuple(final_norm_weight.shape) != expected[1:]
        ):
            raise ValueError(
                f"target LM head {tuple(lm_head_weight.shape)} / final norm "
                f"{None if final_norm_weight is None else tuple(final_norm_weight.shape)} do not match the head's "
                f"vocab {expected[0]} and hidden size {expected[1]}"
            )
        rows = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(lm_head_weight[rows.to(lm_head_weight.device)])
        if final_norm_weight is not None:
            self.norm.weight.copy_(final_norm_weight)

    @torch.no_grad()
    def init_decoder_from_target_layer(self, layer_state: dict[str, torch.Tensor], target_config) -> None:
        """Start the decoder layer (``midlayer``) from one target decoder layer's weights instead of random.

        Mapping (target Llama-style layer -> head), each tensor copied in the head's dtype and device (never
        shared with the target):

        1. ``self_attn.{q,k,v}_proj.weight`` (out, H) -> the **feature half**, columns [H, 2H), of the head's
           (out, 2H) ``midlayer.self_attn.{q,k,v}_proj.weight``; the **embedding half**, columns [0, H), is set
           to **zero**.
        2. ``self_attn.o_proj.weight`` and ``mlp.{gate,up,down}_proj.weight`` -> the same names.
        3. ``input_layernorm.weight`` -> ``midlayer.hidden_norm.weight`` (the norm in front of the feature half);
           ``post_attention_layernorm.weight`` -> the same name; the head's ``input_layernorm`` (the token
           embedding's norm, in front of the zeroed half) stays as built (ones).

        Why: the draft layer's attention reads cat(input_layernorm(embedding), hidden_norm(feature)) (embedding
        half first, as in EAGLE-3, SpecForge ``llama3_eagle.py`` and speculators), and its residual stream is the
        feature, the fused target state that stands where the target layer's hidden state stood. With the
        embedding half at zero the layer computes at initialisation exactly the target layer on the feature
        (h = f + Attn(norm(f)), out = h + MLP(norm(h)); with ``norm_before_residual`` the residual is norm(f)).
        Copying the target's columns into the embedding half as well would add W·norm(e) to every projection, a
        term the target layer never computes. The zero half still learns from the first step: the gradient of
        a linear weight is its input times the output's gradient, whatever the weight. No reference
        implementation initialises the draft layer from the target (speculators copies only the embedding and
        LM head, ``load_verifier_weights``); this is draftkit's choice.

        Args:
            layer_state: the target decoder layer's ``state_dict()`` (names relative to the layer): exactly the
                nine tensors above; Llama shapes q (A*d, H), k/v (A_kv*d, H), o (H, A*d), gate/up (I, H),
                down (H, I), norms (H,).
            target_config: the target's Hugging Face config: its layer geometry (as :meth:`Eagle3Config.
                from_target_config` reads it: H, A, A_kv, d, I, RMSNorm epsilon) must equal the head's, since
                equal tensor shapes alone can hide another split into heads (A*d = A'*d'), and its MLP
                activation (``hidden_act``) must be SiLU, the head's.

        Raises:
            ValueError: when the head's geometry differs from the target's (names each field and both values),
                the layer holds tensors the head has no place for (biases, q/k norms, sandwich-norm or MoE
                parts: named), lacks one, uses another activation, or a tensor's shape differs from the head's
                (names the tensor and both shapes); nothing is copied then.
        """
        c = self.config
        implied = Eagle3Config.from_target_config(target_config, c.aux_layer_ids, c.draft_vocab_size)
        fields = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "rms_norm_eps")
        differ = [f"{f} {getattr(c, f)} (target {getattr(implied, f)})" for f in fields
                  if getattr(c, f) != getattr(implied, f)]
        if differ:
            raise ValueError(f"the draft layer's geometry differs from the target layer's: {', '.join(differ)}; "
                             f"the draft layer must have the target layer's shape")
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        hidden_act = getattr(text, "hidden_act", None)
        layer, h = self.midlayer, c.hidden_size
        attn, mlp = layer.self_attn, layer.mlp
        mapping = {  # target name -> (head tensor, True: it fills the feature half of a (out, 2H) weight)
            **{f"self_attn.{p}_proj.weight": (getattr(attn, f"{p}_proj").weight, True) for p in "qkv"},
            "self_attn.o_proj.weight": (attn.o_proj.weight, False),
            **{f"mlp.{p}_proj.weight": (getattr(mlp, f"{p}_proj").weight, False) for p in ("gate", "up", "down")},
            "input_layernorm.weight": (layer.hidden_norm.weight, False),
            "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, False),
        }
        extra, missing = sorted(set(layer_state) - set(mapping)), sorted(set(mapping) - set(layer_state))
        if extra or missing or hidden_act != "silu":
            raise ValueError(
                f"the target layer is not a plain Llama-style layer the draft layer can start from (tensors the head "
                f"has no place for: {extra or 'none'}; missing: {missing or 'none'}; activation {hidden_act!r}, the "
                f"head's is 'silu'); leave the decoder layer random for this target"
            )
        for name, (dst, half) in mapping.items():
            want = (dst.shape[0], h) if half else tuple(dst.shape)
            if tuple(layer_state[name].shape) != want:
                raise ValueError(
                    f"target layer tensor {name} is {tuple(layer_state[name].shape)}, the head's needs {want} (head: "
                    f"hidden {c.hidden_size}, {c.num_attention_heads} heads, {c.num_key_value_heads} kv heads, "
                    f"head_dim {c.head_dim}, intermediate {c.intermediate_size})"
                )
        for name, (dst, half) in mapping.items():
            if half:
                dst[:, :h].zero_()  # (out, H) embedding half
                dst[:, h:].copy_(layer_state[name])  # (out, H) feature half
            else:
                dst.copy_(layer_state[name])

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft ids (any shape, int64) to target ids: i + d2t[i]."""
        return draft_ids + self.d2t[draft_ids]

    def rope(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables (B, T, d) for (B, T) int64 positions, in ``hidden``'s dtype."""
        return self.rotary_emb(hidden, position_ids)

    # -- forward --------------------------------------------------------------------------------------------
    def project(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Step-0 feature: (B, T, num_aux * H_t) concatenated aux states -> (B, T, H).

        fc(F); fc(input_norm(F)) with ``norm_before_fc``; fc(cat(fc_norm_i(F_i))) over the n aux chunks of
        width H_t with ``fc_norm`` (vLLM ``combine_hidden_states``, SGLang ``LlamaModel.forward``).
        """
        if self.input_norm is not None:
            aux_hidden_states = self.input_norm(aux_hidden_states)
        if self.fc_norm is not None:
            chunks = aux_hidden_states.chunk(len(self.fc_norm), dim=-1)  # n x (B, T, H_t)
            aux_hidden_states = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden_states)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, H) pre-norm output -> (B, T, V_d) draft logits."""
        return self.lm_head(self.norm(h))

    def next_feature(self, h: torch.Tensor) -> torch.Tensor:
        """The feature the next draft / TTT step receives: h (EAGLE-3), or norm(h) with ``norm_output``
        (vLLM and SGLang return the post-norm state as the aux output). (..., H) -> (..., H), in h's dtype: under
        mixed precision (float32 norm weight, bfloat16 h) the norm's float32 product is cast back, so every TTT
        step's keys and values have the dtype of step 0's."""
        return self.norm(h).to(h.dtype) if self.config.norm_output else h

    def forward(
        self,
        input_ids: torch.Tensor,
        feature: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        key_padding_mask: torch.Tensor | None = None,
        last_only: bool = False,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for T new positions with a KV cache (serving path).

        Args:
            input_ids: (B, T) int64 target ids; row t carries token x_{t+1} for feature row t.
            feature: (B, T, H) — ``project(aux)`` for positions fed by the target, or the previous step's
                pre-norm output h for chained drafts.
            position_ids: (B, T) int64 RoPE positions.
            cache: draft KV cache, appended to in place (None: attend only within these T positions).
            key_padding_mask: (B, S+T) bool, True for real keys, or None.
            last_only: keep only the last row (a prefill's earlier logits are never used and would cost
                T x V_d x H).
            attn_mask: (T, S+T) bool replacing the causal mask (tree drafting), or None.

        Returns:
            logits (B, T, V_d) over the draft vocab and the feature of the next step (B, T, H): the pre-norm
            output h, or norm(h) with ``norm_output`` (:meth:`next_feature`); T is 1 with ``last_only``.
        """
        emb = self.embed_tokens(input_ids).to(feature.dtype)  # (B, T, H), frozen
        cos, sin = self.rope(feature, position_ids)
        h = self.midlayer(
            emb, feature, lambda u: self.midlayer.self_attn.forward_cached(u, cos, sin, cache, key_padding_mask, attn_mask)
        )
        if last_only:
            h = h[:, -1:]  # (B, 1, H)
        return self.logits(h), self.next_feature(h)

    def ttt_step(
        self,
        input_ids: torch.Tensor,
        feature: torch.Tensor,
        position_ids: torch.Tensor,
        ttt_cache: list,
        key_padding_mask: torch.Tensor,
        logits_index: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One training-time-test step (training path; see Eagle3Attention.forward_ttt).

        Args:
            input_ids: (B, T) int64, this step's input token per row (x_{p+1+k}).
            feature: (B, T, H), ``project(aux)`` at step 0, the previous step's h afterwards; (n, H) with ``rows``.
            position_ids: (B, T) int64, pos_p + k.
            ttt_cache: list of per-step (K, V), empty at step 0; appended to in place.
            key_padding_mask: (B, T) bool, True for real tokens.
            logits_index: optional (n',) int64 indices of the rows whose logits are wanted (flat into B*T, or
                into the n ``rows``); the LM head then runs on those rows only (the supervised ones).
            rows: optional (n,) int64 flat indices into B*T of the rows to compute at this step (k >= 1): a row
                no later step supervises is skipped. The sets must be nested over steps (each step's rows
                were computed at every earlier step).

        Returns:
            logits (B, T, V_d), (n', V_d) with ``logits_index``; the next step's feature (:meth:`next_feature`
            of h) (B, T, H), or (n, H) with ``rows``.
        """
        if rows is not None:
            input_ids = input_ids.reshape(-1)[rows][None]  # (1, n)
            position_ids = position_ids.reshape(-1)[rows][None]  # (1, n)
            feature = feature[None]  # (1, n, H)
        emb = self.embed_tokens(input_ids).to(feature.dtype)  # (B, T, H) or (1, n, H)
        cos, sin = self.rope(feature, position_ids)
        attend = lambda u: self.midlayer.self_attn.forward_ttt(  # noqa: E731
            u if rows is None else u[0], cos, sin, ttt_cache, key_padding_mask, rows
        )
        h = self.midlayer(emb, feature, attend)  # (B, T, H) or (1, n, H)
        h = h if rows is None else h[0]  # (n, H)
        if logits_index is not None:
            return self.logits(h.reshape(-1, h.shape[-1])[logits_index]), self.next_feature(h)  # (n', V_d)
        return self.logits(h), self.next_feature(h)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensors under the serving names (no ``embed_tokens``, no RoPE cache)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "rotary_emb."))}
