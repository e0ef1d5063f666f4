"""The hidden-state cache writer: runs the frozen target over a recipe's tokenized splits and writes the offline
cache (format and reader: ``draftkit.data.hidden_cache``), one share of the shards per rank, with progress.

Used by ``draftkit cache-hidden-states`` and by ``fit`` with ``data.hidden_states_cache: auto``
(:func:`write_auto_cache`, called when the module builds its head, after the callbacks chose the aux layers).

Who writes what (:func:`write_hidden_states`): rank 0 checks the free disk for every shard still missing,
of all ranks, and writes the index with ``complete: false`` before any shard is written; rank r then writes
the k-th missing shard for every k ≡ r (mod world size) and its part index, without waiting for the others;
after a barrier rank 0 checks every part and shard and rewrites the index atomically with ``complete: true``.
The files are the same bytes whatever the number of ranks. Every shard is written to a temporary file and
moved into place with ``os.replace``, so a shard that exists is complete, and an interrupted run resumes by
writing only the missing shards (a shard whose header disagrees with the index counts as missing).

Shapes: B batch, T tokens (padded), S tokens of a shard, H_t target hidden, n_aux aux layers.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftkit.data.collate import collate
from draftkit.data.hidden_cache import (
    FINGERPRINT_FIELDS,
    FORMAT,
    INDEX,
    HiddenStateCache,
    bytes_per_token,
    cache_key,
    plan_shards,
    shard_problem,
)
from draftkit.jsonio import atomic_path, write_json_atomic
from draftkit.target.frozen import config_fingerprint

__all__ = ["complete_cache_result", "write_auto_cache", "write_hidden_states", "write_recipe_cache"]

log = logging.getLogger(__name__)


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _part_path(output: Path, rank: int, world_size: int) -> Path:
    """Rank ``rank``'s part index: the shards it wrote in this run (merged into ``index.json`` by rank 0)."""
    return output / f"index.part-{rank:05d}-of-{world_size:05d}.json"


def _relay(broadcast: Callable[[object], object], rank: int, step: Callable[[], object]):
    """Run ``step`` on rank 0 and broadcast its result, or its error, so every rank returns or raises the same.

    Rank 0 re-raises its own exception; the other ranks raise a ``ValueError`` or ``OSError`` (same errno) with
    its message, instead of waiting forever for a rank that has stopped.
    """
    result = error = None
    if rank == 0:
        try:
            result = step()
        except (ValueError, OSError) as e:
            error = e
    sent = broadcast({"result": result, "error": None if error is None else (
        "OSError" if isinstance(error, OSError) else "ValueError", getattr(error, "errno", None), str(error))})
    if error is not None:
        raise error
    if sent["error"] is not None:
        kind, code, message = sent["error"]
        raise OSError(code, message) if kind == "OSError" else ValueError(message)
    return sent["result"]


