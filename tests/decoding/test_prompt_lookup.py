"""Prompt lookup's match rule (issue 56): the longest suffix first, the latest earlier match followed by k tokens,
else the earliest one, never the suffix matching itself; against a plain brute-force reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftkit.decoding.drafters import PromptLookupDrafter
from draftkit.sampling import DecodeConfig

CFG = DecodeConfig(max_new_tokens=8)


def propose(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    return PromptLookupDrafter(max_ngram, min_ngram).propose(torch.tensor(tokens), k, CFG, None).ids.tolist()


def reference(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Plain Python: for n from the longest, every start s < L - n with tokens[s:s+n] == the last n tokens
    (so at least one token follows it); the latest such s with s + n + k <= L, else the earliest."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        hits = [s for s in range(L - n) if tokens[s:s + n] == suffix]
        if hits:
            full = [s for s in hits if s + n + k <= L]
            s = full[-1] if full else hits[0]
            return tokens[s + n:s + n + k]
    return []


def test_latest_match_with_k_tokens_after_it_wins():
    # suffix (1, 2) occurs at 0 and 4 (and at 8, itself); both earlier ones have 2 tokens after them: the later one
    assert propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 2) == [5, 6]


def test_a_latest_match_too_close_to_the_end_falls_back_to_the_earliest():
    # (1, 2) at 0 (then 3 4 5 ...) and at 5 (then 1 2, only 2 tokens before the suffix itself): k = 3 needs 0
    assert propose([1, 2, 3, 4, 5, 1, 2, 1, 2], 3, max_ngram=2) == [3, 4, 5]
    # ... and with k = 2 the later match has exactly k tokens after it (the boundary s + n + k == L): it wins
    assert propose([1, 2, 3, 4, 5, 1, 2, 1, 2], 2, max_ngram=2) == [1, 2]


def test_the_longest_ngram_is_tried_first():
    # the 1-gram (9,) last occurred before 7; the 2-gram (8, 9) occurred only before 3
    assert propose([8, 9, 3, 4, 5, 9, 7, 8, 9], 2, max_ngram=2, min_ngram=1) == [3, 4]


def test_the_suffix_never_matches_itself_and_min_ngram_is_a_floor():
    assert propose([1, 2, 3, 4], 2, min_ngram=1) == []  # no earlier 4
    assert propose([5, 1, 2, 3, 5], 2, min_ngram=2) == []  # 1-gram (5,) recurs but min_ngram = 2
    assert propose([5, 1, 2, 3, 5], 2, min_ngram=1) == [1, 2]
    assert propose([7, 7], 3, min_ngram=1) == [7]  # the only earlier match: one token after it, fewer than k


@pytest.mark.parametrize("bad", [(2, 3), (0, 0), (3, 0)])
def test_bad_ngram_bounds(bad):
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=bad[0], min_ngram=bad[1])


@settings(max_examples=80, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), k=st.integers(1, 4),
       ngrams=st.sampled_from([(1, 1), (2, 1), (3, 2), (4, 1)]))
def test_prompt_lookup_equals_the_brute_force_reference(tokens, k, ngrams):
    """A 3-token alphabet makes several candidate matches per sequence the common case."""
    assert propose(tokens, k, *ngrams) == reference(tokens, k, *ngrams)


def test_describe_names_the_suffix_lengths_tried():
    from draftkit.decoding.drafters import PromptLookupDrafter

    assert PromptLookupDrafter().describe() == "suffix of 3, then 2 tokens"
    assert PromptLookupDrafter(max_ngram=4, min_ngram=1).describe() == "suffix of 4, then 3, then 2, then 1 tokens"
