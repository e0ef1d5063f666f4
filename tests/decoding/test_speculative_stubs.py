"""Speculative loop on stub targets and drafters: exact acceptance lengths and sampled-output distributions."""

import pytest
import torch
from decoding_stubs import (
    MarkovDrafter,
    MarkovTarget,
    ScriptedDrafter,
    chi2_pvalue,
    deterministic_table,
)

from draftkit.decoding.drafters import PromptLookupDrafter
from draftkit.decoding.verify import _check_prompt, generate_plain, generate_speculative, greedy_verify, rejection_verify
from draftkit.sampling import DecodeConfig

V = 11


def next_of(t: int) -> int:
    return (3 * t + 1) % V


@pytest.mark.parametrize(
    "pattern, tau, alpha",
    [
        ([4], 5.0, [1.0, 1.0, 1.0, 1.0]),  # always agree
        ([0], 1.0, [0.0, 0.0, 0.0, 0.0]),  # never agree
        ([2, 0, 4, 1], 11 / 4, [0.75, 0.5, 0.25, 0.25]),  # sometimes
    ],
)
def test_exact_tau_with_stubs(pattern, tau, alpha):
    k, rounds = 4, 8
    emitted_per_cycle = sum(a + 1 for a in pattern)
    max_new = 1 + emitted_per_cycle * rounds // len(pattern)  # prefill token + whole rounds
    target = MarkovTarget(deterministic_table(V))
    drafter = ScriptedDrafter(next_of, pattern, V)
    prompt = torch.tensor([5, 2, 7])
    cfg = DecodeConfig(max_new_tokens=max_new)
    spec = generate_speculative(target, drafter, prompt, k, cfg)
    plain = generate_plain(target, prompt, cfg)
    assert spec.tokens == plain.tokens
    assert spec.stats.rounds == rounds
    assert spec.stats.tau() == pytest.approx(tau)
    assert spec.stats.per_position() == pytest.approx(alpha)
    assert spec.target_forwards == rounds
    assert target.forward_lengths[: rounds + 1] == [3] + [k + 1] * rounds  # prefill, then one verify of k+1 per round
    assert drafter.commits == [(pattern[r % len(pattern)] + 1) for r in range(rounds)]  # a+1 aux rows per round
    assert spec.weight_bytes == rounds * (1000 + 10 * k)
    assert len(spec.tokens) == max_new


def test_eos_stops_and_truncates():
    table = deterministic_table(V)
    target = MarkovTarget(table)
    prompt = torch.tensor([0])  # greedy chain: 1, 4, 2, 7, 0, 1, ...
    cfg = DecodeConfig(max_new_tokens=50, eos_token_ids=(7,))
    spec = generate_speculative(target, ScriptedDrafter(next_of, [4], V), prompt, 4, cfg)
    assert spec.tokens == [1, 4, 2, 7]
    assert spec.stop_reason == "eos"
    # one round: drafts 4, 2, 7, 0 all match; the accepted prefix ends at the stop token (3 drafts)
    assert spec.stats.accepted == [3]
    assert generate_plain(target, prompt, cfg).tokens == [1, 4, 2, 7]


def test_max_new_tokens_mid_round():
    target = MarkovTarget(deterministic_table(V))
    cfg = DecodeConfig(max_new_tokens=3)
    spec = generate_speculative(target, ScriptedDrafter(next_of, [4], V), torch.tensor([0]), 4, cfg)
    assert spec.tokens == [1, 4, 2]
    assert spec.stats.accepted == [4]


def test_greedy_verify_and_prompt_lookup():
    logits = torch.eye(6)[[3, 1, 4, 1, 5]]  # argmax 3, 1, 4, 1, 5
    assert greedy_verify(torch.tensor([3, 1, 0, 1]), logits) == (2, 4)
    assert greedy_verify(torch.tensor([3, 1, 4, 1]), logits) == (4, 5)
    assert greedy_verify(torch.tensor([0, 1, 4, 1]), logits) == (0, 3)
    lookup = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    seq = torch.tensor([9, 1, 2, 3, 4, 5, 6, 1, 2])
    assert lookup.propose(seq, 3, None, None).ids.tolist() == [3, 4, 5]
    assert lookup.propose(torch.tensor([1, 2, 3]), 3, None, None).ids.numel() == 0
    # a run: the latest match with k tokens after it
    assert lookup.propose(torch.tensor([7, 7, 7, 7, 7, 7, 7]), 3, None, None).ids.tolist() == [7, 7, 7]


def test_prompt_lookup_in_the_loop_is_lossless():
    target = MarkovTarget(deterministic_table(V))
    cfg = DecodeConfig(max_new_tokens=40)
    prompt = torch.tensor([0, 1, 4, 2])
    spec = generate_speculative(target, PromptLookupDrafter(), prompt, 5, cfg)
    assert spec.tokens == generate_plain(target, prompt, cfg).tokens
    assert spec.stats.tau() > 2  # the chain cycles, so lookup keeps hitting


def test_rejection_sampling_reproduces_target_distribution():
    p = torch.tensor([[0.05, 0.4, 0.1, 0.25, 0.2, 0.0], [0.3, 0.1, 0.1, 0.1, 0.1, 0.3]])
    q = torch.tensor([[0.3, 0.1, 0.3, 0.1, 0.1, 0.1]])
    g = torch.Generator().manual_seed(0)
    n = 8000
    first = torch.zeros(6)
    accepted = 0
    for _ in range(n):
        d = torch.multinomial(q[0], 1, generator=g)
        a, nxt = rejection_verify(d, q, p, g)
        first[int(d) if a else nxt] += 1
        accepted += a
    assert chi2_pvalue(first[:5], n * p[0, :5]) > 1e-3
    assert first[5] == 0
    # acceptance probability is sum min(p, q) (arXiv 2211.17192, §3.3)
    assert accepted / n == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.02)


