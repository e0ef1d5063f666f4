"""d2t/t2d maps and aux-layer id validation."""

import pytest
import torch

from draftkit.selection.layers import default_aux_layer_ids, validate_aux_layer_ids
from draftkit.selection.vocab import VocabMap, count_tokens


def test_d2t_t2d_worked_example():
    vm = VocabMap.from_ids(torch.tensor([1, 3, 4, 8]), 10)
    assert vm.d2t.tolist() == [1, 2, 2, 5]
    assert vm.d2t.dtype == torch.int64
    assert vm.t2d.tolist() == [False, True, False, True, True, False, False, False, True, False]
    vm.validate()
    one_hot = torch.zeros(4)
    one_hot[3] = 1
    assert int(vm.target_ids[one_hot.argmax()]) == 8


def test_from_counts_ranks_by_count_then_id_and_sorts():
    counts = torch.tensor([0, 5, 7, 5, 0, 9, 1])
    vm = VocabMap.from_counts(counts, 3)
    assert vm.target_ids.tolist() == [1, 2, 5]  # 9@5, 7@2, then the tie 5@1 / 5@3 goes to the lower id


def test_from_counts_pads_deterministically_with_warning():
    counts = torch.tensor([0, 0, 4, 0, 1, 0])
    with pytest.warns(UserWarning, match="only 2 distinct assistant tokens"):
        vm = VocabMap.from_counts(counts, 4)
    assert vm.target_ids.tolist() == [0, 1, 2, 4]


def test_full_vocab_is_identity_not_arange():
    vm = VocabMap.from_counts(torch.ones(6, dtype=torch.long), 6)
    assert vm.d2t.tolist() == [0] * 6


def test_vocab_too_large():
    with pytest.raises(ValueError, match="draft_vocab_size=11 must be in"):
        VocabMap.from_counts(torch.ones(10, dtype=torch.long), 11)


def test_count_tokens_only_masked():
    counts = count_tokens([[1, 2, 2, 3]], [[0, 1, 1, 0]], 5)
    assert counts.tolist() == [0, 0, 2, 0, 0]


def test_layer_ids():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert validate_aux_layer_ids(None, 8) == [2, 4, 5]
    assert validate_aux_layer_ids([5, 2, 4], 8) == [2, 4, 5]
    with pytest.raises(ValueError, match="repeats a layer"):
        validate_aux_layer_ids([2, 2, 4], 8)
    with pytest.raises(ValueError, match=r"ids \[0, 8\] are out of range; valid HF hidden_states indices are 1..7"):
        validate_aux_layer_ids([0, 3, 8], 8)


# VocabMap.validate on hand-made maps: each check at its own boundary (issue 36).


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


# -- boundaries pinned at the value itself (issue 56) --------------------------------------------------------------

from hypothesis import given, settings
from hypothesis import strategies as st


def test_layer_ids_accept_1_and_n_minus_1_and_refuse_0_and_n_alone():
    assert validate_aux_layer_ids([1, 7], 8) == [1, 7]
    for bad in ([0], [8]):
        with pytest.raises(ValueError, match=rf"ids \[{bad[0]}\] are out of range"):
            validate_aux_layer_ids(bad, 8)
    with pytest.raises(ValueError, match="is empty"):
        validate_aux_layer_ids([], 8)


def test_an_id_equal_to_the_vocab_size_is_refused_and_one_below_is_kept():
    vm = VocabMap.from_ids(torch.tensor([0, 9]), 10)
    assert vm.target_ids.tolist() == [0, 9] and bool(vm.t2d[9])
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
        VocabMap.from_ids(torch.tensor([0, 10]), 11 - 1)
    with pytest.raises(ValueError, match=r"maps outside the target vocab \[0, 10\)"):
        VocabMap(d2t=torch.tensor([0, 9]), t2d=torch.ones(10, dtype=torch.bool)).validate()  # 1 + 9 = 10
    assert VocabMap.from_counts(torch.ones(10, dtype=torch.long), 10).target_ids.tolist() == list(range(10))
    assert VocabMap.from_counts(torch.ones(10, dtype=torch.long), 1).target_ids.tolist() == [0]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 3), min_size=1, max_size=12), data=st.data())
def test_from_counts_equals_a_sorted_reference(counts, data):
    """Top V_d by (count desc, id asc), zero counts included as padding in id order; d2t = id - index."""
    import warnings

    v_d = data.draw(st.integers(1, len(counts)))
    want = sorted(sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:v_d])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vm = VocabMap.from_counts(torch.tensor(counts), v_d)
    assert vm.target_ids.tolist() == want
    assert vm.d2t.tolist() == [t - i for i, t in enumerate(want)]
    assert vm.t2d.nonzero()[:, 0].tolist() == want
    vm.validate()
