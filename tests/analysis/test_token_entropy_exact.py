"""draftkit.analysis.token_entropy: the quantile's closed lower bound (issue 36)."""

import pytest

from draftkit.analysis.token_entropy import _check_filter_args


def test_quantile_zero_is_allowed_and_one_is_not():
    _check_filter_args("drop", None, 0.0)  # [0, 1): 0 keeps every position
    with pytest.raises(ValueError, match=r"quantile must be in \[0, 1\)"):
        _check_filter_args("drop", None, 1.0)
    with pytest.raises(ValueError, match=r"quantile must be in \[0, 1\)"):
        _check_filter_args("drop", None, -0.1)
