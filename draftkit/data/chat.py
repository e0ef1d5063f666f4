"""Chat data: readers for ShareGPT JSON, chat JSONL and ``datasets`` sources; templating with a loss mask.

A conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}`` (a record's content may
also be an OpenAI-style list of text parts, joined by :func:`content_text`). The loss mask is
1 on tokens of assistant turns, including their end-of-turn token (eagle3-format.md §1, m_t), found by
rendering the chat template on growing prefixes of the conversation: the text an assistant message adds
after ``add_generation_prompt=True`` is its span. A template for which that span cannot be found is an
error, never an all-ones or all-zeros mask.

Shapes: T tokens.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import json
import logging
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftkit.jsonio import json_error, short_hash

__all__ = [
    "ReadSummary",
    "content_text",
    "decode_file",
    "READ_HINTS",
    "describe_skips",
    "read_hint",
    "read_conversations",
    "normalize_record",
    "tokenize_conversation",
    "tokenization_fingerprint",
    "TemplateError",
    "unencodable_at",
]

log = logging.getLogger(__name__)

ROLE_ALIASES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


READ_HINTS = {
    "unknown role": "give every turn the role user, assistant or system (tool and function-call turns are not "
                    "trained: drop those turns, or the records that hold them)",
    "non-string content": "give every turn its text (an assistant turn that only calls a tool has none: drop those "
                          "turns, or the records that hold them)",
}
"""What to do about skip reasons of :func:`normalize_record` that name a known shape of data."""


def read_hint(reason: str) -> str:
    """What to do about records skipped for ``reason`` (:data:`READ_HINTS`, else: convert the data)."""
    return READ_HINTS.get(reason, "convert the data to chat (messages) or ShareGPT (conversations) records, fix "
                                  "data.chat_template")


class TemplateError(ValueError):
    """The chat template cannot be used to find assistant spans."""


SHOW_PER_REASON = 3
"""Records named per skip reason in a summary's text; the full list is in :meth:`ReadSummary.skip_rows`."""


@dataclass
class ReadSummary:
    """What a read did with every record: kept, or skipped with its id and a reason.

    ``skips`` holds one ``(record, reason, detail)`` per skipped record: ``record`` is the record's own id
    (its ``id``, ``conversation_id`` or ``question_id`` field) or, without one, its position (``record 3`` in
    a JSON array, 0-based; ``line 4`` in a JSONL file, 1-based; ``row 3`` in a ``datasets`` source);
    ``reason`` is a label (the key of ``skipped``); ``detail`` says exactly what is wrong in that record.
    """

    source: str
    kept: int = 0
    usable: int = 0
    skipped: Counter = field(default_factory=Counter)
    skips: list[tuple[str, str, str]] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    """Names (as in ``skips``) of the kept conversations, in order."""
    cut_offset: int | None = None
    header: dict | None = None
    """The ``header`` object of a chat JSONL whose first line is ``{"header": {...}}`` (written by
    ``draftkit generate``), else None."""

    def skip(self, record: str, reason: str, detail: str = "") -> None:
        """Count one skipped record under ``reason`` and keep its name and detail."""
        self.skipped[reason] += 1
        self.skips.append((record, reason, detail))

    def skip_rows(self) -> list[dict]:
        """Every skipped record as ``{"record", "reason", "detail"}`` (for the run's skip list file)."""
        return [{"record": r, "reason": why, "detail": d} for r, why, d in self.skips]

    def __str__(self) -> str:
        skipped = describe_skips(self.skips) or "none"
        cut = f"; file cut off at byte {self.cut_offset}" if self.cut_offset is not None else ""
        capped = f" (first {self.kept} of {self.usable} usable)" if self.usable > self.kept else ""
        return f"{self.source}: {self.kept} conversations kept{capped}; skipped: {skipped}{cut}"


