"""Temperature / top-k / top-p warping and sampling."""

import pytest
import torch

from draftkit.sampling import probs_from_logits, sample


def test_temperature_zero_is_greedy():
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, 0.0).tolist() == [1, 0]  # first index on ties
    assert probs_from_logits(logits, 0.0).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_top_k_and_top_p_values():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    torch.testing.assert_close(probs_from_logits(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # 0.5 < 0.7 keeps the second token; 0.8 >= 0.7 drops the third
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_p=0.4), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    shuffled = logits[[2, 0, 3, 1]]  # order in the vocab must not matter
    torch.testing.assert_close(probs_from_logits(shuffled, 1.0, top_p=0.7), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    hot = probs_from_logits(logits, 0.5)
    torch.testing.assert_close(hot, (logits / 0.5).softmax(-1))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample(torch.zeros(3), **{"temperature": 1.0, **kwargs})


def test_seeded_sampling_frequencies():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(20000, 4), 1.0, generator=g)
    again = sample(logits.expand(20000, 4), 1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
    freq = torch.bincount(draws, minlength=4) / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)


# -- the nucleus and top-k boundaries against a plain reference (issue 56) ---------------------------------------

from hypothesis import given, settings
from hypothesis import strategies as st


def _reference_probs(logits: list[float], top_k: int, top_p: float) -> list[float]:
    """Plain-Python top-k then top-p: keep every id whose logit is >= the k-th largest (ties kept), then walk the
    kept ids from most to least probable (lower id first on ties) keeping each while the mass before it is < top_p."""
    v = len(logits)
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(logits, reverse=True)[top_k - 1]
        keep = {i for i in keep if logits[i] >= kth}
    z = torch.tensor(logits, dtype=torch.float32)
    if top_p < 1:
        p = z.masked_fill(torch.tensor([i not in keep for i in range(v)]), float("-inf")).softmax(-1).tolist()
        mass, nucleus = 0.0, set()
        for i in sorted(keep, key=lambda i: (-p[i], i)):
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += p[i]
        keep = nucleus
    return z.masked_fill(torch.tensor([i not in keep for i in range(v)]), float("-inf")).softmax(-1).tolist()


def test_top_p_keeps_the_token_whose_preceding_mass_equals_top_p_exactly():
    """Mass before the third token is exactly 0.75 (powers of two): top_p = 0.75 drops it (the preceding mass
    reaches top_p), a hair above keeps it. A `>` for `>=` keeps it at 0.75."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_p=0.75), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_p=0.7500001),
                               torch.tensor([0.5, 0.25, 0.125, 0.0]) / 0.875)
    torch.testing.assert_close(probs_from_logits(logits, 1.0, top_p=0.5), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    p = probs_from_logits(logits, 1.0, top_k=2)
    assert (p > 0).tolist() == [True, False, True, True, False]
    assert probs_from_logits(logits, 1.0, top_k=5).tolist() == logits.softmax(-1).tolist()  # k = V: off


@settings(max_examples=60, deadline=None, derandomize=True)
@given(logits=st.lists(st.integers(-4, 4), min_size=2, max_size=7),
       top_k=st.integers(0, 7), top_p=st.sampled_from([0.1, 0.25, 0.5, 0.6, 0.75, 0.9, 1.0]))
def test_warping_equals_the_plain_reference(logits, top_k, top_p):
    """Small integer logits make ties and exact boundary masses common."""
    x = [float(v) for v in logits]
    got = probs_from_logits(torch.tensor(x), 1.0, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(got, torch.tensor(_reference_probs(x, top_k, top_p)), atol=1e-6, rtol=0)


def test_the_error_names_the_first_non_finite_logit_not_the_last():
    from draftkit.sampling import NonFiniteLogitsError, check_finite_logits

    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan"), 0.0, float("inf")]])
    with pytest.raises(NonFiniteLogitsError, match=r"2 of 6 values .* first at position \[1, 0\]") as err:
        check_finite_logits(logits, "target logits")
    assert err.value.position == (1, 0) and err.value.dtype == "float32"
