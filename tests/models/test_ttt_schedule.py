"""models/ttt.py's row helpers and models/schedule.py's functions on small exact cases."""

import math

import pytest
import torch

from draftkit.models import schedule
from draftkit.models.ttt import later_rows, shift, teacher_distribution


def test_later_rows_nests_the_rows_of_later_steps():
    supervised = [torch.tensor([0, 2]), torch.tensor([1, 4]), torch.tensor([4, 5])]
    active = later_rows(supervised, 6)
    assert active[0] is None
    assert active[1].tolist() == [1, 4, 5] and active[2].tolist() == [4, 5]


def test_teacher_distribution_on_two_positions():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 1.0]])  # z at flat positions 0 and 3
    t2d = torch.tensor([True, False, True, True])
    in_draft, probs, argmax, slot = teacher_distribution(logits, torch.tensor([0, 3]), t2d, (2, 2))
    assert in_draft.tolist() == [[False, False], [False, True]]  # argmax 1 is not a draft id; argmax 0 is
    assert torch.allclose(probs, torch.softmax(logits[:, [0, 2, 3]], -1)) and probs.dtype == torch.float32
    assert argmax.tolist() == [2, 0] and slot.tolist() == [0, -1, -1, 1]
    assert shift(torch.tensor([[1, 2, 3]]), 2).tolist() == [[3, 0, 0]]


def test_schedule_warmup_cosine_floor_and_replan():
    f = [schedule.lr_factor(s, 100, 10, 0.1) for s in (0, 9, 10, 55, 100, 120)]
    assert f[:3] == [0.1, 1.0, 1.0] and f[4] == f[5] == pytest.approx(0.1, abs=1e-15)
    assert f[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule.lr_factor(50, None, 10, 0.1) == 1.0  # no horizon yet: the peak is held
    # warmup takes at most half the horizon: W = 2, then halfway down at step 3
    assert schedule.lr_factor(1, 4, 10, 0.1) == 1.0 and schedule.lr_factor(3, 4, 10, 0.1) == pytest.approx(0.55)
    anchor = schedule.replan_anchor(60, 30, 100, 10, None)
    assert anchor[:2] == (10, 30)
    assert schedule.lr_factor(30, 60, 10, 0.1, anchor) == schedule.lr_factor(30, 100, 10, 0.1)  # LR(a) kept
    assert schedule.lr_factor(60, 60, 10, 0.1, anchor) == pytest.approx(0.1, abs=1e-15)
    assert schedule.replan_anchor(100, 30, 100, 10, None) is None  # the same H
    assert schedule.replan_anchor(7, 0, None, 10, None) is None  # the first plan
    with pytest.raises(ValueError, match="horizon >= 1"):
        schedule.replan_anchor(0, 3, None, 10, None)
