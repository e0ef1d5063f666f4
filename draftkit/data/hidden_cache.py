"""Offline hidden-state cache: the target's aux and last hidden states on disk, sharded safetensors + index.

Training from the cache needs no target forward: the draft head reads the stored aux hidden states, and the
teacher distribution comes from the stored last hidden state through the target's LM head alone.

Layout of a cache directory (``FORMAT``)::

    index.json                  fingerprint, bytes per token, and per split the planned shards
    train-00000.safetensors     one shard: a contiguous run of the split's sequences, tokens concatenated
    ...
    val-00000.safetensors

A shard holds, for its n sequences with S tokens in all (no padding is stored):

- ``input_ids`` (S,) int32, ``loss_mask`` (S,) uint8 (assistant tokens, unshifted, as in ``collate``);
- ``aux_hidden_states`` (S, n_aux*H_t) bf16, the aux states concatenated in ascending layer-id order;
- ``last_hidden_state`` (S, H_t) bf16, ``hidden_states[N]`` after the final norm;
- ``offsets`` (n+1,) int64: sequence j of the shard is tokens [offsets[j], offsets[j+1]).

The index is written before the first shard (with ``complete: false``) and rewritten at the end; every shard
is written to a temporary file and moved into place with ``os.replace``, so a shard that exists is complete,
and an interrupted run resumes by writing only the missing shards. Readers check every shard's header against
the index before training starts: a missing or truncated shard is an error naming the file, never skipped.

The fingerprint names what the states depend on (target reference, target config hash, target dtype, aux
layer ids, tokenizer, tokenized data and split), so a cache built for other layers, another target or
another tokenizer is refused with the field that differs.

Shapes: B batch, T tokens (padded), S tokens of a shard, H_t target hidden, n_aux aux layers.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftkit.data.collate import collate
from draftkit.jsonio import atomic_path, short_hash, write_json_atomic

__all__ = [
    "AUTO", "FORMAT", "FINGERPRINT_FIELDS", "HiddenStateCache", "OfflineDataset", "bytes_per_token", "cache_key", "collate_offline",
    "config_fingerprint", "plan_shards", "write_hidden_states", "write_recipe_cache",
]

log = logging.getLogger(__name__)

FORMAT = "draftkit-hidden-states-v1"
INDEX = "index.json"
FINGERPRINT_FIELDS = ("target", "target_config", "target_dtype", "aux_layer_ids", "tokenizer", "data")
"""Fingerprint fields in the order mismatches are reported."""
AUTO = "auto"  # data.hidden_states_cache value: fit writes (or reuses) the cache in the draftkit cache first
REBUILD = "rebuild it with `python -m draftkit cache-hidden-states --recipe ...` for this recipe"


def cache_key(fingerprint: dict) -> str:
    """16 hex digits naming a fingerprint (the default cache directory name)."""
    return short_hash(fingerprint)


def config_fingerprint(config) -> str:
    """Hash of a target's ``PretrainedConfig`` without paths, versions and dtype (16 hex digits)."""
    d = config.to_dict()
    return short_hash({k: v for k, v in d.items() if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")})


def bytes_per_token(target_hidden_size: int, num_aux_layers: int) -> int:
    """Cache bytes per token: bf16 aux (n_aux*H_t) and last (H_t) states, int32 id, uint8 mask."""
    return 2 * (num_aux_layers + 1) * target_hidden_size + 4 + 1


def plan_shards(lengths: Sequence[int], split: str, shard_tokens: int) -> list[dict]:
    """Cut a split into shards of contiguous sequences with at most ``shard_tokens`` tokens each.

    Args:
        lengths: tokens per sequence of the split, in split order.
        split: ``train`` or ``val`` (names the files).
        shard_tokens: token budget per shard (a longer single sequence gets a shard of its own).

    Returns:
        ``[{"file", "rows": [first, end), "num_tokens"}]`` covering every sequence once.
    """
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            shards.append({"file": f"{split}-{len(shards):05d}.safetensors", "rows": [start, i], "num_tokens": tokens})
            start, tokens = i, 0
        tokens += int(n)
    if len(lengths) > start:
        shards.append({"file": f"{split}-{len(shards):05d}.safetensors", "rows": [start, len(lengths)], "num_tokens": tokens})
    return shards


class HiddenStateCache:
    """A cache directory opened for reading: its index, fingerprint checks and shard verification.

    Args:
        root: the directory written by ``python -m draftkit cache-hidden-states``.

    Raises:
        FileNotFoundError: when ``root/index.json`` does not exist.
        ValueError: when the index is not a draftkit hidden-state index, or the cache is incomplete.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        path = self.root / INDEX
        if not path.exists():
            raise FileNotFoundError(f"data.hidden_states_cache: {path} does not exist; {REBUILD}")
        self.index = json.loads(path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} index (format={self.index.get('format')!r}); {REBUILD}")
        if not self.index.get("complete"):
            raise ValueError(
                f"hidden-state cache {self.root} is incomplete (writing was interrupted); rerun the same "
                "`python -m draftkit cache-hidden-states` command to finish it (complete shards are kept)"
            )

    @property
    def fingerprint(self) -> dict:
        return self.index["fingerprint"]

    def check(self, expected: dict) -> None:
        """Compare fingerprint fields with this run's; fields absent from ``expected`` are not compared.

        Raises:
            ValueError: naming every field that differs, with the cache's and the run's values.
        """
        diffs = [
            f"{k}: cache has {self.fingerprint.get(k)!r}, this run has {expected[k]!r}"
            for k in FINGERPRINT_FIELDS if k in expected and self.fingerprint.get(k) != expected[k]
        ]
        if diffs:
            raise ValueError(
                f"hidden-state cache {self.root} was built for another configuration ({'; '.join(diffs)}); {REBUILD}"
            )

    def shards(self, split: str) -> list[dict]:
        if split not in self.index["splits"]:
            raise ValueError(f"hidden-state cache {self.root} has no {split!r} split; {REBUILD}")
        return self.index["splits"][split]["shards"]

    def verify(self, split: str) -> None:
        """Open every shard header of ``split`` and check its tensors against the index (no data is read).

        Raises:
            FileNotFoundError: naming a missing shard.
            ValueError: naming a truncated or corrupt shard, or one whose shapes differ from the index.
        """
        width = self.index["aux_width"], self.index["hidden_size"]
        for shard in self.shards(split):
            problem = _shard_problem(self.root / shard["file"], shard, width)
            if problem is not None:
                kind = FileNotFoundError if problem == "missing" else ValueError
                raise kind(
                    f"hidden-state cache shard {self.root / shard['file']} is {problem}; rerun "
                    "`python -m draftkit cache-hidden-states` with the same recipe and --output to rewrite it"
                )

    def dataset(self, split: str) -> "OfflineDataset":
        """The verified ``split`` as a map-style dataset."""
        self.verify(split)
        return OfflineDataset(self.root, self.shards(split))


def _shard_problem(path: Path, shard: dict, width: tuple[int, int]) -> str | None:
    """None when the shard file is complete and matches its index entry, else what is wrong."""
    if not path.exists():
        return "missing"
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type on a short or garbled file
        return f"truncated or corrupt ({type(e).__name__}: {e})"
    n_rows = shard["rows"][1] - shard["rows"][0]
    s = shard["num_tokens"]
    expected = {
        "input_ids": (s,), "loss_mask": (s,), "aux_hidden_states": (s, width[0]),
        "last_hidden_state": (s, width[1]), "offsets": (n_rows + 1,),
    }
    if shapes != expected:
        return f"inconsistent with the index (tensor shapes {shapes}, expected {expected})"
    return None


class OfflineDataset(torch.utils.data.Dataset):
    """Sequences of one split read lazily from memory-mapped shards.

    Items are dicts: ``input_ids`` (T,) int64, ``loss_mask`` (T,) int64, ``aux_hidden_states``
    (T, n_aux*H_t) bf16, ``last_hidden_state`` (T, H_t) bf16, and ``source`` (str): the shard file, the
    sequence's index in it and its row of the split, named when training finds its states non-finite.

    Args:
        root: cache directory.
        shards: the split's shard entries from the index.
    """

    def __init__(self, root: str | Path, shards: list[dict]) -> None:
        self.root = Path(root)
        self.shards = shards
        self.starts = [s["rows"][0] for s in shards]
        self.size = shards[-1]["rows"][1] if shards else 0
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.size

    def __getstate__(self) -> dict:  # DataLoader workers reopen the files
        return {**self.__dict__, "_handles": {}, "_offsets": {}}

    def _open(self, s: int):
        if s not in self._handles:
            f = safe_open(str(self.root / self.shards[s]["file"]), framework="pt")
            self._handles[s] = f
            self._offsets[s] = f.get_tensor("offsets").tolist()
        return self._handles[s], self._offsets[s]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        s = bisect.bisect_right(self.starts, i) - 1
        f, offsets = self._open(s)
        j = i - self.starts[s]
        a, b = offsets[j], offsets[j + 1]
        return {
            "input_ids": f.get_slice("input_ids")[a:b].long(),  # (T,)
            "loss_mask": f.get_slice("loss_mask")[a:b].long(),  # (T,)
            "aux_hidden_states": f.get_slice("aux_hidden_states")[a:b],  # (T, n_aux*H_t) bf16
            "last_hidden_state": f.get_slice("last_hidden_state")[a:b],  # (T, H_t) bf16
            "source": f"hidden-state cache shard {self.root / self.shards[s]['file']} sequence {j} (split row {i})",
        }


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


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
) -> dict:
    """Write (or finish writing) a hidden-state cache.

    1. Plan the shards of every split (:func:`plan_shards`); if ``output`` already holds an index, it must
       have the same fingerprint and plan, and its complete shards are kept.
    2. Compute the bytes still to write (bytes per token × tokens of the missing shards) and stop with an
       error before writing anything when the disk has less free space.
    3. Write the index with ``complete: false``, then each missing shard (sequences sorted by length into
       batches of ``batch_size`` for the target forward, states cast to bf16, padding dropped) to a temporary
       file moved into place with ``os.replace``, then the index with ``complete: true``.

    Args:
        output: cache directory (created).
        splits: split name -> tokenized rows in split order (a ``datasets.Dataset`` or a list of dicts with
            ``input_ids`` and ``loss_mask`` lists).
        fingerprint: the :data:`FINGERPRINT_FIELDS` of this configuration.
        forward: ``(input_ids (B, T) int64, attention_mask (B, T) int64) -> (aux (B, T, n_aux*H_t),
            last (B, T, H_t))``, the frozen target.
        hidden_size: H_t.
        num_aux_layers: n_aux.
        batch_size: sequences per target forward.
        shard_tokens: token budget per shard.
        pad_token_id: id written into padding for the forward.
        dry_run: plan and check the disk only.
        on_plan: called with the plan (dict with ``bytes_per_token``, ``tokens``, ``bytes_needed``,
            ``bytes_free``, ``shards_done``, ``shards_todo``) before anything is written.

    Returns:
        The plan plus ``tokens_written``, ``bytes_written``, ``seconds``, ``tokens_per_s``, ``mb_per_s``.

    Raises:
        ValueError: when ``output`` holds a cache for another fingerprint or shard plan, or the target's states
            of a row are non-finite (naming the split row; that shard is not written, so no cache holds NaN).
        OSError: (ENOSPC) when the disk has less free space than the cache needs.
    """
    output = Path(output).expanduser()
    bpt = bytes_per_token(hidden_size, num_aux_layers)
    lengths = {name: [len(r["input_ids"]) for r in rows] for name, rows in splits.items()}
    index = {
        "format": FORMAT, "complete": False, "fingerprint": fingerprint, "bytes_per_token": bpt,
        "hidden_size": hidden_size, "aux_width": num_aux_layers * hidden_size, "dtype": "bfloat16",
        "splits": {
            name: {
                "num_sequences": len(lengths[name]), "num_tokens": sum(lengths[name]),
                "shards": plan_shards(lengths[name], name, shard_tokens),
            }
            for name in splits
        },
    }
    old_path = output / INDEX
    if old_path.exists():
        old = json.loads(old_path.read_text())
        if old.get("fingerprint") != fingerprint:
            diffs = [k for k in FINGERPRINT_FIELDS if old.get("fingerprint", {}).get(k) != fingerprint.get(k)]
            raise ValueError(
                f"{output} already holds a hidden-state cache for another configuration (differs in {diffs}); "
                "choose another --output or delete that directory"
            )
        if old.get("splits") != index["splits"]:
            raise ValueError(
                f"{output} already holds a cache of this configuration with another shard plan; rerun with the "
                "same --shard_mb, or delete the directory"
            )
    width = (index["aux_width"], hidden_size)
    todo = [
        (name, shard) for name, spec in index["splits"].items() for shard in spec["shards"]
        if _shard_problem(output / shard["file"], shard, width) is not None
    ]
    all_shards = sum(len(s["shards"]) for s in index["splits"].values())
    tokens = sum(shard["num_tokens"] for _, shard in todo)
    plan = {
        "output": str(output), "bytes_per_token": bpt, "tokens": tokens,
        "tokens_total": sum(s["num_tokens"] for s in index["splits"].values()),
        "bytes_needed": tokens * bpt + sum(8 * (s["rows"][1] - s["rows"][0] + 1) + 4096 for _, s in todo),
        "bytes_free": _free_bytes(output), "shards_done": all_shards - len(todo), "shards_todo": len(todo),
    }
    if on_plan is not None:
        on_plan(plan)
    if plan["bytes_needed"] > plan["bytes_free"]:
        raise OSError(
            errno.ENOSPC,
            f"not enough disk for the hidden-state cache in {output}: needs {plan['bytes_needed'] / 1e9:.2f} GB "
            f"({bpt} bytes/token x {tokens} tokens), {plan['bytes_free'] / 1e9:.2f} GB free; free space, choose "
            "another --output, or lower data.max_conversations / data.max_length",
        )
    if dry_run:
        return plan
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / INDEX, index, indent=1)
    t0, written, nbytes = time.perf_counter(), 0, 0
    for name, shard in todo:
        rows = [splits[name][i] for i in range(*shard["rows"])]
        nbytes += _write_shard(output / shard["file"], rows, forward, batch_size, pad_token_id, name, shard)
        written += shard["num_tokens"]
        dt = time.perf_counter() - t0
        log.info("wrote %s (%d tokens; %.0f tokens/s so far)", shard["file"], shard["num_tokens"], written / max(dt, 1e-9))
    index["complete"] = True
    write_json_atomic(output / INDEX, index, indent=1)
    seconds = time.perf_counter() - t0
    return {
        **plan, "tokens_written": written, "bytes_written": nbytes, "seconds": seconds,
        "tokens_per_s": written / max(seconds, 1e-9), "mb_per_s": nbytes / 1e6 / max(seconds, 1e-9),
    }


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
) -> dict:
    """Write (or finish) the hidden-state cache of a built recipe: its frozen target over its tokenized train
    and val splits, under its precision (bf16 autocast for ``bf16-mixed``), so that the cached states equal
    the ones online training computes. Used by ``draftkit cache-hidden-states`` and by ``fit`` with
    ``data.hidden_states_cache: auto``.

    Args:
        model: an ``Eagle3Module`` (reads ``load_target_model()`` and ``hparams.target``/``target_dtype``/
            ``aux_layer_ids``); its target is loaded in full here.
        dm: a ``ChatDataModule`` after ``setup`` (``train_set``, ``val_set``, ``cache_fingerprint()``).
        precision: the trainer's precision string (e.g. ``bf16-mixed``, ``32-true``).
        output: cache directory; default ``<draftkit cache>/hidden-states/<cache_key(fingerprint)>``.
        batch_size: sequences per target forward (default: ``data.batch_size``).
        shard_mb: shard size in MB (1e6 bytes).
        dry_run: only plan and check the disk.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        on_plan: called with the plan before anything is written (see :func:`write_hidden_states`).

    Returns:
        :func:`write_hidden_states`' result plus ``output`` (str), ``precision`` and ``device``.

    Raises:
        ValueError: when ``output`` holds a cache for another configuration.
        OSError: when the disk is short (before anything is written).
    """
    from contextlib import nullcontext

    from draftkit.artifacts import cache_dir
    from draftkit.target.frozen import FrozenTarget

    hf_model, _ = model.load_target_model()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = FrozenTarget(hf_model.to(device), model.hparams.aux_layer_ids)
    fingerprint = {
        "target": model.hparams.target, "target_config": config_fingerprint(target.config),
        "target_dtype": model.hparams.target_dtype, "aux_layer_ids": list(target.aux_layer_ids),
        **dm.cache_fingerprint(),
    }
    out_dir = Path(output or cache_dir() / "hidden-states" / cache_key(fingerprint))
    autocast = torch.autocast(device, dtype=torch.bfloat16) if "bf16" in str(precision) else nullcontext()

    def forward(ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast:
            out = target(ids.to(device), attention_mask=attn.to(device), compute_logits=False)
        return out.aux_hidden_states, out.last_hidden_state  # (B, T, n*H_t), (B, T, H_t)

    bpt = bytes_per_token(target.hidden_size, len(target.aux_layer_ids))
    result = write_hidden_states(
        out_dir, {"train": dm.train_set, "val": dm.val_set}, fingerprint, forward, target.hidden_size,
        len(target.aux_layer_ids), batch_size=batch_size or dm.hparams.batch_size,
        shard_tokens=max(1, int(shard_mb * 1e6) // bpt), pad_token_id=dm.pad_token_id, dry_run=dry_run,
        on_plan=on_plan,
    )
    return {**result, "output": str(out_dir), "precision": str(precision), "device": device}


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
        for i, j in enumerate(js):
            aux[j] = a[i, : lengths[j]].to(torch.bfloat16).cpu()  # (T_j, n_aux*H_t)
            last[j] = h[i, : lengths[j]].to(torch.bfloat16).cpu()  # (T_j, H_t)
            if not (bool(torch.isfinite(aux[j]).all()) and bool(torch.isfinite(last[j]).all())):
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
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "split": split, "rows": json.dumps(shard["rows"])})
    return path.stat().st_size
