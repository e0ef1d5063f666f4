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
