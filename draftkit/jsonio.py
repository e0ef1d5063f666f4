"""Atomic writes (every output file or folder is either complete or absent: :func:`atomic_path`, and JSON through
it: :func:`write_json_atomic`), the short hash that names settings and fingerprints (:func:`short_hash`), and
resumable JSONL records (a long run appends one finished unit per line and picks up where it stopped)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "InsufficientSpaceError", "ResumableRecord", "atomic_leftovers", "atomic_path", "bytes_needed", "check_free_space", "check_writable",
    "json_error", "short_hash", "write_json_atomic",
]

SPACE_MARGIN = (1 << 20, 0.05)
"""Free space kept beyond a write: 1 MiB plus 5 % of its bytes (filesystem blocks, metadata, a temp copy)."""


def json_error(exc: json.JSONDecodeError, line: bool = False) -> str:
    """What a JSON parse error says, with where: ``Unterminated string starting at column 43`` (``json``'s messages
    that end in "at" take the place directly), ``Expecting ',' delimiter at line 2 column 5`` with ``line``."""
    where = f"line {exc.lineno} column {exc.colno}" if line else f"column {exc.colno}"
    return f"{exc.msg} {where}" if exc.msg.endswith(" at") else f"{exc.msg} at {where}"


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


def check_writable(path: str | Path, option: str, directory: bool = False) -> None:
    """Refuse, before the long work, an output that could not be written at its end: a file path that is an
    existing directory (a directory path that is an existing file), or a folder in which no file can be created
    (checked with a temporary file in the nearest existing folder, removed at once; nothing is left behind).

    Args:
        path: the output file, or with ``directory`` the output directory (need not exist, nor its folder).
        option: the option that named it, as the user wrote it (``--output``).
        directory: ``path`` is a directory to create or fill.

    Raises:
        ValueError: when ``path`` is a directory (with ``directory``: an existing file).
        OSError: when no file can be created there (a read-only or full filesystem, a file where a folder should
            be), naming the option, the path and the folder.
    """
    p = Path(path)
    if p.is_dir() and not directory:
        raise ValueError(f"{option} {path} is a directory; give a file path")
    if p.exists() and not p.is_dir() and directory:
        raise ValueError(f"{option} {path} is a file; give a directory path")
    folder = p.absolute().parent  # where the file, or the directory (or an export's temporary sibling), is made
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".draftkit-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = "a file, not a folder" if folder.exists() and not folder.is_dir() else exc.strerror
        error = OSError(f"{option} {path}: no file can be created in {folder} ({why}); choose another path")
        error.errno = exc.errno  # kept for callers; not in the message ("[Errno 30] --output ..." read as noise)
        raise error from exc


def short_hash(obj) -> str:
    """16 hex digits of the sha256 of ``obj``: of the bytes themselves for ``bytes``, else of its JSON text
    (``json.dumps(obj, sort_keys=True, default=str)``, UTF-8; a ``str`` is hashed as its JSON string).

    The one hash behind every stored settings hash and fingerprint (generate's ``settings``, the hidden-state
    cache key, config and tokenizer fingerprints, record keys); a value hashed here must keep its JSON form,
    or the stored hashes change.
    """
    data = obj if isinstance(obj, bytes) else json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_leftovers(folder: Path, name: str | None = None) -> list[Path]:
    """The temporaries (``.<name>.XXXX`` files) that :func:`atomic_path` calls writing ``folder / name`` (any name
    when ``name`` is None) left in ``folder`` because their process was killed mid-write (a clean exit or an error
    removes them). Only a caller that knows no writer of those names runs (e.g. one holding their lock) may remove
    them. Names are compared as text (glob characters in ``name`` are literal)."""
    prefix = "." if name is None else f".{name}."
    return [p for p in folder.iterdir() if p.is_file() and p.name.startswith(prefix)]


@contextmanager
def atomic_path(path: str | Path, directory: bool = False) -> Iterator[Path]:
    """Write ``path`` all at once: yield a temporary path beside it to write to; on a clean exit fsync what was
    written and ``os.replace`` it onto ``path``; on an error remove it, leaving ``path`` as it was.

    The temporary is an empty file (``directory=False``; a writer may also replace it, e.g. ``save_file``) or
    an empty folder (``directory=True``: an existing folder at ``path`` is moved aside just before the rename,
    put back if the rename fails, and removed after it). It lies in ``path``'s folder (created), so the rename
    never crosses filesystems. What lands gets the usual permissions, as ``open`` and ``mkdir`` would give: files
    0666 and folders 0777 minus the umask, not mkstemp's 0600 or mkdtemp's 0700 (safetensors' ``save_file``
    writes 0600 too), so a server running as another user can read an exported head.

    Args:
        path: the file or folder to write.
        directory: write a folder instead of a file.

    Yields:
        The temporary path (``.<name>.XXXX`` beside ``path``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    aside = None
    try:
        yield tmp
        if directory:
            for root, _, files in os.walk(tmp):
                os.chmod(root, 0o777 & ~_umask())
                for f in files:
                    os.chmod(Path(root) / f, 0o666 & ~_umask())
                    _fsync(Path(root) / f)
            if path.exists():  # move the old folder aside, so a failed rename can put it back
                aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.replace(path, aside / "dir")
        else:
            os.chmod(tmp, 0o666 & ~_umask())
            _fsync(tmp)
        try:
            os.replace(tmp, path)
        except BaseException:
            if aside is not None:
                os.replace(aside / "dir", path)
            raise
        _fsync(path.parent)
    finally:
        for leftover in (tmp, aside):
            if leftover is None:
                continue
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def write_json_atomic(path: str | Path, obj, indent: int = 2, allow_nan: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` through :func:`atomic_path` (temporary file beside it, fsync, ``os.replace``).

    The parent folder is created; the file gets the usual permissions (0666 minus the umask, not mkstemp's 0600).

    Raises:
        TypeError / ValueError: from ``json.dump`` (a non-serialisable value, or NaN with ``allow_nan=False``);
            nothing is left behind at ``path`` or beside it.
    """
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=indent, allow_nan=allow_nan)
        f.write("\n")


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
        with atomic_path(self.path) as tmp, open(tmp, "w") as f:
            f.write(json.dumps({"header": self.header}) + "\n")
            for key, value in self.done.items():
                f.write(json.dumps({"key": key, "value": value}) + "\n")

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
