"""Honest splits (issue 33 item 1): the normalising rule, the drop rule and the grouped split."""

import pytest

from draftkit.data.splits import PromptFilter, first_prompt, grouped_split, normalize_prompt


@pytest.mark.parametrize("raw, key", [
    ("  Please  CONTINUE!! ", "please continue"),
    ("What is 2+2?", "what is 2+2"),
    ("\u00bfQu\u00e9 es   esto?\n", "qu\u00e9 es esto"),
    ("ＦＵＬＬ width", "full width"),  # NFKC
    ("...", ""),
    ("\u00a1 Hola amigo!", "hola amigo"),  # punctuation, then a space: both stripped
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
    assert dropped == {"duplicate conversation": [1, 9], "context-free prompt": [2, 3, 4, 7], "empty prompt": [5]}
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


def _chat_file(path, prompts, answers=None):
    import json

    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            answer = answers[i] if answers else f"answer number {i}"
            msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"id": f"r{i}", "messages": msgs}) + "\n")
    return path


def test_datamodule_split_is_disjoint_by_prompt_and_names_what_it_drops(tmp_path, tiny_target_dir, monkeypatch):
    """The wired rule: 40 distinct prompts, each also present as a near-copy with the same answer, plus 6
    context-free records.

    Train and validation share no normalised prompt, the copies and fragments are dropped and named, and
    turning the rule off keeps them (so the test fails if the datamodule ignores the options)."""
    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    from draftkit.data.datamodule import ChatDataModule
    from draftkit.data.splits import normalize_prompt

    distinct = [f"Write a short story about topic {i}" for i in range(40)]
    prompts = distinct + [p.upper() + "!" for p in distinct] + ["continue", "Please continue", "go on",
                                                               "more", "ok", "Continue writing please"]
    path = _chat_file(tmp_path / "chat.jsonl", prompts, [f"answer number {i % 40}" for i in range(len(prompts))])
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=3,
                        max_skip_fraction=0.6)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (32, 8)

    train_records, val_records = set(dm.train_set["record"]), set(dm.val_set["record"])
    assert not train_records & val_records
    by_record = dict(zip((f"r{i}" for i in range(len(prompts))), (normalize_prompt(p) for p in prompts)))
    assert not {by_record[r] for r in train_records} & {by_record[r] for r in val_records}
    assert {by_record[r] for r in train_records | val_records} == {normalize_prompt(p) for p in distinct}
    reasons = {r["record"]: r["reason"] for r in dm.stats["prompt_rule"]}
    assert reasons == {**{f"r{i}": "duplicate conversation" for i in range(40, 80)},
                       **{f"r{i}": "context-free prompt" for i in range(80, 86)}}

    off = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=3,
                         dedup_prompts=False, min_prompt_chars=0)
    off.setup()
    assert len(off.train_set) + len(off.val_set) == 86
    # without dedup the copies stay, but still on one side: the split is grouped
    off_train = {by_record[r] for r in off.train_set["record"]}
    assert not off_train & {by_record[r] for r in off.val_set["record"]}
    assert off.fingerprint() != dm.fingerprint()


# PromptFilter at the default length bound (issue 36).


def test_default_min_prompt_chars_is_8_inclusive():
    f = PromptFilter()
    assert f.min_prompt_chars == 8
    assert f.why_dropped("abcdefgh", set()) is None  # exactly 8 characters: kept
    assert f.why_dropped("abcdefg", set()) == "context-free prompt"


def test_sampled_answers_all_train_and_prompt_rule_drops_count_toward_the_skip_threshold(tmp_path, tiny_target_dir,
                                                                                        monkeypatch):
    """Issue 55, case y25: 6 prompts x 4 sampled answers lost 18 of 24 records as "duplicate prompts"; and
    context-free drops (7 of 32, 22 %) trained on past data.max_skip_fraction 0.2 without a stop."""
    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    from draftkit.data.datamodule import ChatDataModule

    prompts = [f"Tell me fact number {i // 4} about draft heads" for i in range(24)]
    path = _chat_file(tmp_path / "dup4.jsonl", prompts, [f"sample {i % 4} of answer {i // 4}" for i in range(24)])
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=4, seed=0)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (20, 4)  # every answer trains; one prompt's four validate
    assert dm.stats["prompt_rule"] == []
    assert len({p for p, r in zip(prompts, (f"r{i}" for i in range(24))) if r in set(dm.val_set["record"])}) == 1

    fragments = prompts[:25] + ["continue", "Please continue", "go on", "more", "ok", "next", "continue please"]
    path = _chat_file(tmp_path / "cf.jsonl", fragments[1:], None)
    with pytest.raises(ValueError, match=(
            r"7 of 30 records skipped \(23%\), more than data.max_skip_fraction=0.2; main reason: context-free prompt "
            r"\(7 records; r23: first prompt 'continue'\); set data.min_prompt_chars 0 to keep prompts that need an "
            r"earlier answer the record does not hold, or raise data.max_skip_fraction to train on the rest")):
        ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=4).setup()


