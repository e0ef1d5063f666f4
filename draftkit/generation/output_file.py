"""The output file of ``draftkit generate`` and its shards: the header's format, the atomic (gzip) writer, the
complete-file reader that resume and joining trust, the per-shard check, the settings that differ between two
headers (for refusals) and the run's shard store (:class:`Parts`: resume, extend a finished file, join).
``draftkit.generation.regenerate`` decodes into it."""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import socket
from collections import Counter
from pathlib import Path

from draftkit.jsonio import atomic_leftovers, atomic_path, check_free_space, write_json_atomic

log = logging.getLogger(__name__)

FORMAT = "draftkit-regenerated-chat/1"
"""``header.format`` of the output file."""


FAILURE_HINTS = {
    "prompt too long": "the prompts are longer than --max_prompt_tokens, or than the target's context window less "
                       "--max_new_tokens; raise --max_prompt_tokens or lower --max_new_tokens",
    "empty prompt": "the chat template renders nothing before the first assistant turn; check --chat_template",
    "empty answer": "the target ends every answer at once; check --chat_template and the target",
    "template error": "the chat template cannot render these conversations; check --chat_template",
    "decoding error": "the target failed while decoding; the log's warnings name the error",
}
"""What to do when every conversation failed for a reason that starts with the key (:meth:`Parts.join`)."""


def differences(old: dict, new: dict) -> str:
    """The settings of header ``new`` that differ from header ``old``, named for an error message
    (``engine``, ``decode.max_new_tokens``, ...: top-level keys, and the keys inside a differing section)."""
    names = []
    for key in new.keys() | old.keys():
        if key in ("max_records", "settings", "shards", "source_ids", "counts") or old.get(key) == new.get(key):
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            names += [f"{key}.{k}" for k in a.keys() | b.keys() if a.get(k) != b.get(k)]
        else:
            names.append(key)
    return ", ".join(sorted(names)) or "the settings hash's inputs"


def write_lines_atomic(path: Path, lines: list[str]) -> None:
    """Write text lines to ``path`` (gzip when it ends in ``.gz``, with a fixed mtime) through ``atomic_path``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        if path.name.endswith(".gz"):
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
                f.write("".join(lines).encode("utf-8"))
        else:
            raw.write("".join(lines).encode("utf-8"))


def read_output(path: Path) -> tuple[dict, dict[str, list[str]]] | None:
    """(header, {shard: its record lines}) of a complete generate output that holds its shard index, else None
    (unreadable, not gzip or UTF-8, no header or index, or records that do not match the index: missing, extra,
    not JSON, or another id)."""
    try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.name.endswith(".gz") else raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError):
        return None
    # records end at "\n" only: str.splitlines would also cut at U+2028, U+0085 ... inside a JSON string
    lines = [line + "\n" for line in text.split("\n")[:-1]] if text.endswith("\n") else []
    try:
        header = json.loads(lines[0])["header"] if lines else None
        if not isinstance(header, dict) or header.get("format") != FORMAT or not {"settings", "shards"} <= set(header):
            return None
        shards, pos = {}, 1
        for key, meta in sorted(header["shards"].items(), key=lambda kv: int(kv[0])):
            shards[key] = lines[pos:pos + meta["records"]]
            pos += meta["records"]
            if [json.loads(line)["id"] for line in shards[key]] != meta["ids"]:
                return None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None
    return (header, shards) if pos == len(lines) else None


def part_problem(path: Path, meta: dict) -> str | None:
    """None when the shard part ``path`` holds exactly the records its index entry ``meta`` lists (count and
    ids, each line a JSON object ending in a newline), else what is wrong (missing, torn, other records)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if text and not text.endswith("\n"):
        return "torn (its last record has no end of line)"
    lines = text.split("\n")[:-1] if text else []
    if len(lines) != meta["records"]:
        return f"torn ({len(lines)} record lines, the index lists {meta['records']})"
    try:
        ids = [json.loads(line)["id"] for line in lines]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return f"torn (a record line is not a JSON record: {type(e).__name__}: {e})"
    if ids != meta["ids"]:
        return "not the shard its index lists (other record ids)"
    return None


