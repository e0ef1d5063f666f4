"""Chat data: readers for ShareGPT JSON, chat JSONL and ``datasets`` sources; templating with a loss mask.

A conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}``. The loss mask is
1 on tokens of assistant turns, including their end-of-turn token (eagle3-format.md §1, m_t), found by
rendering the chat template on growing prefixes of the conversation: the text an assistant message adds
after ``add_generation_prompt=True`` is its span. A template for which that span cannot be found is an
error, never an all-ones or all-zeros mask.

Shapes: T tokens.
"""

from __future__ import annotations

import gzip
import json
import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ReadSummary",
    "read_conversations",
    "normalize_record",
    "tokenize_conversation",
    "TemplateError",
]

log = logging.getLogger(__name__)

ROLE_ALIASES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


class TemplateError(ValueError):
    """The chat template cannot be used to find assistant spans."""


@dataclass
class ReadSummary:
    """Counts of a read: records kept and records skipped by reason."""

    source: str
    kept: int = 0
    usable: int = 0
    skipped: Counter = field(default_factory=Counter)
    cut_offset: int | None = None
    ids: list[str] = field(default_factory=list)
    """Source id of each kept conversation: the record's ``id`` field, else ``#<n>`` (n = array index of a
    ``.json`` record, line number of a ``.jsonl`` one, row of a ``datasets`` source)."""
    header: dict | None = None
    """The ``header`` object of a chat JSONL whose first line is ``{"header": {...}}`` (written by
    ``draftkit generate``), else None."""

    def __str__(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        cut = f"; file cut off at byte {self.cut_offset}" if self.cut_offset is not None else ""
        capped = f" (first {self.kept} of {self.usable} usable)" if self.usable > self.kept else ""
        return f"{self.source}: {self.kept} conversations kept{capped}; skipped: {skipped}{cut}"


def normalize_record(record) -> tuple[list[dict] | None, str | None]:
    """Turn one ShareGPT (``conversations``: from/value) or chat (``messages``: role/content) record into
    ``[{"role", "content"}]``.

    Leading assistant turns (ShareGPT conversations that start with the model) are dropped.

    Returns:
        (messages, None) or (None, reason) with reason one of ``not an object``, ``empty conversation``,
        ``unknown role``, ``non-string content``, ``no assistant turn``.
    """
    if isinstance(record, list):
        turns = record
    elif isinstance(record, dict):
        turns = record.get("conversations", record.get("messages", record.get("conversation")))
    else:
        return None, "not an object"
    if not isinstance(turns, list) or not turns:
        return None, "empty conversation"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "not an object"
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        if role is None:
            return None, "unknown role"
        if not isinstance(content, str):
            return None, "non-string content"
        messages.append({"role": role, "content": content})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None, "no assistant turn"
    return messages, None


def _iter_json_array(path: Path, summary: ReadSummary):
    """Yield the elements of a top-level JSON array, tolerating a file cut off mid-record."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = 0
    n = len(text)

    def skip_ws(i: int) -> int:
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    pos = skip_ws(pos)
    if pos >= n or text[pos] != "[":
        raise ValueError(f"{path}: expected a JSON array of conversations at the start of the file")
    pos = skip_ws(pos + 1)
    index = 0
    while pos < n and text[pos] != "]":
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if text.rstrip().endswith("]"):
                line = text.count("\n", 0, exc.pos) + 1
                raise ValueError(
                    f"{path}: record {index} is corrupt JSON at line {line} ({exc.msg}); fix or remove that record"
                ) from exc
            summary.cut_offset = len(text[:pos].encode("utf-8"))
            warnings.warn(
                f"{path} is cut off mid-record at byte {summary.cut_offset}: read the {index} complete records "
                "before the cut and ignored the rest",
                stacklevel=3,
            )
            return
        yield index, obj
        index += 1
        pos = skip_ws(end)
        if pos < n and text[pos] == ",":
            pos = skip_ws(pos + 1)
    if pos >= n and summary.cut_offset is None:
        summary.cut_offset = len(text.encode("utf-8"))
        warnings.warn(f"{path} ends without closing ']': read {index} complete records", stacklevel=3)


def _iter_jsonl(path: Path, summary: ReadSummary):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError:
                summary.skipped["corrupt JSON line"] += 1
                if summary.skipped["corrupt JSON line"] <= 3:
                    log.warning("%s: line %d is not valid JSON; skipped", path, lineno)


def _iter_datasets(ref: str, split: str):
    import datasets

    path = Path(ref)
    if path.is_dir() and (path / "dataset_info.json").exists():
        ds = datasets.load_from_disk(str(path))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        ds = datasets.load_dataset(ref, split=split)
    yield from enumerate(ds)


def read_conversations(ref: str, split: str = "train", max_records: int | None = None) -> tuple[list[list[dict]], ReadSummary]:
    """Read every usable conversation of a data source.

    Args:
        ref: a local ``.json`` (array of ShareGPT or chat records; a file cut off mid-record is read up to the
            cut with one warning), a local ``.jsonl`` or ``.jsonl.gz`` (one record per line; a first line
            ``{"header": {...}}`` is kept in ``summary.header``, not read as a record), or a ``datasets`` source (hub id,
            a directory saved with ``save_to_disk``, or a local data file ``datasets`` can load).
        split: the ``datasets`` split.
        max_records: keep only the first this many usable conversations (None = all); the rest of the
            source is still read, so the summary and the cut-off warning cover the whole file.

    Returns:
        (conversations, summary); malformed records are skipped and counted by reason in the summary.

    Raises:
        FileNotFoundError: if a local path does not exist.
        ValueError: on a JSON file that is corrupt before its end (names the record and line).
    """
    path = Path(ref)
    summary = ReadSummary(source=str(ref))
    if path.suffix == ".json" and path.is_file():
        records = _iter_json_array(path, summary)
    elif path.name.endswith((".jsonl", ".jsonl.gz")) and path.is_file():
        records = _iter_jsonl(path, summary)
    elif path.name.endswith((".json", ".jsonl", ".jsonl.gz")) and not path.exists():
        raise FileNotFoundError(f"data file {ref} does not exist; fix data.path in the recipe")
    else:
        records = _iter_datasets(ref, split)
    conversations = []
    for n, (where, record) in enumerate(records):
        if n == 0 and isinstance(record, dict) and set(record) == {"header"}:
            summary.header = record["header"]
            continue
        messages, reason = normalize_record(record)
        if messages is None:
            summary.skipped[reason] += 1
            continue
        summary.usable += 1
        if max_records is None or summary.kept < max_records:
            conversations.append(messages)
            summary.kept += 1
            rid = record.get("id") if isinstance(record, dict) else None
            summary.ids.append(str(rid) if isinstance(rid, (str, int)) else f"#{where}")
    return conversations, summary


def _render(tokenizer, messages, chat_template, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )


def tokenize_conversation(tokenizer, messages: list[dict], chat_template: str | None = None, max_length: int | None = None):
    """Render a conversation with the chat template and mark assistant tokens.

    Algorithm: for each assistant message i, the span it adds is the text between
    ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])`` (trailing whitespace
    after the end-of-turn marker excluded); tokens whose character range overlaps a span get mask 1.

    Args:
        tokenizer: a fast (offset-mapping) Hugging Face tokenizer.
        messages: ``[{"role", "content"}]``.
        chat_template: a Jinja template, or None for the tokenizer's own.
        max_length: truncate to this many tokens (None = no limit).

    Returns:
        dict with ``input_ids`` (list[int], length T), ``loss_mask`` (list[int] 0/1, length T) and
        ``truncated`` (bool).

    Raises:
        TemplateError: when the template renders no prefix-stable assistant span.
    """
    full = _render(tokenizer, messages, chat_template)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], chat_template, add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], chat_template)
        if not (upto.startswith(prefix) and full.startswith(upto)) or len(upto.rstrip()) <= len(prefix):
            raise TemplateError(
                "no assistant span found: the chat template does not render conversations prefix-stably "
                "(render(messages[:i], add_generation_prompt=True) must be a prefix of render(messages[:i+1])); "
                "give data.chat_template a template that does"
            )
        spans.append((len(prefix), len(upto.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    j = 0
    for t, (start, end) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j < len(spans) and end > spans[j][0] and start < spans[j][1]:
            mask[t] = 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask, "truncated": truncated}
