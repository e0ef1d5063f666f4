"""Acceptance metrics on the worked example of eagle3-format.md §8.2, and KL over the draft vocab."""

import math

import pytest
import torch

from draftkit.decoding.metrics import (
    AcceptanceStats,
    acceptance_length,
    acceptance_per_position,
    acceptance_rate,
    accepted_prefix,
    chain_acceptance,
    conditional_acceptance,
    distribution_metrics,
    kl_from_logits,
    kl_target_draft,
)

MATCHES = [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_worked_example_k4():
    accepted = [accepted_prefix(m) for m in MATCHES]
    assert accepted == [1, 4, 0]
    assert acceptance_length(accepted) == pytest.approx(8 / 3)
    assert round(acceptance_length(accepted), 3) == 2.667
    assert acceptance_rate(accepted, 4) == pytest.approx(5 / 12)  # prefixes only, not 6/12
    alpha = acceptance_per_position(accepted, 4)
    assert alpha == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert conditional_acceptance(alpha)[1] == pytest.approx(1 / 2)
    assert 1 + sum(alpha) == pytest.approx(acceptance_length(accepted))  # chain identity


def test_stats_accumulator_matches_functions():
    stats = AcceptanceStats(4)
    for m in MATCHES:
        stats.update(accepted_prefix(m), 4)
    assert stats.tau() == pytest.approx(8 / 3)
    assert stats.rate() == pytest.approx(5 / 12)
    assert stats.per_position() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert stats.kl_per_position() is None
    other = AcceptanceStats(4)
    other.update(0, 0)  # a round that drafted nothing (prompt lookup without a match)
    stats.extend(other)
    assert stats.tau() == pytest.approx(9 / 4)
    assert stats.tau_drafted() == pytest.approx(8 / 3)
    assert stats.rate() == pytest.approx(5 / 12)
    with pytest.raises(ValueError, match="accepted <= drafted"):
        stats.update(3, 2)


def test_kl_over_draft_vocab():
    t2d = torch.tensor([True, False, True, True, False])
    target = torch.tensor([[2.0, 9.0, 0.0, 1.0, -3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    kl = kl_target_draft(target, draft, t2d)
    p = torch.tensor([2.0, 0.0, 1.0]).softmax(-1)  # target restricted to ids 0, 2, 3
    expected = float((p * (p.log() - math.log(1 / 3))).sum())
    assert kl[0].item() == pytest.approx(expected, rel=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)  # equal distributions up to a logit shift
    dist = distribution_metrics(target, draft, t2d)
    assert torch.equal(dist["kl"], kl)
    stats = AcceptanceStats(3)
    stats.update(1, 2, dist)
    stats.update(0, 1, {name: x[:1] for name, x in dist.items()})
    assert stats.kl_per_position() == pytest.approx([expected, 0.0, None])


def test_outside_mass_and_expected_acceptance_exact():
    """p = (0.4, 0.3, 0.2, 0.1) over V = 4, draft vocab {0, 2}, q = (0.5, 0.5) on it."""
    t2d = torch.tensor([True, False, True, False])
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    q = torch.tensor([[0.5, 0.5]])
    dist = distribution_metrics(p.log(), q.log(), t2d)
    assert dist["outside_mass"].item() == pytest.approx(0.4, abs=1e-6)
    assert dist["expected_accept"].item() == pytest.approx(0.6, abs=1e-6)  # min(.4, .5) + min(.2, .5)
    q_full = torch.tensor([[0.5, 0.0, 0.5, 0.0]])  # q in the target vocab, zero outside the draft vocab
    assert dist["expected_accept"].item() == pytest.approx(1 - 0.5 * float((p - q_full).abs().sum()), abs=1e-6)
    # the KL renormalises the target on {0, 2}: P_d = (2/3, 1/3), blind to the 0.4 outside
    assert dist["kl"].item() == pytest.approx(2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3), rel=1e-5)


def test_chain_acceptance_counts_only_proposed_drafts():
    # rounds (drafted, accepted): a short last round proposes 1 draft, so positions 2-3 do not see it
    drafted, accepted = [3, 3, 3, 1], [2, 3, 1, 1]
    assert chain_acceptance(accepted, drafted, 3) == [1.0, 2 / 3, 0.5]
    stats = AcceptanceStats(3)
    for a, d in zip(accepted, drafted):
        stats.update(a, d)
    assert stats.chain_acceptance() == [1.0, 2 / 3, 0.5] and stats.tau_drafted() == 11 / 4
    # every round drafts k: the same as the conditional beta_i of the unconditional alpha_i
    full = [2, 3, 1, 0]
    beta = conditional_acceptance(acceptance_per_position(full, 3))
    assert chain_acceptance(full, [3] * 4, 3) == pytest.approx(beta)
    assert chain_acceptance([], [], 2) == [None, None]


def test_kl_target_draft_is_kl_from_logits_on_the_draft_vocab():
    gen = torch.Generator().manual_seed(0)
    target, draft = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
    t2d = torch.tensor([True, True, False, True, True, False, True])
    assert torch.equal(kl_target_draft(target, draft, t2d), kl_from_logits(target[:, t2d], draft))
    p, q = target.softmax(-1), torch.randn(4, 7, generator=gen)
    torch.testing.assert_close(kl_from_logits(target, q), (p * (p.log() - q.log_softmax(-1))).sum(-1))
