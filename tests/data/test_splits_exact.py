"""draftkit.data.splits.PromptFilter at the default length bound (issue 36)."""

from draftkit.data.splits import PromptFilter


def test_default_min_prompt_chars_is_8_inclusive():
    f = PromptFilter()
    assert f.min_prompt_chars == 8
    assert f.why_dropped("abcdefgh", set()) is None  # exactly 8 characters: kept
    assert f.why_dropped("abcdefg", set()) == "context-free prompt"