def describe_skips(skips, show: int = SHOW_PER_REASON) -> str:
    """``"2 unknown role (r1: turn 0 role 'alien', r7: ...), 1 empty conversation (record 3)"``: the count of
    each reason with its first ``show`` records named, reasons in alphabetical order.

    Args:
        skips: ``(record, reason, detail)`` triples or ``{"record", "reason", "detail"}`` dicts.
    """
    by_reason: dict[str, list[str]] = {}
    for s in skips:
        record, why, detail = (s["record"], s["reason"], s["detail"]) if isinstance(s, dict) else s
        by_reason.setdefault(why, []).append(f"{record}: {detail}" if detail else record)
    parts = []
    for why, names in sorted(by_reason.items()):
        more = f", ... {len(names) - show} more" if len(names) > show else ""
        parts.append(f"{len(names)} {why} ({', '.join(names[:show])}{more})")
    return ", ".join(parts)


ID_KEYS = ("id", "conversation_id", "question_id")


def record_name(record, position: str) -> str:
    """A record's own id when it has one (``id``, ``conversation_id``, ``question_id``), else ``position``.

    The name is always encodable (a lone surrogate in an id is written as ``\\udXXX``).
    """
    if isinstance(record, dict):
        for key in ID_KEYS:
            value = record.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
                return str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return position


def _json_type(value) -> str:
    """The JSON name of a parsed value's type (``null``, ``number``, ``array``, ...)."""
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array",
             dict: "object"}
    return names.get(type(value), type(value).__name__)


def unencodable_at(text: str) -> int | None:
    """Index of the first character UTF-8 cannot encode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return exc.start


TEXT_PART_SEPARATOR = "\n"
"""What joins the text parts of one turn's content (:func:`content_text`)."""


def content_text(content) -> tuple[str | None, tuple[str, str] | None]:
    """One turn's content as text: a string as it is, or an OpenAI-style list of content parts
    (``[{"type": "text", "text": "..."}, ...]``, the chat-completions format users export) with its text parts
    joined by a newline (:data:`TEXT_PART_SEPARATOR`; an empty list is ``""``).

    The join is vLLM's for a chat template that renders ``message['content']`` as a string (text-only targets:
    Llama, Qwen, SmolLM2, ...): ``vllm/entrypoints/chat_utils.py``, ``_parse_chat_message_content_parts``,
    ``"\\n".join(texts)``; TensorRT-LLM's OpenAI server (``parse_chat_message_content``) joins the same way.
    Hugging Face transformers' ``apply_chat_template`` does not join: it hands the list to the template, and a
    template that loops over the parts (multimodal ones) concatenates them itself; SGLang joins with a space
    (``sglang/srt/parser/jinja_template_utils.py``, ``process_content_for_template_format``). A head serves
    best on the text the serving engine renders, hence vLLM's rule.

    Every reader of chats and prompts (``normalize_record``: training data and regeneration sources;
    ``data.prompts.load_prompts``: evaluate's prompt files) reads content through this function.

    Returns:
        (text, None), or (None, (reason, detail)) with reason ``non-text content part`` (an ``image_url``,
        ``input_audio``, ... part; detail names the part's index and type) or ``non-string content`` (content
        neither a string nor a list of parts, or a part without a string ``text``); detail starts with
        ``content``.
    """
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        return None, ("non-string content", f"content is {_json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(kind, str) and kind != "text":
            return None, ("non-text content part",
                          f"content part {j} is {kind!r}: draftkit reads text only; drop the {kind} parts or the record")
        else:
            return None, ("non-string content", f"content part {j} is not a {{\"type\": \"text\", \"text\": string}} "
                                                 f"object (got {_json_type(part)})")
    return TEXT_PART_SEPARATOR.join(texts), None


def normalize_record(record) -> tuple[list[dict] | None, tuple[str, str] | None]:
    """Turn one ShareGPT (``conversations``: from/value) or chat (``messages``: role/content) record into
    ``[{"role", "content"}]``.

    Leading assistant turns (ShareGPT conversations that start with the model) are dropped. Text that
    UTF-8 cannot encode (a lone surrogate from a ``\\ud800`` escape, or an invalid byte of the file, which
    the readers decode as a lone surrogate) would crash the tokenizer and Arrow, so such a record is skipped.

    Returns:
        (messages, None), or (None, (reason, detail)) with reason one of ``not an object``,
        ``no conversation key``, ``conversation not a list``, ``empty conversation``, ``turn not an object``,
        ``missing role``, ``unknown role``, ``missing content``, ``non-string content``, ``non-text content part``
        (:func:`content_text`; a list of text parts is joined there), ``unencodable text``,
        ``no assistant turn``, ``empty assistant turn``; detail names the turn and value at fault.
    """
    if isinstance(record, list):
        turns = record
    elif isinstance(record, dict):
        key = next((k for k in ("conversations", "messages", "conversation") if k in record), None)
        if key is None:
            keys = ", ".join(sorted(map(str, record))) or "none"
            return None, ("no conversation key", f"no conversations/messages key (keys: {keys})")
        turns = record[key]
        if not isinstance(turns, list):
            return None, ("conversation not a list", f"{key} is {_json_type(turns)}, not a list of turns")
    else:
        return None, ("not an object", f"record is {_json_type(record)}, not an object")
    if not turns:
        return None, ("empty conversation", "no turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None, ("turn not an object", f"turn {i} is {_json_type(turn)}")
        role = turn.get("role", turn.get("from"))
        if role is None:
            return None, ("missing role", f"turn {i} has no role/from")
        content = turn.get("content", turn.get("value"))
        if ROLE_ALIASES.get(str(role).lower()) is None:
            return None, ("unknown role", f"turn {i} role {str(role)!r}")
        if content is None and not ({"content", "value"} & turn.keys()):
            return None, ("missing content", f"turn {i} has no content/value")
        content, problem = content_text(content)
        if problem is not None:
            return None, (problem[0], f"turn {i} {problem[1]}")
        bad = unencodable_at(content)
        if bad is not None:
            return None, ("unencodable text",
                          f"turn {i} has U+{ord(content[bad]):04X} at character {bad} (a lone surrogate or an "
                          "invalid UTF-8 byte); fix the text or the file's encoding")
        messages.append({"role": ROLE_ALIASES[str(role).lower()], "content": content})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not any(m["role"] == "assistant" for m in messages):
        return None, ("no assistant turn", "no assistant turn after the first user turn")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None, ("empty assistant turn", "every assistant turn is blank")
    return messages, None


BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF16_LE, "utf-16"),
        (codecs.BOM_UTF16_BE, "utf-16"))
