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

    Each ``iter()`` is one epoch, with its own seeded permutation (:class:`EpochSampler`): after a restore it
    starts where the state says; otherwise it takes the epoch Lightning set on the sampler
    (``set_epoch(trainer.current_epoch)``), or, when nobody set one since the last pass, the next epoch. The
    epoch never depends on the previous iterator being exhausted: Lightning stops calling ``next`` after
    ``len(loader)`` batches, and it restores no loader state from a checkpoint taken at the end of an epoch
    of a ``max_epochs`` run.

    Lightning does not pre-fetch from loaders with a known length, so the batches yielded so far are the
    batches trained so far. Its sampler is rank-aware; every rank consumes the same number of batches, so
    rank 0's saved position is every rank's position. The state also records the sequences consumed and the
    global batch (``batch_size * num_replicas``): a resume with the same global batch on another number of
    processes continues at the next unseen sequence; with another global batch it continues at an epoch
    boundary and refuses mid-epoch (:meth:`load_state_dict`).

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
        self._epoch, self._yielded, self._started = 0, 0, False
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip) for the next iter()
        super().__init__(dataset, sampler=self._order, **kwargs)

    @property
    def global_batch(self) -> int:
        """Sequences per step over all ranks: ``batch_size * num_replicas``."""
        return self._order.batch_size * self._order.num_replicas

    def __iter__(self):
        if self._resume is not None:
            (self._epoch, self._yielded), self._resume = self._resume, None
        elif self._started and self._order.epoch == self._epoch:  # nobody set an epoch since the last pass
            self._epoch, self._yielded = self._epoch + 1, 0
        else:  # the first pass, or the epoch Lightning set
            self._epoch, self._yielded = self._order.epoch, 0
        self._started = True
        self._order.set_epoch(self._epoch)
        self._order.skip = self._yielded
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def __len__(self) -> int:
        return super().__len__()

    def state_dict(self) -> dict:
        """``epoch``, ``consumed`` (batches of this epoch), ``sequences`` consumed, ``global_batch``,
        ``world_size`` and ``bucket_window``."""
        order = self._order
        return {
            "epoch": self._epoch, "consumed": self._yielded,
            "sequences": min(self._yielded * self.global_batch, order.size), "global_batch": self.global_batch,
            "world_size": order.num_replicas, "bucket_window": order.bucket_window,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after the saved position: at the next batch, or at epoch + 1 when the epoch was complete.

        A mid-epoch resume needs the same global batch (``devices x data.batch_size``; the split over
        processes may change): Lightning counts the epoch's remaining steps from the checkpoint's step count,
        so another global batch would end the epoch early or late. At an epoch boundary any setting continues.

        Raises:
            ValueError: on a mid-epoch resume with another global batch; names both settings.
        """
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        saved_g = int(state.get("global_batch", self.global_batch))
        sequences = int(state.get("sequences", min(consumed * saved_g, self._order.size)))
        if sequences >= self._order.size:
            self._resume = (epoch + 1, 0)
            return
        if saved_g != self.global_batch:
            world = int(state.get("world_size") or 1)
            raise ValueError(
                f"cannot resume mid-epoch (epoch {epoch}, after {sequences} sequences): the checkpoint was trained "
                f"with world size {world} x batch {saved_g // world} (global batch {saved_g}), this run has world "
                f"size {self._order.num_replicas} x batch {self._order.batch_size} (global batch "
                f"{self.global_batch}); keep devices x data.batch_size = {saved_g} to resume here, or resume from a "
                "checkpoint at an epoch boundary"
            )
        self._resume = (epoch, consumed)