def existing_output(out: Path, overwrite: bool) -> tuple[dict, dict[str, list[str]]] | None:
    """The finished output at ``out`` that a run extends (``read_output``), or None when there is none or
    ``overwrite`` replaces it.

    Raises:
        FileExistsError: ``out`` exists, ``overwrite`` is off and it is not a complete generate output with a
            shard index (damaged, or made by an older draftkit or another tool).
    """
    if not out.exists() or overwrite:
        return None
    existing = read_output(out)
    if existing is None:
        raise FileExistsError(f"--output {out} exists and is not a complete generate output with a shard "
                              "index (damaged, or made by an older draftkit or another tool); pass --overwrite "
                              "to replace it")
    return existing


def _read_index(path: Path, overwrite: bool) -> dict | None:
    """The shard index at ``path`` (None when absent); an unreadable one is refused naming it, or, with
    ``overwrite``, read as an index of other settings (the run restarts).

    Raises:
        ValueError: ``path`` is not a JSON object and ``overwrite`` is off.
    """
    if not path.exists():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        index = f"{type(e).__name__}: {e}"
    if isinstance(index, dict):
        return index
    if overwrite:
        return {"settings": None, "shards": {}}  # restarted: the folder is removed
    raise ValueError(f"{path} is not a generate shard index ({index if isinstance(index, str) else 'no JSON object'})"
                     "; restore it, or pass --overwrite to restart (the shards beside it are decoded again)")


