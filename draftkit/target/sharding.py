"""The frozen target sharded across the data-parallel ranks with FSDP2, and the memory it needs per GPU.

Under ``trainer.strategy: fsdp_target`` (``draftkit.strategy.ShardedTargetStrategy``) no rank holds the whole
target: every decoder layer is its own FSDP2 unit (``torch.distributed.fsdp.fully_shard``), and so are the base
model's remainder (input embedding, final norm) and the LM head. Each rank keeps 1/W of every weight (a DTensor
shard on dim 0, W = world size); a unit's forward all-gathers its weights, runs, and frees them again
(``reshard_after_forward``), so at most a layer or two (and the embedding, gathered for the whole base forward)
are whole at once. Each unit keeps the target dtype; the target is frozen, so no gradient is reduced for it,
and the head beside it stays a plain replicated module (DDP all-reduces its gradients, Muon sees whole
matrices).

Loading (:func:`load_sharded_target`): the model is built with its parameters on the ``meta`` device (buffers
such as RoPE frequencies are real), sharded, materialised empty on this rank's device, and each rank reads
only its own rows of every tensor from the target's safetensors files (``safe_open(...).get_slice``).

Shapes: V target vocab, H_t target hidden, N target layers, W world size (data-parallel ranks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["MemoryEstimate", "check_memory", "estimate_memory", "load_sharded_target", "resident_bytes",
           "shard_target", "target_mesh"]


def target_mesh(trainer):
    """The 1-D device mesh the trainer's strategy shards the target over, or None when it replicates it
    (any strategy but ``fsdp_target``, or no trainer)."""
    return getattr(getattr(trainer, "strategy", None), "target_mesh", None) if trainer is not None else None


def resident_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and buffers this rank holds for ``module``: the local shard of a DTensor, the
    whole tensor otherwise (a tensor shared by several names counted once)."""
    total = 0
    for t in {id(t): t for t in (*module.parameters(), *module.buffers())}.values():
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def shard_target(model: nn.Module, mesh) -> nn.Module:
    """Shard a Hugging Face ``*ForCausalLM`` in place with FSDP2 across ``mesh``: one unit per decoder layer, one
    for the rest of the base model (embedding, final norm), one for the LM head. A tied LM head is first untied
    into its own copy (V*H_t/W more bytes per rank), since one weight cannot live in two FSDP units, and draftkit
    calls the base model and the LM head separately (teacher logits only where the loss reads them).

    Args:
        model: the target, frozen; its parameters may be on ``meta`` (then materialise and load them after).
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks.

    Returns:
        ``model``, its parameters now DTensors sharded on dim 0.

    Raises:
        ValueError: for a target without ``model.model.layers`` (Llama-style).
    """
    from torch.distributed.fsdp import fully_shard

    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise ValueError(f"unsupported target {type(model).__name__} for trainer.strategy fsdp_target: expected "
                         "model.model.layers (Llama-style); use trainer.strategy ddp")
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    for layer in base.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(base, mesh=mesh, reshard_after_forward=True)
    fully_shard(head, mesh=mesh, reshard_after_forward=True)
    return model


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a model directory (``model.safetensors`` or a sharded index)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise ValueError(
            f"target {path} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
            "trainer.strategy fsdp_target reads each rank's rows from them: save the target with "
            "save_pretrained(safe_serialization=True), or use trainer.strategy ddp"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_sharded_target(ref: str, dtype: str | torch.dtype, mesh, device: torch.device | str):
    """Load a frozen target already sharded across ``mesh``; each rank reads only its 1/W of each tensor.

    1. The config and tokenizer are read; the model is built with parameters on ``meta`` (buffers real).
    2. :func:`shard_target` (FSDP2 per decoder layer, base remainder, LM head), then the shards are allocated
       empty on ``device`` and the buffers put back.
    3. For every parameter, rank r reads rows [r*c, r*c + n_r) of its checkpoint tensor (c = ceil(rows / W),
       FSDP2's dim-0 chunking; n_r its local rows) and casts them to ``dtype``. A tied LM head reads the
       embedding's rows.

    Args:
        ref: target reference (``draftkit.artifacts.resolve_model_dir``).
        dtype: target dtype (``auto`` resolved for ``device``, ``bfloat16``, ``float32``, ...).
        mesh: the 1-D data-parallel ``DeviceMesh`` (:func:`target_mesh`).
        device: this rank's device.

    Returns:
        (model in eval mode with grads off and DTensor parameters, tokenizer), like ``load_target``.

    Raises:
        ValueError: when the target has no safetensors weights or a parameter's tensor is missing from them
            (naming it), or the target is not Llama-style.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from draftkit.artifacts import resolve_model_dir
    from draftkit.precision import as_torch_dtype

    device = torch.device(device)
    path = Path(resolve_model_dir(ref))
    torch_dtype = as_torch_dtype(dtype, device.type, "target dtype")
    files = _weight_files(path)
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.eval().requires_grad_(False)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    embed_name = names[id(model.get_input_embeddings().weight)]
    head_name = f"{next(n for n, m in model.named_modules() if m is model.get_output_embeddings())}.weight"
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    shard_target(model, mesh)
    model.to_empty(device=device)
    for name, buf in model.named_buffers():
        buf.copy_(buffers[name])
    rank, world = mesh.get_local_rank(), mesh.size()
    handles: dict[Path, object] = {}
    try:
        for name, param in model.named_parameters():
            key = embed_name if name == head_name and name not in files else name
            if key not in files:
                raise ValueError(f"target {ref}: tensor {key!r} of parameter {name} is not in the safetensors files "
                                 f"of {path}; trainer.strategy fsdp_target needs checkpoint names equal to the "
                                 "model's (Llama-style); use trainer.strategy ddp for this target")
            f = handles.get(files[key]) or handles.setdefault(files[key], safe_open(str(files[key]), framework="pt"))
            local = param.to_local()  # (n_r, ...) this rank's rows
            rows = f.get_slice(key).get_shape()[0]
            start = rank * math.ceil(rows / world)
            with torch.no_grad():
                local.copy_(f.get_slice(key)[start:start + local.shape[0]].to(torch_dtype))
    finally:
        handles.clear()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


@dataclass
class MemoryEstimate:
    """Bytes per GPU of one training step, by part (:func:`estimate_memory`).

    Attributes:
        strategy: ``ddp`` (the target replicated) or ``fsdp_target`` (sharded over ``world`` ranks).
        world: data-parallel ranks the target is sharded over (1 under ``ddp``).
        target: the target's resident weights (its shard under ``fsdp_target``).
        gathered: target weights whole at once during its forward under ``fsdp_target`` (two decoder layers,
            the one running and the next being gathered, plus the embedding, gathered for the whole base
            forward); 0 under ``ddp``.
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
        gathered=(2 * layer + embed) * target_bytes if sharded else 0,
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
