"""Honest train/validation splits: prompts normalised, duplicates and context-free fragments dropped, and the
split grouped by prompt so that no prompt is on both sides.

Why: in regenerated ShareGPT a split by row put 9 of 32 validation conversations' exact prompts in training
("continue", "Please continue", ... up to 45 copies each); those scored τ_sim 3.52 against 1.90 for the clean
ones, and checkpoint choice read the mix. The rule here is the one the data summary reports:

1. **normalise** a prompt (the conversation's first user turn): Unicode NFKC, lower case, every run of
   whitespace to one space, leading/trailing whitespace and punctuation stripped;
2. **context-free** prompts are dropped: empty after normalising, shorter than ``min_prompt_chars``
   characters, made only of continuation/filler words (:data:`FILLER_WORDS`: "continue", "go on",
   "please continue", "more", "ok thanks", ...), or opening with a request to go on (:data:`CONTINUATION_STARTS`:
   "continue writing please", "please continue from the last code snippet") — such a turn only makes sense after
   an earlier answer that the record does not hold;
3. **duplicates** are dropped after their first occurrence (in file order), when asked: a row whose normalised
   prompt *and* answers repeat an earlier row's. Several answers to one prompt (sampled regeneration, best-of-n)
   are a supported shape of data: they all train, since each is a sample of the target's distribution;
4. the rest is split by a seeded permutation of the distinct prompts: every row of a prompt goes to the same side
   (all sampled answers of a prompt train, or all validate).

Shapes: none (lists of strings and row indices).
"""

from __future__ import annotations

import collections
import logging
import random
import re
import unicodedata
from dataclasses import dataclass

__all__ = ["CONTINUATION_STARTS", "FILLER_WORDS", "PromptFilter", "check_split_sizes", "first_prompt", "grouped_split",
           "normalize_prompt"]

FILLER_WORDS = frozenset(
    "continue continued continuing go on keep going please pls more next proceed and then ok okay yes yeah "
    "sure thanks thank you great good nice cool again resume carry finish write the rest it from where you left "
    "off stopped".split()
)
"""Words a context-free prompt is made of only (after normalising): "continue", "please go on", "ok, more"."""

CONTINUATION_STARTS = ("continue", "contiune", "continua", "keep going", "go on", "resume", "carry on")
"""Openings of a prompt that asks to go on with an answer the record does not hold ("continue writing please",
"please continue from the last code snippet"); an optional leading "please" is ignored."""

_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"[^\W_]+")


def normalize_prompt(text: str) -> str:
    """The prompt key: NFKC, lower case, whitespace runs to one space, leading/trailing whitespace and
    punctuation removed. ``"  Please  CONTINUE!! "`` -> ``"please continue"``.

    Args:
        text: the prompt text (str).
    """
    text = _SPACE.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()
    start, end = 0, len(text)
    while start < end and (unicodedata.category(text[start]).startswith("P") or text[start] == " "):
        start += 1
    while end > start and (unicodedata.category(text[end - 1]).startswith("P") or text[end - 1] == " "):
        end -= 1
    return text[start:end]


def first_prompt(messages: list[dict]) -> str:
    """The text of the first ``user`` turn of a conversation (``[{"role", "content"}, ...]``), "" without one."""
    return next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")