"""Byte-order marks of the encodings a data file may be in besides UTF-8 (a Windows editor or PowerShell's
``>`` writes UTF-16 with a mark)."""


def _gunzip(path: Path, data: bytes) -> bytes:
    """The decompressed bytes of a ``.gz`` file; of a file cut off mid-stream, those before the cut, with one
    warning (as a JSON file cut off mid-record is read up to the cut).

    Raises:
        ValueError: when the file is not gzip data or its stream is corrupt (naming the file and what to do).
    """
    try:
        return gzip.decompress(data)
    except EOFError:
        pass
    except (OSError, zlib.error) as exc:  # gzip.BadGzipFile, a CRC mismatch, a corrupt deflate stream
        raise ValueError(
            f"{path} is not readable gzip data ({exc}): if it is plain text, drop the .gz from its name; "
            "else copy or download the file again"
        ) from exc
    out, rest = [], data
    while rest:  # members one by one (a gzip file may hold several); the last one is cut off
        member = zlib.decompressobj(wbits=31)
        out.append(member.decompress(rest))
        if not member.eof:
            break
        rest = member.unused_data
    text = b"".join(out)
    warnings.warn(
        f"{path} is cut off: its gzip stream ends early (after {len(data):,} compressed bytes); read the "
        f"{len(text):,} bytes before the cut and ignored the rest (copy or download the file again for all of it)",
        stacklevel=4,
    )
    return text


def decode_file(path: Path) -> str:
    """A data file's text: UTF-8 without its byte-order mark, or UTF-16/UTF-32 with one (:data:`BOMS`); an
    invalid byte becomes a lone surrogate (``surrogateescape``), which :func:`normalize_record` then names in
    its record; ``.gz`` files are decompressed first (:func:`_gunzip`)."""
    data = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        data = _gunzip(path, data)
    encoding = next((enc for bom, enc in BOMS if data.startswith(bom)), "utf-8-sig")
    return data.decode(encoding, errors="surrogateescape")