def write_hidden_states(
    output: str | Path,
    splits: dict[str, Sequence[dict]],
    fingerprint: dict,
    forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    hidden_size: int,
    num_aux_layers: int,
    batch_size: int = 8,
    shard_tokens: int = 1 << 17,
    pad_token_id: int = 0,
    dry_run: bool = False,
    on_plan: Callable[[dict], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    broadcast: Callable[[object], object] | None = None,
    lockstep: bool = False,
) -> dict:
    """Write (or finish writing) a hidden-state cache, one share per rank.

    1. Every rank plans the shards of every split (:func:`plan_shards`, deterministic); if ``output`` already
       holds an index, it must have the same fingerprint and plan, and its complete shards are kept.
    2. Rank 0 lists the shards still missing (all ranks' shares), computes the bytes of that whole remainder
       (bytes per token × its tokens, plus headers) and stops every rank with an error before anything is
       written when the disk has less free space; else it writes the index with ``complete: false`` and
       broadcasts the list.
    3. Rank r writes the k-th missing shard for every k ≡ r (mod ``world_size``) (sequences sorted by length
       into batches of ``batch_size`` for the target forward, states cast to bf16, padding dropped), each to a
       temporary file moved into place (``jsonio.atomic_path``), then its part index
       ``index.part-<r>-of-<world_size>.json``. No rank waits for another while writing.
    4. After ``barrier()``, rank 0 checks every part index and every shard header against the index, writes
       the index with ``complete: true`` (atomically) and removes the part indexes; the totals are broadcast,
       so every rank returns once the cache is complete.

    The cache directory must be one filesystem seen by every rank (rank 0 checks its free space and merges).
    The files do not depend on ``world_size``: any number of ranks writes the same bytes as one process.
    With ``lockstep`` (a target sharded across the ranks, whose every forward gathers each layer from all of
    them), every rank runs as many forwards as the busiest rank: after its share (or its error) a rank runs
    one-token forwards whose output is dropped until it reaches that count, known to every rank from the plan.

    Args:
        output: cache directory (created).
        splits: split name -> tokenized rows in split order (a ``datasets.Dataset`` or a list of dicts with
            ``input_ids`` and ``loss_mask`` lists); the same on every rank.
        fingerprint: the :data:`FINGERPRINT_FIELDS` of this configuration.
        forward: ``(input_ids (B, T) int64, attention_mask (B, T) int64) -> (aux (B, T, n_aux*H_t),
            last (B, T, H_t))``, the frozen target (on this rank's device).
        hidden_size: H_t.
        num_aux_layers: n_aux.
        batch_size: sequences per target forward.
        shard_tokens: token budget per shard.
        pad_token_id: id written into padding for the forward.
        dry_run: plan and check the disk only.
        on_plan: called on rank 0 with the plan (dict with ``bytes_per_token``, ``tokens``, ``bytes_needed``,
            ``bytes_free``, ``shards_done``, ``shards_todo``, ``world_size``) before anything is written.
        rank: this process's global rank, in ``[0, world_size)``.
        world_size: number of writing processes.
        barrier: blocks until every rank calls it (e.g. a Lightning strategy's ``barrier``); needed when
            ``world_size > 1``.
        broadcast: ``obj -> rank 0's obj`` on every rank (e.g. a Lightning strategy's ``broadcast``); needed
            when ``world_size > 1``.
        lockstep: every rank runs the same number of target forwards (a sharded target, see above).

    Returns:
        The plan plus the totals over all ranks ``tokens_written``, ``bytes_written``, ``seconds`` (rank 0's
        wall time, writing and merging), ``tokens_per_s``, ``mb_per_s``, and ``ranks``: per rank
        ``{"shards" (file names), "tokens_written", "bytes_written", "seconds"}``. The same dict on every rank.

    Raises:
        ValueError: when ``output`` holds a cache for another fingerprint or shard plan, the target's states
            of a row are non-finite (naming the split row; that shard is not written, so no cache holds NaN),
            a rank did not leave its part index or shard (naming the file), or ``rank``/``world_size``/
            ``barrier``/``broadcast`` are inconsistent.
        OSError: (ENOSPC) when the disk has less free space than the rest of the cache needs, on every rank.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"hidden-state cache: rank {rank} is outside [0, world_size={world_size})")
    if world_size > 1 and (barrier is None or broadcast is None):
        raise ValueError(f"hidden-state cache: world_size={world_size} needs a barrier and a broadcast (the trainer's strategy)")
    barrier = barrier or (lambda: None)
    broadcast = broadcast or (lambda obj: obj)
    output = Path(output).expanduser()
    index = _index(splits, fingerprint, hidden_size, num_aux_layers, shard_tokens)
    bpt = index["bytes_per_token"]
    width = (index["aux_width"], hidden_size)
    shards = {shard["file"]: (name, shard) for name, spec in index["splits"].items() for shard in spec["shards"]}

    def plan_and_check() -> dict:
        """Rank 0: the plan of the whole remaining cache, checked against the free disk; the index started."""
        _check_existing(output, index)
        todo = [f for f, (_, shard) in shards.items() if shard_problem(output / f, shard, width) is not None]
        plan = _plan(output, index, todo, world_size)
        tokens = plan["tokens"]
        if on_plan is not None:
            on_plan(plan)
        if plan["bytes_needed"] > plan["bytes_free"]:
            raise OSError(
                errno.ENOSPC,
                f"not enough disk for the hidden-state cache in {output}: the {len(todo)} shards still to write "
                f"(all {world_size} ranks') need {plan['bytes_needed']} bytes ({plan['bytes_needed'] / 1e9:.2f} GB: "
                f"{bpt} bytes/token x {tokens} tokens plus headers), {plan['bytes_free']} bytes free; free space, "
                "choose another --output, or lower data.max_conversations / data.max_length",
            )
        if not dry_run:
            output.mkdir(parents=True, exist_ok=True)
            for stale in [*output.glob(".*.safetensors.*"), *output.glob(".index*"), *output.glob("index.part-*.json")]:
                stale.unlink(missing_ok=True)  # temporaries and part indexes of a killed run (no rank writes yet)
            write_json_atomic(output / INDEX, index, indent=1)
        return {"plan": plan, "todo": todo}

    started = _relay(broadcast, rank, plan_and_check)
    plan, todo = started["plan"], started["todo"]
    if dry_run:
        return plan
    t0, written, nbytes, failure = time.perf_counter(), 0, 0, None
    mine = todo[rank::world_size]
    calls = [0]

    def counted(ids: torch.Tensor, attn: torch.Tensor):
        calls[0] += 1
        return forward(ids, attn)

    try:
        for file in mine:
            name, shard = shards[file]
            rows = [splits[name][i] for i in range(*shard["rows"])]
            nbytes += _write_shard(output / file, rows, counted, batch_size, pad_token_id, name, shard)
            written += shard["num_tokens"]
            dt = time.perf_counter() - t0
            log.info("rank %d wrote %s (%d tokens; %.0f tokens/s so far)", rank, file, shard["num_tokens"], written / max(dt, 1e-9))
    except (ValueError, OSError) as e:  # reported through the part index, so no rank waits for a stopped one
        failure = e
    if lockstep:  # the busiest rank's forwards: one per batch of batch_size sequences of each of its shards
        busiest = max(sum(-(-(shards[f][1]["rows"][1] - shards[f][1]["rows"][0]) // batch_size) for f in todo[r::world_size])
                      for r in range(world_size))
        one = torch.full((1, 1), pad_token_id, dtype=torch.long)  # (1, 1)
        with torch.no_grad():
            while calls[0] < busiest:
                counted(one, torch.ones_like(one))
    part = {"format": FORMAT, "rank": rank, "world_size": world_size, "shards": mine, "tokens_written": written,
            "bytes_written": nbytes, "seconds": time.perf_counter() - t0, "error": None if failure is None else str(failure)}
    write_json_atomic(_part_path(output, rank, world_size), part, indent=1)
    barrier()

    def merge() -> dict:
        """Rank 0: every rank's part and every shard checked, then the index marked complete."""
        parts = []
        for r in range(world_size):
            path = _part_path(output, r, world_size)
            if not path.exists():
                raise ValueError(f"hidden-state cache: rank {r} left no part index {path}; rerun the same command to finish the cache")
            parts.append(json.loads(path.read_text()))
            if parts[-1]["error"] is not None:
                raise ValueError(f"hidden-state cache: rank {r} stopped: {parts[-1]['error']}")
        for file, (_, shard) in shards.items():
            problem = shard_problem(output / file, shard, width)
            if problem is not None:
                raise ValueError(
                    f"hidden-state cache shard {output / file} is {problem} after every rank finished; is {output} "
                    "one filesystem shared by all ranks? Rerun the same command to finish the cache"
                )
        write_json_atomic(output / INDEX, {**index, "complete": True}, indent=1)
        for r in range(world_size):
            _part_path(output, r, world_size).unlink()
        seconds = time.perf_counter() - t0
        total, total_bytes = sum(p["tokens_written"] for p in parts), sum(p["bytes_written"] for p in parts)
        return {
            "tokens_written": total, "bytes_written": total_bytes, "seconds": seconds,
            "tokens_per_s": total / max(seconds, 1e-9), "mb_per_s": total_bytes / 1e6 / max(seconds, 1e-9),
            "ranks": [{k: p[k] for k in ("shards", "tokens_written", "bytes_written", "seconds")} for p in parts],
        }

    try:
        merged = _relay(broadcast, rank, merge)
    except (ValueError, OSError):
        if failure is not None:
            raise failure from None  # this rank's own error, with its type
        raise
    return {**plan, **merged}


def _index(splits: dict[str, Sequence[dict]], fingerprint: dict, hidden_size: int, num_aux_layers: int,
           shard_tokens: int) -> dict:
    """The index :func:`write_hidden_states` writes for this configuration (``complete: false``), its shard plan
    included (arguments as there)."""
    lengths = {name: [len(r["input_ids"]) for r in rows] for name, rows in splits.items()}
    return {
        "format": FORMAT, "complete": False, "fingerprint": fingerprint,
        "bytes_per_token": bytes_per_token(hidden_size, num_aux_layers),
        "hidden_size": hidden_size, "aux_width": num_aux_layers * hidden_size, "dtype": "bfloat16",
        "splits": {
            name: {
                "num_sequences": len(lengths[name]), "num_tokens": sum(lengths[name]),
                "shards": plan_shards(lengths[name], name, shard_tokens),
            }
            for name in splits
        },
    }


def _plan(output: Path, index: dict, todo: list[str], world_size: int) -> dict:
    """The plan :func:`write_hidden_states` reports (and passes to ``on_plan``) when the shard files ``todo``
    of ``index`` are still to be written."""
    shards = {shard["file"]: shard for spec in index["splits"].values() for shard in spec["shards"]}
    tokens = sum(shards[f]["num_tokens"] for f in todo)
    return {
        "output": str(output), "bytes_per_token": index["bytes_per_token"], "tokens": tokens,
        "tokens_total": sum(s["num_tokens"] for s in index["splits"].values()),
        "bytes_needed": tokens * index["bytes_per_token"]
        + sum(8 * (shards[f]["rows"][1] - shards[f]["rows"][0] + 1) + 4096 for f in todo),
        "bytes_free": _free_bytes(output), "shards_done": len(shards) - len(todo), "shards_todo": len(todo),
        "world_size": world_size,
    }


def complete_cache_result(
    output: str | Path,
    splits: dict[str, Sequence[dict]],
    fingerprint: dict,
    hidden_size: int,
    num_aux_layers: int,
    shard_tokens: int = 1 << 17,
    dry_run: bool = False,
    on_plan: Callable[[dict], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
    broadcast: Callable[[object], object] | None = None,
) -> dict | None:
    """What :func:`write_hidden_states` would return for ``output`` when that cache is already complete for this
    configuration, found without a target forward and without writing anything; None when it would write.

    Complete means what :func:`write_hidden_states` and the readers check: :class:`HiddenStateCache` opens it
    (a draftkit index marked ``complete``), its fingerprint and shard plan equal this configuration's (as
    :func:`write_hidden_states` requires of an existing index), and :meth:`HiddenStateCache.verify` passes for
    every split (each shard's header matches the index). Anything else (no index, an interrupted cache, another
    fingerprint or plan, a missing or truncated shard) returns None, so that :func:`write_hidden_states`
    finishes the cache or refuses it with its own error. Rank 0 decides and broadcasts, so every rank returns
    the same.

    Args:
        output, splits, fingerprint, hidden_size, num_aux_layers, shard_tokens, dry_run, on_plan, rank,
            world_size, broadcast: as :func:`write_hidden_states` (``on_plan`` is called on rank 0 only when the
            cache is complete, with 0 shards to write).

    Returns:
        The plan (``shards_todo`` 0, ``tokens`` 0), plus, unless ``dry_run``, the totals of a run that wrote
        nothing (``tokens_written`` 0, ``bytes_written`` 0, ``seconds`` 0.0, ``ranks`` of empty shares); or None.
    """
    output = Path(output).expanduser()
    index = _index(splits, fingerprint, hidden_size, num_aux_layers, shard_tokens)

    def check() -> dict | None:
        try:
            cache = HiddenStateCache(output)
            _check_existing(output, index)
            for split in index["splits"]:
                cache.verify(split)
        except (FileNotFoundError, ValueError):
            return None
        plan = _plan(output, index, [], world_size)
        if on_plan is not None:
            on_plan(plan)
        return plan

    plan = _relay(broadcast or (lambda obj: obj), rank, check)
    if plan is None or dry_run:
        return plan
    share = {"shards": [], "tokens_written": 0, "bytes_written": 0, "seconds": 0.0}
    return {**plan, "tokens_written": 0, "bytes_written": 0, "seconds": 0.0, "tokens_per_s": 0.0, "mb_per_s": 0.0,
            "ranks": [dict(share) for _ in range(world_size)]}


def _check_existing(output: Path, index: dict) -> None:
    """Refuse an ``output`` whose index has another fingerprint or shard plan than ``index``."""
    old_path = output / INDEX
    if not old_path.exists():
        return
    old = json.loads(old_path.read_text())
    if old.get("fingerprint") != index["fingerprint"]:
        diffs = [k for k in FINGERPRINT_FIELDS if old.get("fingerprint", {}).get(k) != index["fingerprint"].get(k)]
        raise ValueError(
            f"{output} already holds a hidden-state cache for another configuration (differs in {diffs}); "
            "choose another --output or delete that directory"
        )
    if old.get("splits") != index["splits"]:
        raise ValueError(
            f"{output} already holds a cache of this configuration with another shard plan; rerun with the "
            "same --shard_mb, or delete the directory"
        )


def write_recipe_cache(
    model,
    dm,
    precision: str,
    output: str | Path | None = None,
    batch_size: int | None = None,
    shard_mb: float = 512.0,
    dry_run: bool = False,
    device: str = "auto",
    on_plan: Callable[[dict], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
    broadcast: Callable[[object], object] | None = None,
    mesh=None,
) -> dict:
    """Write (or finish) the hidden-state cache of a built recipe: its frozen target over its tokenized train
    and val splits, under its precision (bf16 autocast for ``bf16-mixed``), so that the cached states equal
    the ones online training computes. Used by ``draftkit cache-hidden-states`` and by ``fit`` with
    ``data.hidden_states_cache: auto``. Under several processes every rank loads the target on its own
    device and writes its share of the shards (:func:`write_hidden_states`).

    A cache that is already complete for this configuration (:func:`complete_cache_result`) is reused without
    loading the target's weights: the fingerprint is first computed from the target's config (``config.json``,
    through ``AutoConfig``, as offline training's check reads it), the resolved ``target_dtype``, the aux layer
    ids and ``dm.cache_fingerprint()`` (the tokenizer and the tokenized data). Otherwise (no cache, an
    interrupted one, a mismatch) the target is loaded and everything runs as without that check: the
    fingerprint from the loaded target, the same shards written, the same error for another configuration.

    Args:
        model: an ``Eagle3Module`` (reads ``resolve_target_dtype()``, ``load_target_model()`` and
            ``hparams.target``/``target_dtype``/``aux_layer_ids``); unless the cache is complete its target is
            loaded in full here; it is released after either way (``release_target_model``).
        dm: a ``ChatDataModule`` after ``setup`` (``train_set``, ``val_set``, ``cache_fingerprint()``).
        precision: the trainer's precision string (e.g. ``bf16-mixed``, ``32-true``).
        output: cache directory; default ``<draftkit cache>/hidden-states/<cache_key(fingerprint)>``.
        batch_size: sequences per target forward (default: ``data.batch_size``).
        shard_mb: shard size in MB (1e6 bytes).
        dry_run: only plan and check the disk.
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:<index>`` (this rank's device).
        on_plan: called on rank 0 with the plan before anything is written (see :func:`write_hidden_states`).
        rank, world_size, barrier, broadcast: this process's share and the collectives (see
            :func:`write_hidden_states`); e.g. a Lightning strategy's ``global_rank``, ``world_size``,
            ``barrier`` and ``broadcast``.
        mesh: a 1-D ``DeviceMesh`` over the ranks to shard the target over
            (``draftkit.target.sharding.load_sharded_target``: no rank loads it whole), or None for
            ``model.load_target_model()`` (which shards it itself under ``trainer.strategy fsdp_target``). A
            sharded target writes in lockstep (:func:`write_hidden_states`).

    Returns:
        :func:`write_hidden_states`' result (for a complete cache: 0 shards written) plus ``output`` (str),
        ``precision`` and ``device``.

    Raises:
        ValueError: when ``output`` holds a cache for another configuration.
        OSError: when the disk is short (before anything is written).
    """
    from contextlib import nullcontext

    from transformers import AutoConfig

    from draftkit.artifacts import cache_dir, resolve_model_dir
    from draftkit.selection.layers import validate_aux_layer_ids
    from draftkit.target.frozen import FrozenTarget, text_config

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    splits = {"train": dm.train_set, "val": dm.val_set}
    data_fingerprint = dm.cache_fingerprint()  # the tokenizer (loaded, not the model) and the tokenized data

    def fingerprint_of(config, aux_layer_ids: list[int]) -> dict:
        return {"target": model.hparams.target, "target_config": config_fingerprint(config),
                "target_dtype": model.hparams.target_dtype, "aux_layer_ids": list(aux_layer_ids), **data_fingerprint}

    def out_dir_of(fingerprint: dict) -> Path:
        return Path(output or cache_dir() / "hidden-states" / cache_key(fingerprint))

    def shard_tokens(hidden_size: int, num_aux: int) -> int:
        return max(1, int(shard_mb * 1e6) // bytes_per_token(hidden_size, num_aux))

    model.resolve_target_dtype()  # the dtype load_target_model loads in: the fingerprint's target_dtype
    config = text_config(AutoConfig.from_pretrained(resolve_model_dir(model.hparams.target)))
    aux_ids = validate_aux_layer_ids(model.hparams.aux_layer_ids, config.num_hidden_layers)
    fingerprint = fingerprint_of(config, aux_ids)
    out_dir = out_dir_of(fingerprint)
    reused = complete_cache_result(
        out_dir, splits, fingerprint, config.hidden_size, len(aux_ids),
        shard_tokens=shard_tokens(config.hidden_size, len(aux_ids)), dry_run=dry_run, on_plan=on_plan, rank=rank,
        world_size=world_size, broadcast=broadcast,
    )
    if reused is not None:
        log.info("hidden-state cache %s is complete for this configuration: reused, the target not loaded", out_dir)
        if hasattr(model, "release_target_model"):
            model.release_target_model()
        return {**reused, "output": str(out_dir), "precision": str(precision), "device": device}

    if mesh is None:
        hf_model, _ = model.load_target_model()
    else:
        from draftkit.target.sharding import load_sharded_target

        hf_model, _ = load_sharded_target(model.hparams.target, model.hparams.target_dtype, mesh, device)
    sharded = any(hasattr(p, "to_local") for p in hf_model.parameters())  # DTensor shards: forwards are collective
    target = FrozenTarget(hf_model.to(device), model.hparams.aux_layer_ids)
    fingerprint = fingerprint_of(target.config, target.aux_layer_ids)
    out_dir = out_dir_of(fingerprint)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if "bf16" in str(precision) else nullcontext()

    def forward(ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast:
            out = target(ids.to(device), attention_mask=attn.to(device), compute_logits=False)
        return out.aux_hidden_states, out.last_hidden_state  # (B, T, n*H_t), (B, T, H_t)

    result = write_hidden_states(
        out_dir, splits, fingerprint, forward, target.hidden_size, len(target.aux_layer_ids),
        batch_size=batch_size or dm.hparams.batch_size,
        shard_tokens=shard_tokens(target.hidden_size, len(target.aux_layer_ids)), pad_token_id=dm.pad_token_id,
        dry_run=dry_run, on_plan=on_plan, rank=rank, world_size=world_size, barrier=barrier, broadcast=broadcast,
        lockstep=sharded,
    )
    del target, hf_model
    if hasattr(model, "release_target_model"):  # training from the cache needs only the target's LM head
        model.release_target_model()
    return {**result, "output": str(out_dir), "precision": str(precision), "device": device}


def _log_plan(plan: dict) -> None:
    log.info(
        "hidden-state cache %s: %.3f GB to write (%d bytes/token x %d tokens, %d shards; %d already complete), "
        "%.1f GB free", plan["output"], plan["bytes_needed"] / 1e9, plan["bytes_per_token"], plan["tokens"],
        plan["shards_todo"], plan["shards_done"], plan["bytes_free"] / 1e9,
    )


def write_auto_cache(dm, model) -> None:
    """``hidden_states_cache: auto``: every rank writes its share of (or finishes, or finds complete) the cache
    of this run's target, data and aux layers with ``model``'s target, the trainer's precision and its own device;
    rank 0 merges the index; every rank then trains from it (``dm.open_hidden_states``). The module calls it with
    itself when it builds its head (``Eagle3Module.build``), once the aux layers are final.

    Args:
        dm: a ``ChatDataModule`` after ``setup``, attached to a trainer.
        model: the ``Eagle3Module`` that owns the target (its ``target_handle``, through
            ``load_target_model``/``release_target_model``) and the aux layers.

    Raises:
        ValueError: outside a trainer (the cache is written with the trainer's ranks and precision).
    """
    trainer = dm.trainer
    if trainer is None:
        raise ValueError(
            "data.hidden_states_cache: auto is resolved by `fit` (it needs the module's target); elsewhere "
            "write the cache with `python -m draftkit cache-hidden-states --recipe ...` and pass its directory"
        )
    s = trainer.strategy
    log.info("data.hidden_states_cache: auto: a complete cache for this target, data and aux layers is reused; "
             "otherwise one target pass over the data first (complete shards are kept)")
    dm.open_hidden_states(write_recipe_cache(
        model, dm, str(trainer.precision), on_plan=_log_plan, device=str(s.root_device),
        rank=s.global_rank, world_size=s.world_size, barrier=s.barrier, broadcast=s.broadcast,
    )["output"])
    dm.auto_cache_pending = False


@torch.no_grad()
def _write_shard(path: Path, rows, forward, batch_size: int, pad_token_id: int, split: str, shard: dict) -> int:
    """Run the target on one shard's rows and write the shard atomically; return its size in bytes."""
    n = len(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    aux: list = [None] * n
    last: list = [None] * n
    by_length = sorted(range(n), key=lambda j: -lengths[j])  # less padding per forward
    for start in range(0, n, batch_size):
        js = by_length[start:start + batch_size]
        batch = collate([rows[j] for j in js], pad_token_id)
        a, h = forward(batch["input_ids"], batch["attention_mask"])  # (B, T, n_aux*H_t), (B, T, H_t)
        a, h = a.to(torch.bfloat16), h.to(torch.bfloat16)
        # checked where the target ran, once a batch (the padding, right of each row, is not stored)
        pad = torch.arange(a.shape[1], device=a.device)[None] >= torch.tensor([lengths[j] for j in js],
                                                                              device=a.device)[:, None]  # (B, T)
        finite = bool((torch.isfinite(a).all(-1) & torch.isfinite(h).all(-1) | pad).all())
        a, h = a.cpu(), h.cpu()  # one copy each a batch
        for i, j in enumerate(js):
            aux[j] = a[i, : lengths[j]]  # (T_j, n_aux*H_t)
            last[j] = h[i, : lengths[j]]  # (T_j, H_t)
            if not finite and not (bool(torch.isfinite(aux[j]).all()) and bool(torch.isfinite(last[j]).all())):
                name = rows[j].get("record") if hasattr(rows[j], "get") else None
                raise ValueError(
                    f"the target's hidden states of {split} row {shard['rows'][0] + j}"
                    f"{f' (record {name})' if name else ''} are non-finite (NaN/inf; after the bf16 cast: "
                    f"{int((~torch.isfinite(aux[j])).sum())} aux, {int((~torch.isfinite(last[j])).sum())} last); "
                    f"nothing of {path.name} was written. Run the target in float32 (model.target_dtype) or drop "
                    "that conversation"
                )
    offsets = torch.zeros(n + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    tensors = {
        "input_ids": torch.cat([torch.as_tensor(r["input_ids"], dtype=torch.int32) for r in rows]),  # (S,)
        "loss_mask": torch.cat([torch.as_tensor(r["loss_mask"], dtype=torch.uint8) for r in rows]),  # (S,)
        "aux_hidden_states": torch.cat(aux),  # (S, n_aux*H_t)
        "last_hidden_state": torch.cat(last),  # (S, H_t)
        "offsets": offsets,  # (n+1,)
    }
    with atomic_path(path) as tmp:  # safetensors would create a 0600 file; shards are shared like any output
        # one metadata key: safetensors stores the metadata as a hash map whose key order differs per process,
        # so several keys would make equal shards differ in their header bytes
        save_file(tensors, str(tmp), metadata={"draftkit": json.dumps({"format": FORMAT, "split": split, "rows": shard["rows"]})})
    return path.stat().st_size
