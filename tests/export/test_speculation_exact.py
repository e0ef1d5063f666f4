"""draftkit.export.speculation: the default k and a frozen shape (issue 36)."""

import dataclasses

import pytest

from draftkit.export.speculation import Speculation, resolve_speculation


def test_resolve_without_a_shape_defaults_to_3_or_the_given_k():
    assert resolve_speculation(None) == (3, None)
    assert resolve_speculation(num_speculative_tokens=5) == (5, None)


def test_speculation_is_frozen():
    shape = Speculation.parse("2,3,4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.tree = None