def _iter_json_array(path: Path, summary: ReadSummary):
    """Yield ``(name, record)`` for the elements of a top-level JSON array, tolerating a file cut off
    mid-record."""
    text = decode_file(path)
    decoder = json.JSONDecoder()
    pos = 0
    n = len(text)

    def skip_ws(i: int) -> int:
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    pos = skip_ws(pos)
    if pos >= n:
        raise ValueError(f"{path} is empty: a .json data file holds a JSON array of conversation records")
    if text[pos] == "{":
        raise ValueError(
            f"{path} starts with an object, not a JSON array of records: for one record per line (JSON Lines) "
            "name the file .jsonl; for a single conversation write it as [ {...} ]"
        )
    if text[pos] != "[":
        raise ValueError(f"{path}: expected a JSON array of conversations at the start of the file")
    pos = skip_ws(pos + 1)
    index = 0
    while pos < n and text[pos] != "]":
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if text.rstrip().endswith("]"):
                raise ValueError(
                    f"{path}: record {index} is corrupt JSON ({json_error(exc, line=True)}); fix or remove that record"
                ) from exc
            summary.cut_offset = len(text[:pos].encode("utf-8", "surrogateescape"))
            warnings.warn(
                f"{path} is cut off mid-record at byte {summary.cut_offset}: read the {index} complete records "
                "before the cut and ignored the rest",
                stacklevel=3,
            )
            return
        yield record_name(obj, f"record {index}"), obj
        index += 1
        pos = skip_ws(end)
        if pos < n and text[pos] == ",":
            pos = skip_ws(pos + 1)
    if pos >= n and summary.cut_offset is None:
        summary.cut_offset = len(text.encode("utf-8", "surrogateescape"))
        warnings.warn(f"{path} ends without closing ']': read {index} complete records", stacklevel=3)


def _iter_jsonl(path: Path, summary: ReadSummary):
    """Yield ``(name, record)`` per non-blank line; LF or CRLF line ends, a byte-order mark on any line
    (concatenated files) ignored; a line that is not JSON is skipped and named."""
    for lineno, line in enumerate(decode_file(path).split("\n"), 1):
        line = line.lstrip("\ufeff").strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            summary.skip(f"line {lineno}", "corrupt JSON line", json_error(exc))
            continue
        if isinstance(record, list) and record and all(
                isinstance(r, dict) and r.keys() & {"conversations", "messages", "conversation"} for r in record):
            raise ValueError(
                f"{path} line {lineno} holds a JSON array of {len(record)} records, not one record: a .jsonl file "
                "has one record per line; name a file that holds a JSON array .json"
            )
        yield record_name(record, f"line {lineno}"), record


