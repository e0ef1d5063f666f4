"""The prompts a head trained on, carried with the head so that a run continuing it validates on prompts it has
never seen.

Why: continuing a head (``fit --model.init_head``) on its old data joined with new data (what the README advises,
so that it does not forget) would otherwise draw its validation conversations from the whole file: most of them
were in the starting head's training set, which has memorised them, so ``val/*`` reads optimistic at step 0 and
falls as the run forgets them. (Measured continuing the shipped SmolLM2 head on such a split: ``val/tau_sim``
2.08 at step 0, 1.99 after 250 steps, 1.97 after 500, while ``val/accept_len`` on held-out MT-bench prompts read
1.65, 1.60, 1.66.)

The record: every training checkpoint stores, under :data:`CHECKPOINT_KEY`, the sorted distinct 64-bit hashes
(:func:`prompt_hashes`, scheme :data:`SCHEME`) of the normalised first prompts
(``draftkit.data.splits.normalize_prompt``) of its training split (every row it could train on, whether or not a
short run reached it: the exclusion errs on the safe side), joined with those of the head it started from (its
lineage); ``draftkit export`` writes them to :data:`EXPORT_FILE`, in a subfolder of its own so that no engine loads
it as weights (vLLM loads every ``*.safetensors`` at the top of a head's folder). ``model.init_head`` (the CLI hands it
to ``ChatDataModule.hold_out_head``) reads them back (:func:`read_trained_prompts`) and the split keeps those
prompts on the training side.

Shapes: (P,) int64, P distinct prompts; 8 bytes a prompt (4 MB for 500 k prompts).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

__all__ = ["CHECKPOINT_KEY", "EXPORT_FILE", "SCHEME", "StartingHead", "digest", "hash_each", "prompt_hashes",
           "read_trained_prompts", "record", "write_trained_prompts"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "draftkit_trained_prompts"
"""Checkpoint key: ``{"scheme": SCHEME, "hashes": (P,) int64 sorted}`` (:func:`record`), the head's lineage."""
EXPORT_FILE = "draftkit/trained_prompts.safetensors"
"""File of an export directory holding them (tensor ``prompt_hashes``, metadata ``scheme``)."""
SCHEME = "blake2b-8 of normalize_prompt v1"
"""How a prompt becomes a hash; a record of another scheme cannot be matched and is refused."""
_TENSOR = "prompt_hashes"
_WHAT_TO_DO = ("re-export the head from its training .ckpt (draftkit export), or delete the file to continue without "
               "the record (validation may then hold prompts the head trained on)")


