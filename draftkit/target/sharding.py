"""The frozen target sharded across the data-parallel ranks with FSDP2.

Under ``trainer.strategy: fsdp_target`` (``draftkit.strategy.ShardedTargetStrategy``) no rank holds the whole
target: every decoder layer is its own FSDP2 unit (``torch.distributed.fsdp.fully_shard``), and so are the input
embedding, the LM head and the base model's remainder (final norm). Each rank keeps 1/W of every weight (a
DTensor shard on dim 0, W = world size); a unit's forward all-gathers its weights, runs, and frees them again
(``reshard_after_forward``), so at most a layer or two, or the embedding (or LM head) and a layer, are whole at
once. Each unit keeps the target dtype; the target is frozen, so no gradient is reduced for it,
and the head beside it stays a plain replicated module (DDP all-reduces its gradients, Muon sees whole
matrices).

Loading (:func:`load_sharded_target`): the model is built with its parameters on the ``meta`` device (buffers
such as RoPE frequencies are real), sharded, materialised empty on this rank's device, and each rank reads
only its own rows of every tensor from the target's safetensors files (``safe_open(...).get_slice``).

The memory a run needs per GPU under either form is ``draftkit.models.memory``.

Shapes: V target vocab, H_t target hidden, N target layers, W world size (data-parallel ranks).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

__all__ = ["load_sharded_target", "resident_bytes", "shard_target", "target_mesh"]


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
    for the input embedding, one for the rest of the base model (final norm), one for the LM head. A tied LM head is first untied
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
    for layer in (model.get_input_embeddings(), *base.layers):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(base, mesh=mesh, reshard_after_forward=True)
    fully_shard(head, mesh=mesh, reshard_after_forward=True)
    return model


def load_sharded_target(ref: str, dtype: str | torch.dtype, mesh, device: torch.device | str):
    """Load a frozen target already sharded across ``mesh``; each rank reads only its 1/W of each tensor.

    1. The config and tokenizer are read; the model is built with parameters on ``meta`` (buffers real).
    2. :func:`shard_target` (FSDP2 per decoder layer, embedding, base remainder, LM head), then the shards are allocated
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

    from draftkit.artifacts import resolve_model_dir, safetensors_weight_map
    from draftkit.precision import as_torch_dtype

    device = torch.device(device)
    path = Path(resolve_model_dir(ref))
    torch_dtype = as_torch_dtype(dtype, device.type, "target dtype")
    files = safetensors_weight_map(path)
    if files is None:
        raise ValueError(
            f"target {path} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
            "trainer.strategy fsdp_target reads each rank's rows from them: save the target with "
            "save_pretrained(safe_serialization=True), or use trainer.strategy ddp"
        )
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