def _check_data_directory(path: Path) -> None:
    """Refuse a directory ``datasets`` would misread: one holding chat ``.json``/``.jsonl`` files (it casts them to
    one schema, failing on two formats, or reads only some of them) or nothing at all. A directory of parquet, CSV
    or arrow files (a local copy of a hub dataset) is left to ``datasets``.

    Raises:
        ValueError: naming the directory, its chat files and what to give instead.
    """
    files = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    chat = [f for f in files if f.lower().endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz"))]
    if chat or not any(path.iterdir()):
        held = f"holds the chat files {chat[:4]}{' ...' if len(chat) > 4 else ''}" if chat else "is empty"
        raise ValueError(
            f"data.path {path} is a directory that {held}; give one file (join several JSONL files with cat, "
            "gzip ones too: their members concatenate), or a dataset saved with datasets' save_to_disk")


def _iter_datasets(ref: str, split: str):
    import datasets

    path = Path(ref)
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        if path.is_dir():
            _check_data_directory(path)
        ds = datasets.load_dataset(ref, split=split)
    for index, record in enumerate(ds):
        yield record_name(record, f"row {index}"), record


def read_conversations(ref: str, split: str = "train", max_records: int | None = None) -> tuple[list[list[dict]], ReadSummary]:
    """Read every usable conversation of a data source.

    Args:
        ref: a local ``.json`` or ``.json.gz`` (array of ShareGPT or chat records; a file cut off mid-record is
            read up to the cut with one warning), a local ``.jsonl`` or ``.jsonl.gz`` (one record per line; a first
            line ``{"header": {...}}`` is kept in ``summary.header``, not read as a record, and a later such line, as
            in ``draftkit generate`` outputs joined with ``cat``, is no record either), or a ``datasets`` source
            (hub id, a directory saved with ``save_to_disk``, a directory of parquet/CSV/arrow files, or a local data
            file ``datasets`` can load; a directory of chat JSON/JSONL files is refused: give one file). Local
            files are UTF-8 (with or without a byte-order mark) or UTF-16/UTF-32 with a byte-order mark, with LF or
            CRLF line ends; a ``.gz`` file cut off mid-stream is read up to the cut with one warning.
        split: the ``datasets`` split.
        max_records: keep only the first this many usable conversations (None = all); the rest of the
            source is still read, so the summary and the cut-off warning cover the whole file.

    Returns:
        (conversations, summary); every record is either kept (``summary.records`` names it) or skipped with
        its name, reason and detail in ``summary.skips`` (see :func:`normalize_record`).

    Raises:
        FileNotFoundError: if a local path does not exist.
        ValueError: on a JSON file that is corrupt before its end (names the record and line), a directory of chat
            files or an empty one (:func:`_check_data_directory`), a ``.json`` file
            that is not a JSON array, a ``.jsonl`` line that holds an array of records, or a ``.gz`` file that is
            not gzip data (each naming the file and what to do).
    """
    path = Path(ref)
    summary = ReadSummary(source=str(ref))
    name = path.name.lower()  # data.JSONL is JSON Lines too (it went to the Hub as a dataset id)
    if name.endswith((".json", ".json.gz")) and path.is_file():
        records = _iter_json_array(path, summary)
    elif name.endswith((".jsonl", ".jsonl.gz")) and path.is_file():
        records = _iter_jsonl(path, summary)
    elif name.endswith((".json", ".json.gz", ".jsonl", ".jsonl.gz")) and not path.exists():
        raise FileNotFoundError(f"data file {ref} does not exist; fix data.path in the recipe")
    else:
        records = _iter_datasets(ref, split)
    conversations = []
    for n, (name, record) in enumerate(records):
        if isinstance(record, dict) and set(record) == {"header"}:  # a later one: generate outputs joined with cat
            summary.header = record["header"] if n == 0 else summary.header
            continue
        messages, why = normalize_record(record)
        if messages is None:
            summary.skip(name, *why)
            continue
        summary.usable += 1
        if max_records is None or summary.kept < max_records:
            conversations.append(messages)
            summary.records.append(name)
            summary.kept += 1
    return conversations, summary


@functools.cache
def tokenization_fingerprint() -> str:
    """16 hex digits over draftkit's version and the source of this module (readers, templating, loss mask,
    truncation): the tokenized-data cache key includes it, so a change to how conversations are tokenized
    re-tokenizes instead of reusing a cache written by the old code."""
    from draftkit import __version__

    return short_hash(f"draftkit {__version__};".encode() + Path(__file__).read_bytes())


def _render(tokenizer, messages, chat_template, add_generation_prompt=False) -> str:
    """The template's text for ``messages``.

    Raises:
        TemplateError: when the template itself raises for these messages (``raise_exception``, an undefined
            name, a syntax error), with jinja's message.
    """
    from jinja2.exceptions import TemplateError as JinjaError

    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
        )
    except JinjaError as exc:
        raise TemplateError(f"the chat template raised {type(exc).__name__}: {exc}") from exc


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
        TemplateError: when the template renders no prefix-stable assistant span (naming the assistant turn),
            or raises for this conversation.
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
                f"no assistant span found for assistant turn {i}: the chat template does not render conversations prefix-stably "
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
