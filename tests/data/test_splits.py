"""Honest splits (issue 33 item 1): the normalising rule, the drop rule and the grouped split."""

import pytest

from draftkit.data.splits import PromptFilter, first_prompt, grouped_split, normalize_prompt


@pytest.mark.parametrize("raw, key", [
    ("  Please  CONTINUE!! ", "please continue"),
    ("What is 2+2?", "what is 2+2"),
    ("\u00bfQu\u00e9 es   esto?\n", "qu\u00e9 es esto"),
    ("ＦＵＬＬ width", "full width"),  # NFKC
    ("...", ""),
])
def test_normalize_prompt(raw, key):
    assert normalize_prompt(raw) == key


def test_first_prompt_skips_the_system_turn():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert first_prompt(msgs) == "hi there"
    assert first_prompt([{"role": "assistant", "content": "x"}]) == ""


def test_drop_rule_on_a_small_fixture():
    prompts = [
        "Explain quantum computing in simple terms",   # 0 kept
        "explain quantum computing in simple terms.",  # 1 duplicate of 0 after normalising
        "continue",                                    # 2 filler only
        "Please continue from the last code snippet",  # 3 continuation opening
        "hi",                                          # 4 shorter than 8 characters
        "   ",                                         # 5 empty
        "What is 2+2?",                                # 6 kept (11 characters)
        "ok, thanks!",                                 # 7 filler only
        "Write a haiku about rain",                    # 8 kept
        "EXPLAIN QUANTUM COMPUTING IN SIMPLE TERMS",   # 9 duplicate of 0
    ]
    kept, keys, dropped = PromptFilter().keep(prompts)
    assert kept == [0, 6, 8]
    assert dropped == {"duplicate prompt": [1, 9], "context-free prompt": [2, 3, 4, 7], "empty prompt": [5]}
    assert keys[1] == keys[0] == keys[9]
    # each part of the rule can be switched off
    kept, _, dropped = PromptFilter(dedup=False).keep(prompts)
    assert kept == [0, 1, 6, 8, 9]
    kept, _, _ = PromptFilter(min_prompt_chars=0, drop_fillers=False, dedup=False).keep(prompts)
    assert kept == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    # the length bound is strict: a 7-character prompt goes at 8, stays at 7
    assert PromptFilter(min_prompt_chars=8).keep(["abcdefg"])[0] == []
    assert PromptFilter(min_prompt_chars=7).keep(["abcdefg"])[0] == [0]


def test_grouped_split_puts_no_prompt_on_both_sides():
    # 30 rows over 10 prompts with 1..5 copies each: a row split would leak; the grouped one cannot
    keys = [f"prompt {i % 10}" for i in range(30)] + [f"single {i}" for i in range(10)]
    rows = list(range(len(keys)))
    for seed in range(5):
        train, val = grouped_split(keys, rows, val_size=7, seed=seed)
        assert sorted(train + val) == rows
        assert not {keys[r] for r in train} & {keys[r] for r in val}
        assert len(val) >= 7 and len(val) <= 7 + 2  # the last group taken may overshoot by its size - 1
    assert grouped_split(keys, rows, 7, 0) == grouped_split(keys, rows, 7, 0)  # seeded
    assert grouped_split(keys, rows, 7, 0) != grouped_split(keys, rows, 7, 1)
    assert grouped_split(keys, rows, 0, 0) == (rows, [])


def test_grouped_split_with_distinct_prompts_takes_exactly_val_size():
    keys = [f"p{i}" for i in range(20)]
    train, val = grouped_split(keys, list(range(0, 20, 2)), val_size=3, seed=0)
    assert len(val) == 3 and len(train) == 7
    assert all(r % 2 == 0 for r in train + val)


def test_grouped_split_refuses_a_negative_size():
    with pytest.raises(ValueError, match="data.val_size"):
        grouped_split(["a"], [0], -1, 0)