def test_a_split_that_one_prompt_fills_warns_and_one_that_leaves_nothing_to_train_is_refused(tmp_path, tiny_target_dir,
                                                                                              monkeypatch, caplog):
    """40 answers to one first prompt: the group cannot be split, so validation took all 40 and 0 trained (exit 0
    before); 30 distinct prompts plus 20 answers to one: validation may take 20 for val_size 8, with a warning."""
    import logging

    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    from draftkit.data.datamodule import ChatDataModule

    same = _chat_file(tmp_path / "same.jsonl", ["Same prompt please answer"] * 40, [f"answer {i}" for i in range(40)])
    with pytest.raises(ValueError, match=r"same.jsonl: the split by first prompt leaves no sequence to train on "
                       r"\(validation took 40 sequences for data.val_size=4: .* 40 share the prompt "
                       r"'same prompt please answer'\); add conversations with other first prompts, or set "
                       r"data.val_size 0"):
        ChatDataModule(str(same), tokenizer=str(tiny_target_dir), max_length=128, val_size=4).setup()
    dm = ChatDataModule(str(same), tokenizer=str(tiny_target_dir), max_length=128, val_size=0)
    dm.setup()
    assert len(dm.train_set) == 40
    prompts = [f"Distinct question number {i} about heads" for i in range(30)] + ["One shared question here"] * 20
    half = _chat_file(tmp_path / "half.jsonl", prompts, [f"answer {i}" for i in range(50)])
    for seed in range(8):  # a seed whose shuffle takes the shared prompt's group into validation
        dm = ChatDataModule(str(half), tokenizer=str(tiny_target_dir), max_length=128, val_size=8, seed=seed)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            dm.setup()
        if len(dm.val_set) > 16:
            break
    assert len(dm.val_set) > 16 and len(dm.train_set) + len(dm.val_set) == 50
    assert (f"validation took {len(dm.val_set)} sequences for data.val_size=8" in caplog.text
            and "20 share the prompt 'one shared question here'" in caplog.text)


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None, derandomize=True)
@given(groups=st.lists(st.integers(0, 4), min_size=1, max_size=16), val_size=st.integers(0, 10),
       seed=st.integers(0, 3))
def test_grouped_split_equals_a_plain_reference(groups, val_size, seed):
    """Reference: shuffle the distinct keys (first-appearance order) with random.Random(seed), then take whole
    groups while validation holds fewer than val_size rows; train is the rest. Every row lands once, no key on
    both sides, and validation stops at the first group that reaches val_size."""
    import random

    keys = [f"k{g}" for g in groups]
    rows = list(range(len(keys)))
    order = list(dict.fromkeys(keys))
    random.Random(seed).shuffle(order)
    val = []
    for k in order:
        if len(val) >= val_size:
            break
        val += [r for r in rows if keys[r] == k]
    want_val = sorted(val)
    want_train = sorted(r for r in rows if r not in set(val))
    assert grouped_split(keys, rows, val_size, seed) == (want_train, want_val)


def test_prompt_filter_length_bound_is_inclusive_at_min_prompt_chars():
    assert PromptFilter(min_prompt_chars=8).keep(["abcdefgh", "abcdefg"])[0] == [0]
    assert PromptFilter(min_prompt_chars=0).keep(["a"])[0] == [0]


@pytest.mark.parametrize("kw, message", [
    ({"val_size": -3}, r"^data.val_size must be >= 0 sequences held out \(0 = no validation\), got -3$"),
    ({"max_samples": 0}, r"^data.max_samples must be >= 1 training sequences \(or null: all\), got 0$"),
])
def test_a_negative_val_size_or_empty_max_samples_names_its_own_option(kw, message, tiny_target_dir):
    from draftkit.data.datamodule import ChatDataModule

    with pytest.raises(ValueError, match=message):
        ChatDataModule("unused.jsonl", tokenizer=str(tiny_target_dir), **kw)
