"""Dual-precision statistics on hand-built data: AUROC, catch rate, McNemar, bootstrap, replay metrics (§6, §10)."""

from __future__ import annotations

import math

import pytest
import torch

from draftkit.dual_precision import ReplaySteps, bootstrap_ci, catch_rate, mcnemar_exact, replay_metrics, roc_auc


def test_auc_hand_built_and_against_pairwise_reference():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert roc_auc(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 1, 1])) == 0.5  # ties count half
    assert math.isnan(roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([1, 1])))
    gen = torch.Generator().manual_seed(0)
    s = torch.randint(0, 20, (500,), generator=gen).double()  # many ties
    y = torch.rand(500, generator=gen) < 0.2 + 0.03 * s
    diff = s[y][:, None] - s[~y][None, :]  # (n+, n-) every pair: the plain reference
    brute = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert roc_auc(s, y) == pytest.approx(brute, abs=1e-6)  # torchmetrics' curve is float32
    assert roc_auc(-30 + 60 * s / 19, y) == pytest.approx(brute, abs=1e-6)  # scores outside [0, 1] keep their order


def test_catch_rate_hand_built_and_random_baseline():
    scores = torch.arange(10, dtype=torch.float64)  # top-2 of 10 escalate at B = 0.2
    labels = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    assert catch_rate(scores, labels, 0.2) == pytest.approx(2 / 3)
    assert catch_rate(scores, labels, 0.3) == 1.0
    gen = torch.Generator().manual_seed(0)
    rates = [catch_rate(torch.rand(2000, generator=gen), torch.rand(2000, generator=gen) < 0.1, 0.15)
             for _ in range(200)]
    assert sum(rates) / len(rates) == pytest.approx(0.15, abs=0.01)


@pytest.mark.parametrize("b, c, p", [(5, 3, 0.727), (20, 7, 0.019), (2, 0, 0.5)])
def test_mcnemar_worked_values(b, c, p):
    assert round(mcnemar_exact(b, c), 3) == p


def test_mcnemar_and_bootstrap_edges():
    assert mcnemar_exact(0, 0) == 1.0
    assert bootstrap_ci(5, lambda idx: 3.0, 50) == [3.0, 3.0]
    assert bootstrap_ci(5, lambda idx: float("nan"), 50) is None
    lo, hi = bootstrap_ci(40, lambda idx: float(idx.double().mean()), 400, seed=1)
    assert lo < 19.5 < hi and hi - lo < 20


def test_replay_metrics_on_hand_built_steps():
    steps = [
        ReplaySteps(torch.tensor([False, True, False, True]),
                    {"entropy": torch.tensor([0.1, 0.9, 0.2, 0.8]), "margin": torch.tensor([-0.9, -0.1, -0.5, -0.6])}),
        ReplaySteps(torch.tensor([False, False, True, False]),
                    {"entropy": torch.tensor([0.3, 0.2, 0.7, 0.1]), "margin": torch.tensor([-0.8, -0.7, -0.2, -0.3])}),
    ]
    out = replay_metrics(steps, budgets=(0.25, 0.5), bootstrap_samples=20)
    assert out["num_steps"] == 8 and out["num_flips"] == 3 and out["flip_rate"] == 3 / 8
    assert out["auc_entropy"] == 1.0 and out["auc_margin"] == pytest.approx(13 / 15)
    assert out["catch_at_budget"]["entropy"] == {"0.25": 2 / 3, "0.50": 1.0}
    assert out["catch_at_budget"]["random"]["0.25"] == 0.25
    # lagged gate: score at t-1 against the flip at t, within each prompt (6 pairs)
    assert set(out["catch_at_budget_lagged"]) == {"entropy", "margin"}
    # pairs: margin [-.9, -.1, -.5 | -.8, -.7, -.2] against flips [T, F, T | F, T, F]; at B = 0.5 the top 3
    # (-.1, -.2, -.5) catch one of the 3 flips; at 0.25 the top 2 catch none; entropy's lagged scores catch none
    # (its unlagged catch would be 2/3 and 1)
    assert out["catch_at_budget_lagged"]["margin"] == {"0.25": 0.0, "0.50": pytest.approx(1 / 3)}
    assert out["catch_at_budget_lagged"]["entropy"] == {"0.25": 0.0, "0.50": 0.0}


def _binom_two_sided(b: int, c: int) -> float:
    """Plain reference: twice the smaller tail of Binomial(b + c, 1/2), capped at 1."""
    n = b + c
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


@pytest.mark.parametrize("b, c", [(0, 1), (1, 0), (3, 3), (0, 6), (6, 0), (4, 9), (9, 4), (1, 10)])
def test_mcnemar_is_two_sided_and_symmetric(b, c):
    assert mcnemar_exact(b, c) == pytest.approx(_binom_two_sided(b, c))
    assert mcnemar_exact(b, c) == mcnemar_exact(c, b)
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)  # a one-sided test would give 1/64


def test_bootstrap_interval_is_the_central_percentiles_of_group_resamples():
    """The same draws as the function (a seeded generator, one randint per resample): [q(0.025), q(0.975)]."""
    stat = lambda idx: float(idx.double().mean())  # noqa: E731
    got = bootstrap_ci(7, stat, 200, seed=3, level=0.9)
    gen = torch.Generator().manual_seed(3)
    v = torch.tensor([stat(torch.randint(0, 7, (7,), generator=gen)) for _ in range(200)], dtype=torch.float64)
    assert got == [pytest.approx(float(v.quantile(0.05))), pytest.approx(float(v.quantile(0.95)))]
    assert bootstrap_ci(0, stat, 10) is None and bootstrap_ci(3, stat, 0) is None


def test_threshold_for_budget_lets_exactly_m_steps_escalate():
    from draftkit.dual_precision.stats import threshold_for_budget

    s = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.3])
    assert threshold_for_budget(s, 0.4) == pytest.approx(0.6)  # m = 2: between 0.7 and 0.5
    assert threshold_for_budget(s, 0.01) == pytest.approx(0.8)  # m clipped up to 1
    assert threshold_for_budget(s, 0.99) == pytest.approx(0.2)  # m clipped down to N - 1
    with pytest.raises(ValueError, match="budget"):
        threshold_for_budget(s, 1.0)
