"""The output file of ``draftkit generate`` and its shards: the header's format, the atomic (gzip) writer, the
complete-file reader that resume and joining trust, the per-shard check, and the settings that differ between two
headers (for refusals). ``draftkit.generation.regenerate`` writes it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from draftkit.jsonio import atomic_path

FORMAT = "draftkit-regenerated-chat/1"
"""``header.format`` of the output file."""


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