def hash_each(keys) -> torch.Tensor:
    """The hash of each normalised prompt key, in order.

    Args:
        keys: sequence of normalised prompts (str; ``draftkit.data.splits.normalize_prompt``), length N.

    Returns:
        (N,) int64: the first 8 bytes of each key's BLAKE2b digest (UTF-8), little-endian, signed.
    """
    return torch.tensor([int.from_bytes(hashlib.blake2b(k.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                                        "little", signed=True) for k in keys], dtype=torch.int64)


def prompt_hashes(keys) -> torch.Tensor:
    """The sorted distinct hashes (:func:`hash_each`) of normalised prompt keys: (P,) int64, ascending."""
    return torch.unique(hash_each(list(keys)))


def record(hashes: torch.Tensor) -> dict:
    """What a checkpoint stores under :data:`CHECKPOINT_KEY`: ``{"scheme": SCHEME, "hashes": hashes}``."""
    return {"scheme": SCHEME, "hashes": hashes}


def digest(hashes: torch.Tensor | None) -> str:
    """A 16-hex-digit digest of a hash set ("none" for None)."""
    if hashes is None:
        return "none"
    return hashlib.blake2b(hashes.to(torch.int64).contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def read_trained_prompts(path: str | Path, option: str = "model.init_head") -> torch.Tensor | None:
    """The prompt hashes a head records: a ``.ckpt`` of ``draftkit fit`` (:data:`CHECKPOINT_KEY`) or an export
    directory (:data:`EXPORT_FILE`).

    Args:
        path: the head (as ``model.init_head`` takes it).
        option: the option that named it, for errors.

    Returns:
        (P,) int64 sorted distinct hashes, or None when the head records none (written by a draftkit before this
        record).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the record is unreadable, not a 1-D int64 tensor, or of another :data:`SCHEME`, or the
            checkpoint is unreadable (naming the file and what to do).
    """
    from safetensors import safe_open

    from draftkit.heads.checkpoint import load_checkpoint

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{option} {path} does not exist; give a .ckpt from draftkit fit or an export "
                                "directory")
    if path.is_dir():
        where = path / EXPORT_FILE
        if not where.is_file():
            return None
        try:
            with safe_open(str(where), "pt") as f:
                scheme = (f.metadata() or {}).get("scheme")
                hashes = f.get_tensor(_TENSOR)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
            raise ValueError(f"{option}: {where} is not a readable record of trained prompts ({exc}); "
                             f"{_WHAT_TO_DO}") from exc
    else:
        stored = load_checkpoint(path, option)[0].get(CHECKPOINT_KEY)
        if stored is None:
            return None
        where = f"{path} [{CHECKPOINT_KEY}]"
        scheme, hashes = (stored.get("scheme"), stored.get("hashes")) if isinstance(stored, dict) else (None, None)
    if scheme != SCHEME:
        raise ValueError(f"{option}: {where} hashes prompts by {scheme!r}, this draftkit by {SCHEME!r}, so they cannot "
                         f"be matched; {_WHAT_TO_DO}")
    if not isinstance(hashes, torch.Tensor) or hashes.dtype != torch.int64 or hashes.dim() != 1:
        raise ValueError(f"{option}: {where} is not a 1-D int64 tensor of prompt hashes; {_WHAT_TO_DO}")
    return torch.unique(hashes)  # sorted and distinct, whatever wrote it: the split searches it


def write_trained_prompts(directory: str | Path, hashes: torch.Tensor) -> None:
    """Write ``hashes`` ((P,) int64) to ``directory/`` :data:`EXPORT_FILE` (its subfolder created)."""
    from safetensors.torch import save_file

    file = Path(directory) / EXPORT_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({_TENSOR: hashes.to(torch.int64).contiguous()}, str(file),
              metadata={"format": "pt", "scheme": SCHEME,
                        "what": "draftkit: hashes of the normalised first prompts the head trained on"})


class StartingHead:
    """The prompts the head a run starts from (``model.init_head``) trained on, as the data split uses them: those
    conversations train and none validates.

    Built from the head's path (:meth:`from_path`, read once when first asked; a head that records none is named in
    a warning) or from the hashes a resumed checkpoint recorded (:meth:`restored`: the split the run trained with, even
    if the head moved or changed since). ``StartingHead()`` is no head.

    Raises (on first use of a path):
        FileNotFoundError, ValueError: as :func:`read_trained_prompts`.
    """

    def __init__(self, path: str | None = None, hashes: torch.Tensor | None = None, source: str | None = None):
        self.path = path
        self.source = source or f"model.init_head {path}"  # what the split's messages call it
        self._hashes = hashes
        self._read = path is None

    @classmethod
    def from_path(cls, path: str | None) -> StartingHead:
        """The head at ``path`` (a ``.ckpt`` of ``draftkit fit`` or an export directory); None: no head."""
        return cls(path)

    @classmethod
    def restored(cls, hashes: torch.Tensor | None) -> StartingHead:
        """The hashes a checkpoint of the run recorded ((P,) int64 sorted, or None when it kept none out)."""
        return cls(None, hashes, "the starting head (as the resumed checkpoint records it)")

    def hashes(self) -> torch.Tensor | None:
        """(P,) int64 sorted distinct hashes of the prompts the head trained on, or None (no head, or a head that
        records none)."""
        if not self._read:
            self._read = True
            self._hashes = read_trained_prompts(self.path, "model.init_head")
            if self._hashes is None:
                log.warning(
                    "model.init_head %s records no training prompts (written before draftkit recorded them): this "
                    "run's validation may hold conversations the head trained on, and then reads optimistic from "
                    "step 0 on; measure it on held-out prompts (draftkit evaluate) to judge the run", self.path)
        return self._hashes

    def rows_trained(self, keys: list[str], rows: list[int]) -> set[int]:
        """The rows of ``rows`` whose normalised prompt key (``keys[row]``) the head trained on (empty without a
        record)."""
        seen = self.hashes()
        if seen is None or not rows or not len(seen):
            return set()
        hashes = hash_each([keys[i] for i in rows])
        pos = torch.searchsorted(seen, hashes).clamp(max=len(seen) - 1)
        hit = seen[pos] == hashes
        return {r for r, h in zip(rows, hit.tolist()) if h}

    def lineage(self, own: torch.Tensor) -> torch.Tensor:
        """A run's trained prompts: ``own`` ((P,) int64 sorted, its training rows') joined with the head's."""
        seen = self.hashes()
        return own if seen is None else torch.unique(torch.cat([seen, own]))
