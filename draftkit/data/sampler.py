"""Seeded, rank-aware, resumable batching: length bucketing, the epoch sampler and the resumable loader.

Under DDP every rank reads its slice of the same seeded global batches (:class:`EpochSampler`), optionally
length-bucketed to cut padding; the loader position is checkpointed for exact resume.

Shapes: B sequences.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["EpochSampler", "ResumableLoader", "bucket_by_length"]


def bucket_by_length(
    order: list[int], lengths, batch: int, window: int, generator: torch.Generator
) -> list[list[int]]:
    """Cut a seeded order into batches of similar length, window by window (length bucketing).

    1. Split ``order`` into windows of ``window`` sequences (rounded up to a multiple of ``batch``).
    2. In each window, sort by length (stable, longest first) and cut into batches of ``batch`` sequences.
    3. Shuffle the full batches of each window with ``generator``, so lengths do not rise or fall through
       the epoch; a partial batch (only possible in the last window) stays last.

    Every sequence appears exactly once, and the result depends only on (order, lengths, batch, window,
    generator state), so a resumed run rebuilds the same batches.

    Args:
        order: a permutation of sequence indices.
        lengths: lengths[i] = tokens of sequence i (any indexable of ints).
        batch: sequences per (global) batch.
        window: sequences per bucketing window; 0 or 1 keeps ``order`` as it is.
        generator: seeded generator for the batch shuffle.

    Returns:
        The batches (lists of indices), all of ``batch`` sequences except possibly the last.
    """
    if window <= 1:
        return [order[i:i + batch] for i in range(0, len(order), batch)]
    window = -(-window // batch) * batch
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: -int(lengths[i]))
        cut = [chunk[i:i + batch] for i in range(0, len(chunk), batch)]
        tail = [cut.pop()] if len(cut[-1]) < batch else []
        perm = torch.randperm(len(cut), generator=generator).tolist()
        batches += [cut[j] for j in perm] + tail
    return batches


class EpochSampler(DistributedSampler):
    """This rank's share of one seeded global order per epoch, resumable by batches.

    The global order is a seeded permutation per epoch (or the identity), optionally length-bucketed
    (:func:`bucket_by_length`), cut into *global* batches of ``batch_size * num_replicas`` sequences.
    Rank r takes the contiguous slice [r*b, (r+1)*b) of each global batch, so ``num_replicas`` ranks with
    batch b train on exactly the sequences one process trains on with batch ``num_replicas * b``, step for
    step. A rank whose slice of the last (partial) global batch is empty repeats the first sequence of the
    global batch (as ``DistributedSampler`` pads), so every rank runs the same number of steps.

    Subclassing ``DistributedSampler`` tells Lightning to leave the loader alone under DDP/FSDP instead of
    re-instantiating it with its own sampler.

    Args:
        size: sequences in the dataset.
        seed: seed of the per-epoch permutation (epoch e uses ``seed * 100003 + e``).
        shuffle: permute (True) or keep index order (False).
        batch_size: b, sequences per rank per step.
        num_replicas: data-parallel ranks.
        rank: this rank.
        lengths: (size,) tokens per sequence, needed for bucketing.
        bucket_window: sequences per bucketing window; 0 = no bucketing.
    """

    def __init__(
        self, size: int, seed: int, shuffle: bool, batch_size: int = 1, num_replicas: int = 1, rank: int = 0,
        lengths=None, bucket_window: int = 0,
    ) -> None:
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        if bucket_window > 1 and lengths is None:
            raise ValueError("length bucketing needs the sequence lengths")
        self.size, self.batch_size = size, batch_size
        self.lengths, self.bucket_window = lengths, bucket_window
        self.skip = 0  # batches of this epoch already consumed (resume)

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches (lists of sequence indices)."""
        gen = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        order = torch.randperm(self.size, generator=gen) if self.shuffle else torch.arange(self.size)
        window = self.bucket_window if self.shuffle else 0
        return bucket_by_length(order.tolist(), self.lengths, self.batch_size * self.num_replicas, window, gen)

    def rank_batches(self) -> list[list[int]]:
        """This rank's batches for the epoch: slice [r*b, (r+1)*b) of every global batch."""
        b, r = self.batch_size, self.rank
        out = []
        for g in self.global_batches():
            mine = g[r * b:(r + 1) * b]
            if not mine and self.num_replicas > 1:
                mine = g[:1]  # pad: every rank must run the same number of steps
            out.append(mine)
        return out

    def __len__(self) -> int:
        if self.size == 0:
            return 0
        b, g = self.batch_size, self.batch_size * self.num_replicas
        full = -(-self.size // g) - 1  # global batches before the last one
        last = self.size - full * g  # sequences in the last global batch
        mine = min(b, max(0, last - self.rank * b)) or (1 if self.num_replicas > 1 else 0)
        return full * b + mine

    def __iter__(self):
        return iter([i for batch in self.rank_batches()[self.skip:] for i in batch])


class ResumableLoader(DataLoader):
    """A DataLoader whose position (epoch, batches consumed) is saved in Lightning checkpoints, so that
    ``ckpt_path`` continues with exactly the batches an uninterrupted run would have seen.

    Lightning does not pre-fetch from loaders with a known length, so the batches yielded so far are the
    batches trained so far. Its sampler is rank-aware (:class:`EpochSampler`); every rank consumes the
    same number of batches, so rank 0's saved position is every rank's position.

    Args:
        dataset: map-style dataset.
        seed: seed of the per-epoch permutation.
        shuffle: permute each epoch.
        num_replicas: data-parallel ranks (``trainer.distributed_sampler_kwargs``).
        rank: this rank.
        lengths: tokens per sequence (for ``bucket_window``).
        bucket_window: sequences per length-bucketing window (0 = off).
        **kwargs: ``DataLoader`` arguments (``batch_size``, ``collate_fn``, ``num_workers``, ...).
    """

    def __init__(
        self, dataset, seed: int, shuffle: bool, num_replicas: int = 1, rank: int = 0, lengths=None,
        bucket_window: int = 0, **kwargs,
    ) -> None:
        self._order = EpochSampler(
            len(dataset), seed, shuffle, kwargs.get("batch_size", 1), num_replicas, rank, lengths, bucket_window
        )
        self._epoch, self._yielded, self._resume = 0, 0, 0
        super().__init__(dataset, sampler=self._order, **kwargs)

    def __iter__(self):
        self._order.set_epoch(self._epoch)
        self._order.skip = self._resume
        self._yielded = self._resume
        self._resume = 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch
        self._epoch += 1
        self._yielded = 0

    def __len__(self) -> int:
        return super().__len__()

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "consumed": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        self._epoch, self._resume = int(state["epoch"]), int(state["consumed"])
