"""``draftkit cache-hidden-states --recipe R [--output DIR]``: write a recipe's offline cache.

Runs the recipe's frozen target once over its tokenized train and val splits and stores the aux hidden
states and the last hidden state (bf16), with ``input_ids`` and ``loss_mask``, as sharded safetensors files
plus ``index.json`` (format: ``draftkit.data.hidden_cache``). Before writing it prints the disk it will need
(bytes per token x tokens) and stops if the disk is short. Rerunning the same command finishes an
interrupted cache: complete shards are kept. Then train with ``--data.hidden_states_cache DIR``.

Extra ``--model.*``, ``--data.*`` and ``--trainer.*`` arguments override the recipe (e.g. ``--data.max_conversations 200``).
Launched by ``torchrun --nproc_per_node N -m draftkit cache-hidden-states ...`` (``WORLD_SIZE`` > 1), every
process runs the target on its own GPU (``cuda:LOCAL_RANK``; gloo on CPU) and writes its share of the shards;
rank 0 checks the disk for the whole cache first and merges the index (``draftkit.generation.hidden_states``). The
files equal those of one process. With ``--trainer.strategy fsdp_target`` the target is sharded across the
processes (``draftkit.target.sharding``: no process loads it whole) and they run its forwards in lockstep. The
forward runs under the recipe's precision (bf16 autocast for ``bf16-mixed``; unset = the precision policy,
``draftkit.precision``), so the cached states equal the ones online training computes.
"""

from __future__ import annotations

import logging
from typing import Optional


__all__ = ["cache_hidden_states"]

log = logging.getLogger(__name__)


def _print_plan(plan: dict) -> None:
    print(
        f"draftkit cache-hidden-states: {plan['output']}\n"
        f"  needs {plan['bytes_needed'] / 1e9:.3f} GB = {plan['bytes_per_token']} bytes/token x {plan['tokens']} "
        f"tokens ({plan['shards_todo']} shards to write, {plan['shards_done']} already complete); "
        f"{plan['bytes_free'] / 1e9:.1f} GB free",
        flush=True,
    )


def _process_group(device: str) -> tuple[int, int, object, object, str, bool]:
    """``(rank, world_size, barrier, broadcast, device, created)`` of a ``torchrun`` launch (``WORLD_SIZE`` > 1):
    the process group is initialised from the environment (nccl on CUDA, gloo on CPU) and ``device`` becomes
    ``cuda:LOCAL_RANK``; one process (``0, 1, None, None, device, False``) otherwise."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, None, None, device, False
    import torch
    import torch.distributed as dist

    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if cuda else "gloo")

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    return dist.get_rank(), dist.get_world_size(), dist.barrier, broadcast, device, created


def cache_hidden_states(
    recipe: list[str],
    output: Optional[str] = None,
    overrides: Optional[list[str]] = None,
    batch_size: Optional[int] = None,
    shard_mb: float = 512.0,
    dry_run: bool = False,
    device: str = "auto",
) -> dict:
    """Write (or finish) the offline hidden-state cache of a recipe; train from it with --data.hidden_states_cache.

    Args:
        recipe: recipe YAML paths, stacked in order (old spelling -r).
        output: cache directory (old spelling -o); default: the recipe's data.hidden_states_cache, else (unset
            or ``auto``) <draftkit cache>/hidden-states/<fingerprint>, the directory ``auto`` trains from.
        overrides: more recipe arguments (--model.*, --data.*, --trainer.* given after the verb land here).
        batch_size: sequences per target forward (default: data.batch_size).
        shard_mb: target shard size in MB (1e6 bytes).
        dry_run: only print the plan and check the disk.
        device: auto (CUDA when available), cpu or cuda (under torchrun: this process's cuda:LOCAL_RANK).

    Returns:
        The plan and write statistics of ``write_hidden_states``, plus ``output``.

    Raises:
        ValueError: when ``output`` holds a cache for another configuration, or is a file.
        OSError: when the disk is short, or no file can be created where ``output`` goes (checked first).
    """
    import torch

    from draftkit.cli import DraftkitCLI
    from draftkit.data.hidden_cache import AUTO
    from draftkit.generation.hidden_states import write_recipe_cache
    from draftkit.jsonio import check_writable
    from draftkit.strategy import SHARDED_TARGET

    if output:
        check_writable(output, "--output", directory=True)  # before the target loads, not at the first shard
    args = [x for r in recipe for x in ("--recipe", r)] + list(overrides or [])
    cli = DraftkitCLI(args=args, run=False)
    model, dm, trainer = cli.model, cli.datamodule, cli.trainer
    configured = dm.hparams.hidden_states_cache
    dm.hparams.hidden_states_cache = None  # the cache is what we are writing
    dm.setup("fit")
    rank, world_size, barrier, broadcast, device, created = _process_group(device)
    mesh = None
    if world_size > 1 and getattr(trainer.strategy, "strategy_name", None) == SHARDED_TARGET:  # no rank loads it whole
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(torch.device(device).type, (world_size,))
    try:
        result = write_recipe_cache(
            model, dm, str(trainer.precision), output or (configured if configured != AUTO else None),
            batch_size=batch_size, shard_mb=shard_mb, dry_run=dry_run, device=device, on_plan=_print_plan,
            rank=rank, world_size=world_size, barrier=barrier, broadcast=broadcast, mesh=mesh,
        )
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
    result["precision_policy"] = cli.precision
    if not dry_run and rank == 0:
        print(
            f"  wrote {result['tokens_written']} tokens, {result['bytes_written'] / 1e6:.1f} MB in "
            f"{result['seconds']:.1f} s ({result['tokens_per_s']:.0f} tokens/s, {result['mb_per_s']:.1f} MB/s; "
            f"{result['device']}, {result['precision']})\n"
            f"  train from it with: --data.hidden_states_cache {result['output']}"
        )
    return result
