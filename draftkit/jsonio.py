"""Atomic JSON files (reports, indexes and manifests are either complete or absent) and resumable JSONL
records (a long run appends one finished unit per line and picks up where it stopped)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["InsufficientSpaceError", "ResumableRecord", "bytes_needed", "check_free_space", "write_json_atomic"]

SPACE_MARGIN = (1 << 20, 0.05)
"""Free space kept beyond a write: 1 MiB plus 5 % of its bytes (filesystem blocks, metadata, a temp copy)."""


class InsufficientSpaceError(ValueError):
    """The filesystem of an output has less free space than a write needs (a user error: exit 2)."""


def bytes_needed(nbytes: int) -> int:
    """``nbytes`` plus the :data:`SPACE_MARGIN` (bytes)."""
    return int(nbytes + SPACE_MARGIN[0] + SPACE_MARGIN[1] * nbytes)


def check_free_space(directory: str | Path, nbytes: int, what: str) -> None:
    """Refuse a write of ``nbytes`` bytes into ``directory`` (or its nearest existing parent) when its
    filesystem has less free space than :func:`bytes_needed` (``shutil.disk_usage``).

    Args:
        directory: the folder the bytes go to (need not exist yet).
        nbytes: bytes about to be written.
        what: what is written (named in the error, e.g. ``"export vllm"``).

    Raises:
        InsufficientSpaceError: naming the directory, the bytes needed (with the margin) and the bytes free.
    """
    p = Path(directory).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    need = bytes_needed(nbytes)
    if free < need:
        raise InsufficientSpaceError(
            f"{what}: not enough free space in {directory} (filesystem of {p}): {need} bytes needed "
            f"({nbytes} to write plus a margin), {free} free; free space or write somewhere else"
        )


def write_json_atomic(path: str | Path, obj, indent: int = 2, allow_nan: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file in the same folder and ``os.replace``.

    The parent folder is created; the file gets the usual permissions (0666 minus the umask, not mkstemp's 0600).

    Raises:
        TypeError / ValueError: from ``json.dump`` (a non-serialisable value, or NaN with ``allow_nan=False``);
            nothing is left behind at ``path`` or beside it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, allow_nan=allow_nan)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResumableRecord:
    """An append-only JSONL file of finished units of work, keyed, behind a header that names the run.

    Line 1 is ``{"header": header}``; every further line is ``{"key": key, "value": value}``, written and
    flushed to disk as each unit finishes. Reopening the same path with an equal header loads the finished
    units (a torn line, from a run killed mid-write or a damaged file: one that is not JSON, lacks its newline
    or lacks ``key``/``value``, is dropped with the lines after it and the record rewritten), so
    an interrupted run only redoes the unit in progress; opening an intact record does not write it. ``path``
    None keeps nothing (an in-memory no-op).

    Args:
        path: the JSONL file, or None.
        header: JSON-serialisable description of everything the values depend on (config, inputs).

    Raises:
        ValueError: if ``path`` holds a record of a different run (another header), naming the file and
            what to do.
    """

    def __init__(self, path: str | Path | None, header: dict) -> None:
        self.path = None if path is None else Path(path)
        self.header = json.loads(json.dumps(header))  # normalised as it reads back (tuples -> lists)
        self.done: dict[str, object] = {}
        if self.path is None:
            return
        text = self.path.read_text() if self.path.exists() else ""
        lines = text.splitlines()
        intact = bool(lines) and text.endswith("\n")  # a last line without its newline is torn (or would be joined)
        if lines:
            try:
                found = json.loads(lines[0]).get("header")
            except json.JSONDecodeError:
                found = None
            if found != self.header:
                raise ValueError(
                    f"{self.path}: a record of a different run (its header differs from this run's config or "
                    f"inputs); delete it to start over, or pass another record path"
                )
            for line in lines[1:]:
                try:
                    row = json.loads(line)
                    key, value = row["key"], row["value"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    intact = False  # a torn (or damaged) line: it and the lines after it are redone
                    break
                self.done[key] = value
        if not intact:  # new, or torn; an intact record is only read (a report may read a running one's record)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._rewrite()

    def _rewrite(self) -> None:
        """Header plus the intact rows, atomically (drops a torn last line)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"header": self.header}) + "\n")
            for key, value in self.done.items():
                f.write(json.dumps({"key": key, "value": value}) + "\n")
        os.replace(tmp, self.path)

    def get(self, key: str):
        """The value recorded under ``key``, or None."""
        return self.done.get(key)

    def add(self, key: str, value) -> None:
        """Record a finished unit (appended and fsynced at once)."""
        self.done[key] = value
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"key": key, "value": value}) + "\n")
            f.flush()
            os.fsync(f.fileno())
