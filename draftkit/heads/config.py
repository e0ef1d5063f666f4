"""The EAGLE3 draft head's configuration (:class:`Eagle3Config`), sized from a target's config, and the target
families it is sized for (``draftkit.heads.eagle3_llama`` is the head itself).

Shapes: H draft hidden, H_t target hidden, A heads, A_kv kv heads, d head dim, V target vocab, V_d draft vocab.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

__all__ = ["Eagle3Config", "SUPPORTED_MODEL_TYPES", "UNSUPPORTED_NOTES"]

# target families (``model_type`` of the text config) the head is sized from, each tested end to end on a tiny
# random target in tests/families (fit, greedy-equal evaluate, every exporter). Per family: the head is Llama-style
# whatever the target's attention; it reads the target's full-attention RoPE (Gemma 3's ``rope_parameters`` per
# layer type), its ``num_attention_heads`` and ``head_dim`` (DeepSeek-V3's MLA ranks stay in the target), its
# dense ``intermediate_size`` (the MoE experts stay in the target), and the unscaled input embedding rows (as the
# engines' draft models embed; Gemma's sqrt(H) scale is the target's own, and the head's input norm removes it);
# Gemma 2's final-logit soft-cap is applied to the target's logits (``draftkit.target.frozen.target_logits``), its
# attention soft-cap stays inside the target
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "deepseek_v3", "gemma2",
                         "gemma3_text")
# families the head is known not to cover yet: what is missing, named in the refusal
UNSUPPORTED_NOTES = {
    "gemma4_text": "Gemma 4's attention differs per layer type (head_dim per layer, 'proportional' partial RoPE on "
                   "full-attention layers, per-layer input embeddings), and the head has no tested mapping of it to "
                   "one Llama-style draft layer the engines serve",
}


@dataclass
class Eagle3Config:
    """Shape of an EAGLE3 head; normally derived from the target with :meth:`from_target_config`.

    Args:
        hidden_size: H, draft hidden size.
        target_hidden_size: H_t, width of each aux hidden state.
        num_aux_layers: number of aux hidden states fused by ``fc`` (3 for EAGLE3).
        intermediate_size: I, MLP width.
        num_attention_heads: A.
        num_key_value_heads: A_kv.
        head_dim: d.
        vocab_size: V, target vocabulary size.
        draft_vocab_size: V_d <= V.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: context length the RoPE tables are built for.
        rope: rope fields copied from the target config (``rope_theta``/``rope_scaling`` or
            transformers-5 ``rope_parameters``).
        norm_before_residual: residual is hidden_norm(g) instead of g (speculators/vLLM flag).
        norm_before_fc: EAGLE-3.1: fc reads input_norm(F), one RMSNorm over the whole (n*H_t) concatenation.
        fc_norm: EAGLE-3.1: fc reads cat(fc_norm_0(h_0), ..., fc_norm_{n-1}(h_{n-1})), one RMSNorm per aux
            state (H_t each). Exclusive with ``norm_before_fc`` (speculators refuses both; TensorRT-LLM would
            apply only ``fc_norm``, vLLM and SGLang both).
        norm_output: EAGLE-3.1: the next step's feature is norm(h), the normed state the logits read, instead
            of the pre-norm h (logits are unchanged).
        aux_layer_ids: HF ``hidden_states`` indices the head was trained on (recorded, not used here).

    Raises:
        ValueError: for V_d outside [1, V], heads not a multiple of kv heads, or both ``norm_before_fc`` and
            ``fc_norm``.
    """

    hidden_size: int
    target_hidden_size: int
    num_aux_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    rope: dict = field(default_factory=lambda: {"rope_theta": 10000.0})
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    aux_layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise ValueError(
                "norm_before_fc and fc_norm are exclusive (speculators refuses both; TensorRT-LLM would apply only "
                "fc_norm): choose one"
            )

    @classmethod
    def from_target_config(
        cls, target_config, aux_layer_ids: list[int], draft_vocab_size: int, **overrides
    ) -> "Eagle3Config":
        """Size a head from a Hugging Face target config.

        Args:
            target_config: a ``transformers.PretrainedConfig`` of a Llama-family causal LM.
            aux_layer_ids: validated HF ``hidden_states`` indices (see ``draftkit.selection.layers``).
            draft_vocab_size: V_d.
            overrides: any field of this dataclass.

        Raises:
            ValueError: if the target's ``model_type`` is not Llama-style (names the type and the supported ones).
        """
        cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            note = UNSUPPORTED_NOTES.get(cfg.model_type)
            raise ValueError(
                f"unsupported target model_type {cfg.model_type!r}{f' ({note})' if note else ''}: the EAGLE3 Llama "
                f"head supports {', '.join(SUPPORTED_MODEL_TYPES)}; choose a target of one of these families"
            )
        heads = cfg.num_attention_heads
        rope = {}
        for key in ("rope_theta", "rope_scaling", "rope_parameters"):
            value = getattr(cfg, key, None)
            if value is not None:
                rope[key] = copy.deepcopy(dict(value) if isinstance(value, dict) else value)
        if "rope_parameters" in rope:  # transformers 5: the whole RoPE (its ``rope_scaling`` is an alias of it)
            rope = {"rope_parameters": rope["rope_parameters"]}
            if "full_attention" in rope["rope_parameters"]:  # per layer type (Gemma 3): the draft attends in full
                rope["rope_parameters"] = rope["rope_parameters"]["full_attention"]
        fields = dict(
            hidden_size=cfg.hidden_size,
            target_hidden_size=cfg.hidden_size,
            num_aux_layers=len(aux_layer_ids),
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 8192),
            rope=rope,
            aux_layer_ids=list(aux_layer_ids),
        )
        fields.update(overrides)
        return cls(**fields)

    def llama_config(self):
        """A one-layer ``LlamaConfig`` with this head's shape and the target's rope fields (for RoPE, export)."""
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            **copy.deepcopy(self.rope),
        )
        return cfg
