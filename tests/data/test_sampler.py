"""Rank-aware sampler: R ranks x batch b see exactly one process's batches of R*b; bucketing; exact resume."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from draftkit.data.collate import collate
from draftkit.data.sampler import EpochSampler, ResumableLoader, bucket_by_length


def _batches(size, world, b, rank, epoch=0, lengths=None, window=0, skip=0):
    s = EpochSampler(size, seed=5, shuffle=True, batch_size=b, num_replicas=world, rank=rank, lengths=lengths,
                      bucket_window=window)
    s.set_epoch(epoch)
    s.skip = skip
    flat = list(iter(s))
    if skip == 0:
        assert len(flat) == len(s)  # __len__ (closed form) agrees with the iteration
    return [flat[i:i + b] for i in range(0, len(flat), b)]


@pytest.mark.parametrize("window", [0, 8])
def test_two_ranks_equal_one_process_with_twice_the_batch(window):
    lengths = torch.randint(1, 100, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    one = _batches(23, 1, 4, 0, lengths=lengths, window=window)
    r0 = _batches(23, 2, 2, 0, lengths=lengths, window=window)
    r1 = _batches(23, 2, 2, 1, lengths=lengths, window=window)
    assert len(one) == len(r0) == len(r1) == 6  # 23 = 5 x 4 + 3
    assert [a + b for a, b in zip(r0, r1)] == one  # step by step, the same sequences
    assert r0[-1] + r1[-1] == one[-1] and len(r1[-1]) == 1  # partial last batch split, not padded
    assert sorted(sum(one, [])) == list(range(23))


def test_rank_with_empty_share_of_the_last_batch_pads_one_sequence():
    one = _batches(21, 1, 4, 0)  # last global batch: 1 sequence
    r0, r1 = _batches(21, 2, 2, 0), _batches(21, 2, 2, 1)
    assert len(r0) == len(r1) == 6
    assert r0[-1] == one[-1] and r1[-1] == one[-1][:1]  # rank 1 repeats it so both ranks step 6 times
    assert [a + b for a, b in zip(r0[:-1], r1[:-1])] == one[:-1]


def test_bucketing_cuts_padding_and_keeps_every_sequence_once():
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 513, (256,), generator=gen).tolist()
    plain = _batches(256, 1, 8, 0, lengths=lengths)
    bucketed = _batches(256, 1, 8, 0, lengths=lengths, window=64)
    assert sorted(sum(bucketed, [])) == list(range(256))

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    real = sum(lengths)
    assert padded(bucketed) - real < 0.25 * (padded(plain) - real)
    # seeded: the same epoch gives the same batches, another epoch others
    assert bucketed == _batches(256, 1, 8, 0, lengths=lengths, window=64)
    assert bucketed != _batches(256, 1, 8, 0, epoch=1, lengths=lengths, window=64)


def test_bucket_by_length_keeps_a_partial_batch_last():
    batches = bucket_by_length(list(range(10)), list(range(10)), 4, 8, torch.Generator().manual_seed(0))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(batches[0] + batches[1]) == list(range(8)) and sorted(batches[2]) == [8, 9]
    assert all(b == sorted(b, reverse=True) for b in batches)  # longest first within a batch


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1), (3, 2)])
def test_skip_resumes_exactly(world, rank):
    lengths = list(range(1, 31))
    full = _batches(30, world, 2, rank, lengths=lengths, window=12)
    assert _batches(30, world, 2, rank, lengths=lengths, window=12, skip=3) == full[3:]


def test_loader_sampler_is_distributed_and_resumes():
    """Lightning injects its own sampler only when the loader's is not a DistributedSampler."""
    data = [{"input_ids": [i] * (1 + i % 5), "loss_mask": [1] * (1 + i % 5)} for i in range(13)]
    lengths = [len(r["input_ids"]) for r in data]
    kw = dict(seed=3, shuffle=True, num_replicas=2, rank=1, lengths=lengths, bucket_window=4, batch_size=2,
              collate_fn=collate)
    loader = ResumableLoader(data, **kw)
    assert isinstance(loader.sampler, DistributedSampler)
    full = [b["input_ids"][:, 0].tolist() for b in loader]
    assert len(full) == len(loader) == 4  # ceil(13 / (2 x 2))
    again = ResumableLoader(data, **kw)
    it = iter(again)
    head = [next(it)["input_ids"][:, 0].tolist() for _ in range(2)]
    resumed = ResumableLoader(data, **kw)
    resumed.load_state_dict(again.state_dict())
    assert head + [b["input_ids"][:, 0].tolist() for b in resumed] == full
