"""draftkit.selection.vocab.VocabMap.validate on hand-made maps: each check at its own boundary (issue 36)."""

import pytest
import torch

from draftkit.selection.vocab import VocabMap


def test_validate_refuses_a_negative_first_id_when_the_last_is_in_range():
    """ids [-1, 2] (d2t [-1, 1]) in a vocab of 4: the smallest id is out of [0, V) though the largest is not."""
    vm = VocabMap(d2t=torch.tensor([-1, 1]), t2d=torch.tensor([True, False, True, False]))
    with pytest.raises(ValueError, match=r"outside the target vocab \[0, 4\)"):
        vm.validate()


def test_validate_refuses_t2d_marking_the_right_count_of_wrong_ids():
    """d2t [0, 0] is ids {0, 1}; t2d marks {0, 2}: the count agrees, one of the ids is unmarked."""
    vm = VocabMap(d2t=torch.tensor([0, 0]), t2d=torch.tensor([True, False, True, False]))
    with pytest.raises(ValueError, match="t2d does not mark exactly"):
        vm.validate()
    VocabMap.from_ids(torch.tensor([0, 1]), 4).validate()  # the right map passes
    assert VocabMap.from_ids(torch.tensor([1, 3, 4, 8]), 9).d2t.tolist() == [1, 2, 2, 5]
