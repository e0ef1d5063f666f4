"""Offline hidden-state cache: the format of the target's aux and last hidden states on disk (sharded
safetensors + index) and its reader.

Training from the cache needs no target forward: the draft head reads the stored aux hidden states, and the
teacher distribution comes from the stored last hidden state through the target's LM head alone.

Layout of a cache directory (``FORMAT``)::

    index.json                  fingerprint, bytes per token, per split the planned shards, ``complete``
    train-00000.safetensors     one shard: a contiguous run of the split's sequences, tokens concatenated
    ...
    val-00000.safetensors
    index.part-00001-of-00008.json   while writing only: the shards rank 1 of 8 wrote (merged, then removed)

A shard holds, for its n sequences with S tokens in all (no padding is stored):

- ``input_ids`` (S,) int32, ``loss_mask`` (S,) uint8 (assistant tokens, unshifted, as in ``collate``);
- ``aux_hidden_states`` (S, n_aux*H_t) bf16, the aux states concatenated in ascending layer-id order;
- ``last_hidden_state`` (S, H_t) bf16, ``hidden_states[N]`` after the final norm;
- ``offsets`` (n+1,) int64: sequence j of the shard is tokens [offsets[j], offsets[j+1]).

A shard's safetensors metadata is one key, ``draftkit``: JSON ``{"format", "split", "rows"}``.

Writing is ``draftkit.generation.hidden_states`` (it runs the target; ``write_hidden_states``): every shard is
written to a temporary file and moved into place, so a shard that exists is complete. Readers check every shard's
header against the index before training starts: a missing or truncated shard is an error naming the file,
never skipped.

The fingerprint names what the states depend on (target reference, target config hash, target dtype, aux
layer ids, tokenizer, tokenized data and split), so a cache built for other layers, another target or
another tokenizer is refused with the field that differs.

Shapes: B batch, T tokens (padded), S tokens of a shard, H_t target hidden, n_aux aux layers.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from draftkit.jsonio import short_hash

__all__ = [
    "AUTO", "FORMAT", "FINGERPRINT_FIELDS", "INDEX", "HiddenStateCache", "OfflineDataset", "bytes_per_token",
    "cache_key", "plan_shards", "shard_problem",
]

FORMAT = "draftkit-hidden-states-v1"
INDEX = "index.json"
FINGERPRINT_FIELDS = ("target", "target_config", "target_dtype", "aux_layer_ids", "tokenizer", "data")
"""Fingerprint fields in the order mismatches are reported."""
AUTO = "auto"  # data.hidden_states_cache value: fit writes (or reuses) the cache in the draftkit cache first
REBUILD = "rebuild it with `python -m draftkit cache-hidden-states --recipe ...` for this recipe"


def cache_key(fingerprint: dict) -> str:
    """16 hex digits naming a fingerprint (the default cache directory name)."""
    return short_hash(fingerprint)


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
            problem = shard_problem(self.root / shard["file"], shard, width)
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


def shard_problem(path: Path, shard: dict, width: tuple[int, int]) -> str | None:
    """None when the shard file ``path`` is complete and matches its index entry ``shard`` (tensor widths
    ``width``: (n_aux*H_t, H_t)), else what is wrong: ``"missing"``, truncated or corrupt, or inconsistent with
    the index. The reader's check, and the writer's test of which shards are still to write."""
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
