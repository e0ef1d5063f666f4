"""Draft vocabulary: the V_d most frequent assistant tokens and the d2t/t2d maps (eagle3-format.md §5).

Shapes: V target vocab, V_d draft vocab.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

__all__ = ["VocabMap", "count_tokens"]


def count_tokens(input_ids: list[list[int]], loss_masks: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Count target ids at loss-bearing positions only (m_t = 1).

    Args:
        input_ids: per-sequence token ids.
        loss_masks: per-sequence 0/1 masks of the same lengths (1 = assistant token).
        vocab_size: V.

    Returns:
        (V,) int64 counts.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids, loss_masks):
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids_t[torch.as_tensor(mask, dtype=torch.bool)], minlength=vocab_size)
    return counts


@dataclass
class VocabMap:
    """The draft-vocab map stored in every checkpoint and export.

    Attributes:
        d2t: (V_d,) int64, draft id i maps to target id i + d2t[i].
        t2d: (V,) bool, True for target ids in the draft vocab.
    """

    d2t: torch.Tensor
    t2d: torch.Tensor

    @classmethod
    def from_counts(cls, counts: torch.Tensor, draft_vocab_size: int) -> "VocabMap":
        """Top-V_d ids by (count desc, id asc), sorted ascending.

        When fewer than V_d ids have a non-zero count, the smallest unused ids pad the set (deterministic)
        and a warning says how many were padded (SpecForge PR #76).

        Args:
            counts: (V,) int64 counts from :func:`count_tokens`.
            draft_vocab_size: V_d.

        Raises:
            ValueError: if V_d is not in [1, V].
        """
        vocab_size = counts.numel()
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(
                f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab_size}] (the target vocab size); "
                "lower model.draft_vocab_size in the recipe"
            )
        ids = torch.arange(vocab_size)
        # stable sort on -count keeps ascending id order among ties
        order = torch.sort(-counts, stable=True).indices
        nonzero = int((counts > 0).sum())
        if nonzero < draft_vocab_size:
            warnings.warn(
                f"only {nonzero} distinct assistant tokens for draft_vocab_size={draft_vocab_size}: "
                f"padding with the {draft_vocab_size - nonzero} smallest unused ids",
                stacklevel=2,
            )
        used = torch.sort(ids[order[:draft_vocab_size]]).values
        return cls.from_ids(used, vocab_size)

    @classmethod
    def from_ids(cls, used: torch.Tensor, vocab_size: int) -> "VocabMap":
        """Map from an ascending list of target ids. ``[1, 3, 4, 8]`` gives d2t ``[1, 2, 2, 5]``."""
        used = torch.as_tensor(used, dtype=torch.long)
        if used.numel() > 1 and not bool((used[1:] > used[:-1]).all()):
            raise ValueError("draft vocab ids must be strictly ascending")
        if used.numel() and (used[0] < 0 or used[-1] >= vocab_size):
            raise ValueError(f"draft vocab ids must lie in [0, {vocab_size})")
        d2t = used - torch.arange(used.numel())
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[used] = True
        return cls(d2t=d2t, t2d=t2d)

    @property
    def target_ids(self) -> torch.Tensor:
        """(V_d,) int64 target id of each draft id."""
        return torch.arange(self.d2t.numel()) + self.d2t

    def validate(self) -> None:
        """Check the §5 invariants.

        Raises:
            ValueError: if ids are not strictly increasing, leave [0, V), or disagree with t2d.
        """
        ids = self.target_ids
        vocab_size = self.t2d.numel()
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("d2t: target ids i + d2t[i] are not strictly increasing")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"d2t maps outside the target vocab [0, {vocab_size})")
        if int(self.t2d.sum()) != ids.numel() or not bool(self.t2d[ids].all()):
            raise ValueError("t2d does not mark exactly the target ids of d2t")