@dataclass
class PromptFilter:
    """Which rows to keep, by their first prompt (the documented rule of this module).

    Args:
        min_prompt_chars: a normalised prompt shorter than this many characters is context-free (0 = off).
        drop_fillers: drop prompts made only of :data:`FILLER_WORDS`.
        dedup: drop a row whose normalised prompt and answers both repeat an earlier row's.
    """

    min_prompt_chars: int = 8
    drop_fillers: bool = True
    dedup: bool = True

    def why_dropped(self, key: str, seen: set, answers=None) -> str | None:
        """The reason a row with normalised prompt ``key`` is dropped ("empty prompt", "context-free prompt",
        "duplicate conversation"), or None when it is kept; ``seen`` holds the ``(key, answers)`` kept so far."""
        if not key:
            return "empty prompt"
        if self.drop_fillers and (all(w in FILLER_WORDS for w in _WORD.findall(key))
                                  or key.removeprefix("please ").startswith(CONTINUATION_STARTS)):
            return "context-free prompt"
        if len(key) < self.min_prompt_chars:
            return "context-free prompt"
        if self.dedup and (key, answers) in seen:
            return "duplicate conversation"
        return None

    def keep(self, prompts: list[str], answers: list | None = None) -> tuple[list[int], list[str], dict[str, list[int]]]:
        """Apply the rule to rows in order.

        Args:
            prompts: the first prompt of each row (raw text), length N.
            answers: a hashable key of the rest of each row (its answers, e.g. a digest of its tokens), length N;
                None: every row of a prompt has the same answers (so only its first row is kept).

        Returns:
            ``(kept, keys, dropped)``: kept row indices (ascending), the normalised key of every row (length N),
            and ``{reason: [row, ...]}`` for the dropped rows.
        """
        keys = [normalize_prompt(p) for p in prompts]
        kept, seen, dropped = [], set(), {}
        for i, key in enumerate(keys):
            row = (key, None if answers is None else answers[i])
            why = self.why_dropped(key, seen, row[1])
            if why is None:
                kept.append(i)
                seen.add(row)
            else:
                dropped.setdefault(why, []).append(i)
        return kept, keys, dropped


def grouped_split(keys: list[str], rows: list[int], val_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Split ``rows`` into train and validation so that no prompt key is on both sides.

    The distinct keys of ``rows`` are shuffled with ``random.Random(seed)`` (in order of first appearance
    before shuffling); whole groups go to validation until it holds at least ``val_size`` rows (a group may
    overshoot it by its size - 1), the rest to training.

    Args:
        keys: the normalised prompt of every row of the data (indexed by row).
        rows: the rows to split (ascending).
        val_size: validation rows wanted (0 = none).
        seed: the split's seed.

    Returns:
        ``(train_rows, val_rows)``, each ascending.

    Raises:
        ValueError: when ``val_size`` is negative.
    """
    if val_size < 0:
        raise ValueError(f"data.val_size must be >= 0, got {val_size}")
    groups: dict[str, list[int]] = {}
    for r in rows:
        groups.setdefault(keys[r], []).append(r)
    order = list(groups)
    random.Random(seed).shuffle(order)
    val: list[int] = []
    taken = 0
    for key in order:
        if len(val) >= val_size:
            break
        val.extend(groups[key])
        taken += 1
    train = [r for key in order[taken:] for r in groups[key]]
    return sorted(train), sorted(val)


def check_split_sizes(path: str, val_size: int, keys: list[str], train_rows: list[int], val_rows: list[int]) -> None:
    """Sequences that share a first prompt stay on one side of :func:`grouped_split`, so validation can take more
    than ``val_size`` (several answers per prompt): refuse a split that leaves nothing to train on, and warn when
    validation holds more than twice what was asked, naming the largest prompt group.

    Args:
        path: the data source (``data.path``), named in the message.
        val_size: ``data.val_size``.
        keys: the normalised first prompt of every row.
        train_rows, val_rows: the split's rows.

    Raises:
        ValueError: no training sequence is left, naming ``data.path``, ``data.val_size`` and the prompt.
    """
    if not val_rows or (train_rows and len(val_rows) <= 2 * val_size):
        return
    prompt, size = collections.Counter(keys[i] for i in val_rows).most_common(1)[0]
    why = (f"validation took {len(val_rows)} sequences for data.val_size={val_size}: the sequences of one first "
           f"prompt stay on one side, and {size} share the prompt {prompt[:60]!r}")
    if not train_rows:
        raise ValueError(f"{path}: the split by first prompt leaves no sequence to train on ({why}); add "
                         "conversations with other first prompts, or set data.val_size 0 to train on all of them")
    logging.getLogger(__name__).warning("%s: %s; %d sequences train", path, why, len(train_rows))
