"""Memory per GPU of a training run, estimated before anything loads (``fit`` prints it and stops a run that
will not fit its GPUs).

Parts: the target's resident weights (whole under ``ddp``, 1/W under ``fsdp_target``: ``draftkit.target.sharding``),
the target weights gathered during its forward, the head's fp32 weights (with its frozen embedding copy), its
gradients and AdamW state, and the TTT activations with the teacher logits. Parameter counts come from ``meta``
instances of the real modules (nothing allocated); only the activation term is a rough bound.

Shapes: B sequences per GPU, T tokens, H_t target hidden, I target MLP width, V target vocab, V_d draft vocab,
K TTT steps, W data-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["MemoryEstimate", "check_memory", "estimate_memory"]


@dataclass
class MemoryEstimate:
    """Bytes per GPU of one training step, by part (:func:`estimate_memory`).

    Attributes:
        strategy: ``ddp`` (the target replicated) or ``fsdp_target`` (sharded over ``world`` ranks).
        world: data-parallel ranks the target is sharded over (1 under ``ddp``).
        target: the target's resident weights (its shard under ``fsdp_target``).
        gathered: target weights whole at once during its forward under ``fsdp_target``: the larger of two
            decoder layers (the one running and the next being gathered) and the embedding or LM head plus a
            layer; 0 under ``ddp``.
        head: the head's weights (fp32 master weights, the frozen fp32 embedding copy included).
        optimizer: gradients plus AdamW's two moments of the head's trainable parameters (fp32).
        activations: the TTT steps' saved activations plus the teacher logits (rough: see ``estimate_memory``).
    """

    strategy: str
    world: int
    target: int
    gathered: int
    head: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.target + self.gathered + self.head + self.optimizer + self.activations

    def table(self) -> str:
        """One line per part, in GB (1e9 bytes)."""
        rows = [("target" + (f" (1/{self.world} shard)" if self.strategy == "fsdp_target" else " (whole)"), self.target),
                ("target gathered in forward", self.gathered), ("head weights", self.head),
                ("head grads + AdamW state", self.optimizer), ("TTT activations + teacher logits", self.activations),
                ("total", self.total)]
        return "\n".join(f"  {name:<34} {value / 1e9:7.1f} GB" for name, value in rows)


def _meta_params(config) -> tuple[int, int, int]:
    """(all parameters, the largest decoder layer's, the input embedding's) of a target config, counted on a
    ``meta`` instance (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    return total, layer, model.get_input_embeddings().weight.numel()


def estimate_memory(config, strategy: str, world: int, target_bytes: int, max_length: int, batch_size: int,
                    ttt_steps: int, draft_vocab_size: int, aux_layer_ids: list[int] | None = None) -> MemoryEstimate:
    """Bytes per GPU of a training step, before anything loads: target, gathered layers, head, optimizer and
    activations (arithmetic on parameter counts of ``meta`` instances; the activation term is a rough bound).

    Activations: per TTT step and token, 2 bytes x (24 H + 3 I + 10 V_d) (the head layer's saved bf16
    tensors, about 24 H wide with its 2H-wide attention input, its MLP's 3 I, and the step's draft logits in bf16
    plus their fp32 log-softmax and gradient), times K steps x B x T; plus the teacher logits, 4 B T V bytes.
    On Llama-3.1-8B at 2,048 tokens this gives ~40 GB in all, the low end of issue 32's measured-on-CPU ~40-46 GB.

    Args:
        config: the target's Hugging Face config.
        strategy: ``ddp`` or ``fsdp_target``.
        world: data-parallel ranks (the target is sharded over them under ``fsdp_target``).
        target_bytes: bytes per target element (2 for bf16).
        max_length: T, tokens per sequence.
        batch_size: B, sequences per GPU.
        ttt_steps: K.
        draft_vocab_size: V_d.
        aux_layer_ids: HF ``hidden_states`` indices (None: the default three).

    Returns:
        :class:`MemoryEstimate`.
    """
    from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
    from draftkit.selection.layers import validate_aux_layer_ids
    from draftkit.target.frozen import text_config

    text = text_config(config)
    total, layer, embed = _meta_params(config)
    sharded = strategy == "fsdp_target"
    world = world if sharded else 1
    aux = validate_aux_layer_ids(aux_layer_ids, text.num_hidden_layers)
    with torch.device("meta"):
        head = Eagle3LlamaHead(Eagle3Config.from_target_config(text, aux, draft_vocab_size))
    head_params = sum(p.numel() for p in head.parameters())
    trainable = head_params - head.embed_tokens.weight.numel()
    h, inter, vocab = text.hidden_size, text.intermediate_size, text.vocab_size
    per_token = 2 * (24 * h + 3 * inter + 10 * draft_vocab_size)
    return MemoryEstimate(
        strategy="fsdp_target" if sharded else "ddp", world=world,
        target=math.ceil(total / world) * target_bytes,
        gathered=max(2 * layer, embed + layer) * target_bytes if sharded else 0,
        head=head_params * 4, optimizer=trainable * 12,
        activations=ttt_steps * batch_size * max_length * per_token + 4 * batch_size * max_length * vocab,
    )


def check_memory(config, strategy: str, world: int, target_bytes: int, max_length: int, batch_size: int,
                 ttt_steps: int, draft_vocab_size: int, aux_layer_ids: list[int] | None = None,
                 gpu_bytes: int | None = None) -> str:
    """The per-GPU memory estimate of a training run as a table (:func:`estimate_memory`), and a refusal when it
    exceeds the GPU's memory, told before anything loads.

    Args:
        config, strategy, world, target_bytes, max_length, batch_size, ttt_steps, draft_vocab_size,
            aux_layer_ids: as :func:`estimate_memory` (``strategy``: ``fsdp_target`` shards the target, any
            other strategy name replicates it).
        gpu_bytes: one GPU's memory in bytes, or None (no GPU: nothing is refused).

    Returns:
        The report: a header line, then one line per part.

    Raises:
        ValueError: when the estimate exceeds ``gpu_bytes``, naming both, the estimate under ``fsdp_target``
            over the same GPUs when the run replicates the target, and what to change.
    """
    args = (world, target_bytes, max_length, batch_size, ttt_steps, draft_vocab_size, aux_layer_ids)
    est = estimate_memory(config, strategy, *args)
    header = (f"memory per GPU, estimated before loading (trainer.strategy {strategy}, target "
              f"{'sharded over ' + str(world) + ' ranks' if est.strategy == 'fsdp_target' else 'replicated'}, "
              f"{batch_size} x {max_length} tokens, {ttt_steps} TTT steps)")
    report = header + ":\n" + est.table()
    if gpu_bytes is None or est.total <= gpu_bytes:
        return report
    fix = "lower data.max_length, data.batch_size or model.ttt.steps, or add GPUs"
    if est.strategy == "ddp":
        alt = estimate_memory(config, "fsdp_target", *args)
        fix = (f"trainer.strategy fsdp_target shards the target over the {world} GPUs: ~{alt.total / 1e9:.1f} GB "
               f"per GPU" + (" (fits)" if alt.total <= gpu_bytes else f", which does not fit either; then {fix}"))
    raise ValueError(
        f"the run will not fit: ~{est.total / 1e9:.1f} GB per GPU estimated, the GPU has {gpu_bytes / 1e9:.1f} GB; "
        f"{fix}. Stopped before loading anything.\n{report}"
    )