def _is_file_of(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` now (not one removed or replaced since)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


class Parts:
    """The shards of one generate run: ``<output>.parts/shard-NNNNN.jsonl`` (each shard's records, in source
    order), ``lock`` (the process writing them) and ``index.json`` (the settings hash, the header and each finished
    shard's entry: ``first``, ``count``, ``records``, ``failed``, ``ids``, ``new_tokens``, ``seconds``), written
    atomically shard by shard so that a rerun of the same command resumes from them; :meth:`join` writes the output
    file from them. ``Parts(out)`` claims the folder (:meth:`_lock`); :meth:`open` then reads it for the run's
    settings; :meth:`release` gives the claim up (call it in a ``finally``).

    Args:
        out: the output file (``.jsonl`` or ``.jsonl.gz``).

    :meth:`open` takes:
        header: the run's header (settings; without ``settings``, ``shards``, ``source_ids``, ``counts``).
        settings: the header's settings hash (``max_records`` left out: a shorter or longer run reuses shards).
        shards: the source positions of each shard (``range`` per shard, in order).
        existing: the finished output this run extends (``existing_output``), or None.
        overwrite: restart when the parts or the output were made with other settings.

    Raises:
        FileExistsError: ``<output>.parts`` is a file, or another live process writes it (:meth:`_lock`); from
            :meth:`open`: the parts hold shards made with other settings, or ``existing`` was made with other
            settings or holds more conversations than ``shards`` cover.
        ValueError: (:meth:`open`) ``index.json`` is unreadable (without ``overwrite``, which restarts).
    """

    def __init__(self, out: Path) -> None:
        self.out, self.dir = out, out.with_name(out.name + ".parts")
        self.index_path = self.dir / "index.json"
        if self.dir.exists() and not self.dir.is_dir():
            raise FileExistsError(f"{self.dir} is a file, where generate keeps the shards of --output {out}: move it "
                                  "away, or write another --output")
        self._lock_fd: int | None = None
        self._lock()  # before the target loads (a second run stops at once) and before anything here changes

    def open(self, header: dict, settings: str, shards: list[range],
             existing: tuple[dict, dict[str, list[str]]] | None, overwrite: bool) -> None:
        """Read (or restart, or seed from a finished ``existing`` output) the shard store of this run's settings;
        the caller holds the claim and releases it (:meth:`release`) whatever happens.

        Raises:
            FileExistsError, ValueError: as the class says.
        """
        out, self.shards = self.out, shards
        self._remove_torn_temporaries()
        index = _read_index(self.index_path, overwrite)
        if index is not None and index.get("settings") != settings:
            if index.get("shards") and not overwrite:  # an index without shards holds nothing to lose: restarted
                raise FileExistsError(
                    f"{self.dir} holds shards made with other settings ({index.get('settings')} vs {settings}; "
                    f"{differences(index.get('header') or {}, header)} differ); pass --overwrite to restart, or "
                    "rerun with the settings that made them"
                )
            shutil.rmtree(self.dir)
            self._lock()  # the removed folder took the lock file with it: claim the new one
            index = None
        if existing is not None:
            if existing[0]["settings"] != settings:
                raise FileExistsError(
                    f"--output {out} was made with other settings ({existing[0]['settings']} vs {settings}; "
                    f"{differences(existing[0], header)} differ); pass --overwrite to replace it, or write another "
                    "--output"
                )
            covered = max(m["first"] + m["count"] for m in existing[0]["shards"].values())
            if covered > shards[-1].stop:
                raise FileExistsError(
                    f"--output {out} holds the answers to the first {covered} usable conversations; "
                    f"--max_records {header.get('max_records')} ({shards[-1].stop}) would drop some. Pass a larger "
                    "--max_records (or none), write another --output, or pass --overwrite"
                )
        if index is None:
            index = {"settings": settings, "header": header, "shards": {}}
            if existing is not None:  # extend a finished file: its shards come back as parts
                for key, lines in existing[1].items():
                    write_lines_atomic(self.part(int(key)), lines)
                index["shards"] = existing[0]["shards"]
                log.info("generate: extending %s (%d shards, %d records)", out, len(index["shards"]),
                         sum(len(lines) for lines in existing[1].values()))
                write_json_atomic(self.index_path, index)  # a fresh run writes its index with its first shard
        self.index, self.settings = index, settings
        self._checked: dict[int, bool] = {}  # shard -> its part matches its index entry (read once per run)

    def _lock(self) -> None:
        """Claim the shard folder for this process, so that a second generate of the same output stops at once
        instead of racing this one (both decoded every shard, then one failed on a part the other had removed).

        The claim is an exclusive ``fcntl.flock`` on ``<parts>/lock`` (which names the holder: host and pid), held
        until :meth:`release` or the process ends: the kernel releases it when its holder dies (killed, interrupted),
        so a lock left behind is taken over without guessing from pids, and of any number of runs that start or
        take over at once exactly one holds it. Called again after the folder was removed (a restart), it claims
        the new lock file.

        Raises:
            FileExistsError: another live process holds the lock, naming it and the lock file.
        """
        import fcntl

        lock, me = self.dir / "lock", f"{socket.gethostname()} {os.getpid()}"
        held = getattr(self, "_lock_fd", None)
        if held is not None and _is_file_of(held, lock):
            return
        for _ in range(3):  # open and lock; retry when the holder removed the file (or the folder) meanwhile
            self.dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            except FileNotFoundError:  # a finishing holder removed the empty folder between the two
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
                os.close(fd)
                host, _, pid = holder.partition(" ")
                who = f"process {pid} on {host}" if pid else "a process starting now"
                raise FileExistsError(
                    f"--output {self.out} is being written by another draftkit generate ({who}, {lock}); wait for "
                    "it to finish (this command then finds the file done), or stop it") from None
            except OSError as exc:  # a file system without locks (NFS mounted nolock, Lustre without -o flock)
                os.close(fd)
                raise OSError(
                    f"--output {self.out}: cannot lock {lock} ({exc}): this file system offers no file locks, so two "
                    "generate runs of one output could not be kept apart; write --output on a local disk (or a "
                    "mount with locking) and copy the file afterwards") from exc
            if not _is_file_of(fd, lock):
                os.close(fd)
                continue
            previous = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
            if previous and previous != me:
                host, _, pid = previous.partition(" ")
                log.info("generate: taking over %s from process %s on %s, which has ended", self.dir, pid or "?",
                         host or "?")
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)
            if held is not None:
                os.close(held)
            self._lock_fd = fd
            return
        raise FileExistsError(f"{lock} keeps changing hands: another draftkit generate is starting on --output "
                              f"{self.out}; stop it, or write another --output")

    def _remove_torn_temporaries(self) -> None:
        """Remove the temporaries (``atomic_path``'s ``.<name>.XXXX``) that a run killed mid-write left beside the
        output and among the parts: only a generate of this output writes them, and this process holds the lock."""
        torn = atomic_leftovers(self.out.parent, self.out.name) + atomic_leftovers(self.dir)
        for path in torn:
            path.unlink()
        if torn:
            log.info("generate: removed %d temporary file(s) that an interrupted run left: %s", len(torn),
                     ", ".join(str(p) for p in torn))

    def release(self) -> None:
        """Give up this process's claim (:meth:`_lock`): remove its lock, and the folder when nothing else is in it
        (a run that failed before its first shard leaves no trace). Nothing to do after :meth:`join`."""
        lock, fd = self.dir / "lock", getattr(self, "_lock_fd", None)
        if fd is not None:
            if _is_file_of(fd, lock):  # unlinked while still held: a run that opened it meanwhile sees it gone, retries
                lock.unlink()
            os.close(fd)
            self._lock_fd = None
        if self.dir.is_dir() and not any(self.dir.iterdir()):
            self.dir.rmdir()

    def part(self, i: int) -> Path:
        """The part file of shard ``i``."""
        return self.dir / f"shard-{i:05d}.jsonl"

    def done(self, i: int) -> bool:
        """Whether shard ``i`` is finished: in the index with this run's bounds and its part intact (a torn or
        missing part is logged and decoded again)."""
        meta = self.index["shards"].get(str(i))
        if not isinstance(meta, dict) or meta.get("first") != self.shards[i].start \
                or meta.get("count") != len(self.shards[i]):  # missing, damaged or of other bounds: decoded again
            return False
        if i not in self._checked:
            problem = part_problem(self.part(i), meta)
            if problem is not None:
                log.warning("generate: %s is %s; decoding shard %d again", self.part(i), problem, i)
            self._checked[i] = problem is None
        return self._checked[i]

    def write(self, i: int, lines: list[str], meta: dict) -> None:
        """Write shard ``i``'s record lines, then its index entry ``meta`` (``first`` and ``count`` are added).

        Raises:
            OSError: the disk lacks room for the part (``check_free_space``); nothing is written then.
        """
        check_free_space(self.dir, sum(len(line.encode("utf-8")) for line in lines), "generate: shard part")
        write_lines_atomic(self.part(i), lines)
        self._checked[i] = True
        self.index["shards"][str(i)] = {"first": self.shards[i].start, "count": len(self.shards[i]), **meta}
        write_json_atomic(self.index_path, self.index)

    def join(self, header: dict, skipped: dict) -> dict:
        """Write the output file from the finished shards (the header with ``settings``, the shard index without
        timings, the record ids and the counts; ``skipped`` are the reader's skips), check that it reads back
        complete, remove the parts and return the header written.

        Raises:
            RuntimeError: a shard is missing, or the file did not read back complete (then it is removed and the
                parts are kept).
            ValueError: no conversation was answered (every one failed): nothing is written and the parts are
                removed, so that a rerun with other settings starts clean; the message names the reasons.
            OSError: the disk lacks room for the file.
        """
        ids, failed, tokens, body = [], Counter(), 0, []
        for i in range(len(self.shards)):
            if not self.done(i):
                raise RuntimeError(f"{self.dir}: shard {i} is missing after the run")
            meta = self.index["shards"][str(i)]
            ids += meta["ids"]
            failed.update(meta["failed"])
            tokens += meta["new_tokens"]
            body.append(self.part(i).read_text(encoding="utf-8"))
        if not ids:  # a file of no record would only fail later, in training
            shutil.rmtree(self.dir)
            reasons = ", ".join(f"{n} {why}" for why, n in failed.most_common())
            main = failed.most_common(1)[0][0] if failed else ""
            hint = next((h for k, h in FAILURE_HINTS.items() if main.startswith(k)), "the log names each failure")
            raise ValueError(f"generate: no conversation was answered ({reasons}), so nothing was written to "
                             f"{self.out}: {hint}")
        header = {
            **header,
            "settings": self.settings,
            # what a longer rerun reuses (timings left out: the file is the same whether a run was resumed or not)
            "shards": {str(i): {k: v for k, v in self.index["shards"][str(i)].items() if k != "seconds"}
                       for i in range(len(self.shards))},
            "source_ids": ids,
            "counts": {"records": len(ids), "failed": dict(sorted(failed.items())), "skipped_by_reader": skipped,
                       "new_tokens": tokens},
        }
        first = json.dumps({"header": header}, ensure_ascii=False) + "\n"
        check_free_space(self.out.parent, len(first.encode("utf-8")) + sum(len(b.encode("utf-8")) for b in body),
                         f"generate --output {self.out}")
        write_lines_atomic(self.out, [first] + body)
        if read_output(self.out) is None:  # generate's own completeness check, before the parts are removed
            self.out.unlink()
            raise RuntimeError(f"{self.out} did not read back as a complete generate output; the parts in {self.dir} "
                               "are kept")
        shutil.rmtree(self.dir)
        return header