def test_deterministic_draft_rejection_residual():
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    for _ in range(2000):
        a, nxt = rejection_verify(torch.tensor([0]), None, p, g)
        counts[0 if a else nxt] += 1
    assert counts[2] == 0
    assert chi2_pvalue(counts[:2], 2000 * p[0, :2]) > 1e-3


def test_sampled_speculative_output_distribution_stub():
    torch.manual_seed(0)
    vocab = 4
    p_table = torch.rand(vocab, vocab) ** 2 + 0.02
    p_table /= p_table.sum(-1, keepdim=True)
    q_table = torch.rand(vocab, vocab) + 0.1
    q_table /= q_table.sum(-1, keepdim=True)
    target = MarkovTarget(p_table.log())
    drafter = MarkovDrafter(q_table)
    cfg = DecodeConfig(max_new_tokens=3, temperature=1.0)
    g = torch.Generator().manual_seed(0)
    n = 3000
    counts = torch.zeros(vocab, vocab, vocab)
    for _ in range(n):
        out = generate_speculative(target, drafter, torch.tensor([2]), 2, cfg, g).tokens
        counts[out[0], out[1], out[2]] += 1
    exact = p_table[2][:, None, None] * p_table[:, :, None] * p_table[None, :, :]  # p(t1|2) p(t2|t1) p(t3|t2)
    assert chi2_pvalue(counts.flatten(), n * exact.flatten()) > 1e-3


def test_kl_per_position_pairs_draft_step_i_with_target_row_i():
    """KL(target || draft) of draft position i uses the verify row that predicts d_i (the row of x_L for
    i = 1): checked against a direct computation on a target whose rows differ from token to token."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 3  # target logits after each token: every row different
    t2d = torch.ones(V, dtype=torch.bool)
    t2d[[2, 5]] = False  # KL over a draft vocab of 9 ids
    draft_logits = torch.randn(4, V - 2, generator=g) * 3  # fixed draft logits per position
    target = MarkovTarget(table)
    drafter = ScriptedDrafter(lambda t: int(table[t].argmax()), [2, 4, 0], V, draft_logits, t2d)
    spec = generate_speculative(target, drafter, torch.tensor([5, 2, 7]), 4, DecodeConfig(max_new_tokens=12),
                                collect_kl=True)
    verifies = target.inputs[1:]  # [x_L, d_1..d_4] per round
    assert len(verifies) == spec.stats.rounds == 4
    expected = []
    for i in range(4):
        kls = []
        for row in verifies:
            log_p = table[row[i]][t2d].log_softmax(-1)
            log_q = draft_logits[i].log_softmax(-1)
            kls.append(float((log_p.exp() * (log_p - log_q)).sum()))
        expected.append(sum(kls) / len(kls))
    assert spec.stats.kl_per_position() == pytest.approx(expected, rel=1e-5)


def test_bonus_token_comes_from_the_row_after_the_last_draft():
    """Every draft accepted (p(d_i) = 1): the bonus token is drawn from row k, here one-hot at 2."""
    p = torch.eye(3)  # row i is one-hot at i
    assert rejection_verify(torch.tensor([0, 1]), None, p, torch.Generator().manual_seed(0)) == (2, 2)
    q = torch.tensor([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05]])
    assert rejection_verify(torch.tensor([0, 1]), q, p, torch.Generator().manual_seed(0)) == (2, 2)


def test_sampled_speculative_distribution_with_bonus_tokens():
    """Sampled speculative decoding over whole rounds (k = 2, 1 + 3 tokens): the 4-token outputs follow the
    target's joint distribution, bonus tokens included (about half of the rounds accept both drafts)."""
    torch.manual_seed(1)
    vocab = 3
    p_table = torch.rand(vocab, vocab) ** 3 + 0.03
    p_table /= p_table.sum(-1, keepdim=True)
    q_table = (p_table + 0.1 * torch.rand(vocab, vocab)).clamp_min(0.01)  # close to p: drafts are often accepted
    q_table /= q_table.sum(-1, keepdim=True)
    target = MarkovTarget(p_table.log())
    cfg = DecodeConfig(max_new_tokens=4, temperature=1.0)
    g = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.zeros((vocab,) * 4)
    bonus_rounds = 0
    for _ in range(n):
        out = generate_speculative(target, MarkovDrafter(q_table), torch.tensor([2]), 2, cfg, g)
        counts[tuple(out.tokens)] += 1
        bonus_rounds += out.stats.accepted[0] == 2
    assert bonus_rounds > n // 3
    p1 = p_table[2]
    exact = p1[:, None, None, None] * p_table[:, :, None, None] * p_table[None, :, :, None] * p_table[None, None, :, :]
    assert chi2_pvalue(counts.flatten(), n * exact.flatten()) > 1e-3


# draftkit.decoding.verify's prompt check: each of its conditions alone (issue 36).


@pytest.mark.parametrize("prompt", [torch.zeros(0, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)])
def test_empty_or_2d_prompt_is_refused(prompt):
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        _check_prompt(prompt, DecodeConfig(max_new_tokens=2), 1, 64)
