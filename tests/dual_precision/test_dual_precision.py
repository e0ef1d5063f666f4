"""Dual-precision decoding: gates, calibration, replay, verified speculation, evaluation, the command (§4-7)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from draftkit.decoding.metrics import kl_from_logits
from draftkit.sampling import DecodeConfig
from draftkit.dual_precision import (
    DualPrecisionConfig,
    Gate,
    calibrate_thresholds,
    evaluate_dual_precision,
    gate_scores,
    greedy_decode,
    replay_steps,
    teacher_forced_logits,
    threshold_for_budget,
    verified_decode,
)
from draftkit.quant import QuantConfig, WeightBytes
from draftkit.target.session import TargetSession

PROMPTS = [[256, 10, 72, 105, 33], [256, 200, 15, 7, 7, 99, 3], [256, 1, 2, 3], [256, 90, 91, 250, 251, 30]]


# ---------------------------------------------------------------------------------------------- stubs


class FakeSession:
    """What the loops use of a ``TargetSession`` with a precision switch; the cache is the list of tokens seen
    and a subclass's ``logits(seq, n, precision)`` gives the (n, V) logits of the last n positions of ``seq``."""

    def __init__(self):
        self.precision_bytes = WeightBytes(high=100.0, low=60.0, high_plane=40.0, quantized_params=80, other=20.0)
        self.cache = []

    @property
    def length(self):
        return len(self.cache)

    def reset(self):
        self.cache = []

    def crop(self, length):
        del self.cache[length:]

    def forward(self, input_ids, logits_to_keep=0, precision=None):
        self.cache += list(input_ids)
        return self.logits(self.cache, logits_to_keep or len(input_ids), precision), None


class StubLM(FakeSession):
    """Fixed-logit two-precision model over V=16 tokens: high predicts (last + 1) % 16; low agrees with high
    except at the generated positions listed in ``disagree_at`` (absolute sequence positions), where it
    predicts (last + 2) % 16."""

    V = 16

    def __init__(self, disagree_at=(), always_disagree=False):
        super().__init__()
        self.disagree_at, self.always = set(disagree_at), always_disagree
        self.calls = []

    def _logits(self, seq, pos, precision):
        nxt = (seq[pos] + 1) % self.V
        if precision == "low" and (self.always or pos + 1 in self.disagree_at):
            nxt = (seq[pos] + 2) % self.V
        out = torch.zeros(self.V)
        out[nxt] = 5.0
        return out

    def forward(self, input_ids, logits_to_keep=0, precision=None):
        self.calls.append((precision, len(input_ids)))
        return super().forward(input_ids, logits_to_keep, precision)

    def logits(self, seq, n, precision):
        return torch.stack([self._logits(seq, p, precision) for p in range(len(seq) - n, len(seq))])


def _expected_high(prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last + 1) % StubLM.V
        out.append(last)
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_verified_stub_always_accept(k):
    lm = StubLM()
    rounds = 3
    traj = verified_decode(lm, [0, 3], k, DecodeConfig(1 + rounds * (k + 1)))
    assert traj.tokens == _expected_high([0, 3], 1 + rounds * (k + 1))
    assert traj.rounds == [(k, k)] * rounds  # tau = k + 1 (bonus token counted)
    assert traj.low_forwards == rounds * k and traj.high_forwards == 1 + rounds
    per_token = traj.weight_bytes_read(lm.precision_bytes) / len(traj.tokens)
    assert per_token == (100.0 + rounds * (k * 60.0 + 100.0)) / (1 + rounds * (k + 1))


@pytest.mark.parametrize("k", [1, 3])
def test_verified_stub_never_accept(k):
    lm = StubLM(always_disagree=True)
    traj = verified_decode(lm, [0, 3], k, DecodeConfig(6))
    assert traj.tokens == _expected_high([0, 3], 6)
    assert [a for _, a in traj.rounds] == [0] * 5  # one corrected token per round
    assert traj.weight_bytes_read(lm.precision_bytes) == 100.0 + sum(d * 60.0 + 100.0 for d, _ in traj.rounds)


def test_verified_stub_sometimes_accept_exact_lengths():
    # the prompt holds positions 0-1 and the prefill emits position 2; low is wrong when predicting 5 and 11
    lm = StubLM(disagree_at={5, 11})
    traj = verified_decode(lm, [0, 3], 3, DecodeConfig(12))
    assert traj.tokens == _expected_high([0, 3], 12)
    # drafts 3,4,5 -> 2 accepted + correction at 5; drafts 6,7,8 -> all + bonus 9; drafts 10,11,12 -> 1 accepted
    # + correction at 11; one token left before the limit of 12 -> k = 1: draft 12 accepted + bonus 13
    assert traj.rounds == [(3, 2), (3, 3), (3, 1), (1, 1)]
    assert traj.low_forwards == 10 and traj.high_forwards == 5


def test_verified_report_tau_and_chain_acceptance_on_stub():
    lm = StubLM(disagree_at={5, 11})
    config = DualPrecisionConfig(entropy_threshold=1.0, max_new_tokens=12, k=3, bootstrap_samples=0,
                                 methods=("verified",))
    entry = evaluate_dual_precision(lm, [[0, 3]], [], config)["methods"]["verified"]
    # rounds [(3, 2), (3, 3), (3, 1), (1, 1)]: position 1 reached 4x accepted 4x, position 2 3x/2x, position 3 2x/1x
    assert entry["alpha"] == [1.0, 2 / 3, 0.5]
    assert entry["tau"] == (3 + 4 + 2 + 2) / 4
    assert entry["bytes_per_token"] == (5 * 100.0 + 10 * 60.0) / 12
    assert entry["exact_match"] == 1.0 and entry["kl_mean"] == pytest.approx(0.0, abs=1e-6)


def test_gated_stub_escalates_by_score():
    # low logits are one-hot-ish with the same shape everywhere: entropy is constant, so tau decides
    lm = StubLM(always_disagree=True)
    h = float(gate_scores(lm._logits([0], 0, "low"))["entropy"])
    never = greedy_decode(lm, [0, 3], DecodeConfig(5), gate=Gate("entropy", h + 1.0))
    always = greedy_decode(lm, [0, 3], DecodeConfig(5), gate=Gate("entropy", h - 1.0))
    assert never.escalated == [False] * 5 and never.high_forwards == 0 and never.low_forwards == 5
    assert always.escalated == [True] * 5 and always.high_forwards == 5 and always.low_forwards == 5
    assert always.tokens == _expected_high([0, 3], 5)
    assert lm.calls[-2:] == [("low", 1), ("high", 1)]  # each step: 4-bit pass, then the 8-bit re-run
    # the re-run replaces the whole step's rows (the prompt's, at step 1): the cache holds each token once
    assert lm.cache == [0, 3] + always.tokens[:-1]
    at = greedy_decode(lm, [0, 3], DecodeConfig(5), gate=Gate("entropy", h))  # a score equal to tau: not above it
    assert at.escalated == [False] * 5 and at.high_forwards == 0


# ---------------------------------------------------------------------------------------------- sampled


class MarkovDualLM(FakeSession):
    """Two precisions of a first-order Markov chain over V tokens: logits = log table[precision][last token]."""

    def __init__(self, high: torch.Tensor, low: torch.Tensor):
        super().__init__()
        self.tables = {"high": high.log(), "low": low.log()}

    def logits(self, seq, n, precision):
        return self.tables[precision][torch.tensor(seq[-n:])]  # (n, V)


def _markov_tables(vocab=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    high = torch.rand(vocab, vocab, generator=g) ** 2 + 0.02
    low = torch.rand(vocab, vocab, generator=g) + 0.1  # a different distribution: drafts get rejected
    return high / high.sum(-1, keepdim=True), low / low.sum(-1, keepdim=True)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_verified_reproduces_the_8bit_distribution(temperature, top_p):
    from decoding_stubs import chi2_pvalue

    from draftkit.sampling import probs_from_logits

    high, low = _markov_tables()
    lm = MarkovDualLM(high, low)
    p = probs_from_logits(high.log(), temperature, 0, top_p)  # (V, V) the warped 8-bit chain
    g = torch.Generator().manual_seed(0)
    n, counts, rounds = 3000, torch.zeros(4, 4, 4), []
    for _ in range(n):
        traj = verified_decode(lm, [2], 2, DecodeConfig(3, temperature, top_p=top_p), generator=g)
        counts[tuple(traj.tokens)] += 1
        rounds += traj.rounds
    exact = (p[2][:, None, None] * p[:, :, None] * p[None, :, :]).flatten()  # p(t1|2) p(t2|t1) p(t3|t2)
    support = exact > 0
    assert (counts.flatten()[~support] == 0).all()  # nothing outside the 8-bit nucleus is ever emitted
    assert chi2_pvalue(counts.flatten()[support], n * exact[support]) > 1e-3
    accepted = sum(a for d, a in rounds) / sum(d for d, a in rounds)
    assert 0.2 < accepted < 0.95  # drafts are both accepted and rejected: the residual path is exercised
    # the low chain alone is far from the 8-bit one, so the test can tell them apart
    q = probs_from_logits(low.log(), temperature, 0, top_p)
    wrong = (q[2][:, None, None] * q[:, :, None] * q[None, :, :]).flatten()
    assert chi2_pvalue(counts.flatten()[wrong > 0], n * wrong[wrong > 0]) < 1e-6


def test_sampled_gates_follow_the_sampled_path():
    high, low = _markov_tables()
    lm = MarkovDualLM(high, low)
    cfg = DecodeConfig(12, temperature=1.0, top_p=0.9)
    ref = greedy_decode(lm, [2], cfg, precision="high", generator=torch.Generator().manual_seed(5))
    # every step escalates: the same draws from the same 8-bit distributions give the all-high sample
    always = greedy_decode(lm, [2], cfg, gate=Gate("margin", -2.0), generator=torch.Generator().manual_seed(5))
    assert always.tokens == ref.tokens and always.escalated == [True] * 12 and always.high_forwards == 12
    never = greedy_decode(lm, [2], cfg, gate=Gate("margin", 2.0), generator=torch.Generator().manual_seed(5))
    low_ref = greedy_decode(lm, [2], cfg, precision="low", generator=torch.Generator().manual_seed(5))
    assert never.tokens == low_ref.tokens and never.high_forwards == 0
    # the gate scored the 4-bit distribution of each sampled prefix
    assert never.scores == pytest.approx([float(gate_scores(lm.tables["low"][t])["margin"])
                                          for t in [2, *never.tokens[:-1]]])
    with pytest.raises(ValueError, match="top_p"):
        greedy_decode(lm, [2], DecodeConfig(3, temperature=1.0, top_p=0.0))


def _without_timing(report):
    return {k: v for k, v in report.items() if k != "timing_s"}


def test_evaluation_resumes_from_the_per_prompt_record(tmp_path):
    path = tmp_path / "prompts.jsonl"
    evaluation, calibration = [[0, 3], [0, 7, 1], [0, 9, 2, 4]], [[0, 1, 1, 1, 1], [0, 2, 2, 2, 2, 2]]
    config = DualPrecisionConfig(budget=0.3, max_new_tokens=8, k=2, bootstrap_samples=0)
    full_lm = StubLM(disagree_at={5, 11})
    full = evaluate_dual_precision(full_lm, evaluation, calibration, config, record=str(path))
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 2 + 3  # header, 2 calibration prompts, 3 evaluation prompts
    path.write_text("\n".join(lines[:4]) + '\n{"key": "evaluation/1/", "va')  # killed during prompt 2
    lm = StubLM(disagree_at={5, 11})
    resumed = evaluate_dual_precision(lm, evaluation, calibration, config, record=str(path))
    assert _without_timing(resumed) == _without_timing(full)
    # calibration and evaluation prompt 1 came from the record: the first forward is prompt 2's prefill
    assert full_lm.calls[0] == ("high", 5) and lm.calls[0] == ("high", 3)
    assert len(lm.calls) < len(full_lm.calls)
    other = DualPrecisionConfig(budget=0.3, max_new_tokens=9, k=2, bootstrap_samples=0)
    with pytest.raises(ValueError, match="a record of a different run"):
        evaluate_dual_precision(lm, evaluation, calibration, other, record=str(path))


def test_record_reports_on_a_prefix_and_extends_to_more_prompts(tmp_path):
    """Rows are keyed by index and prompt digest: a rerun on the first N prompts reads everything from the
    record (the report of an interrupted run), a longer one computes only the new prompts, and a changed
    prompt at an index is recomputed, not read."""
    path = tmp_path / "prompts.jsonl"
    evaluation, calibration = [[0, 3], [0, 7, 1], [0, 9, 2, 4]], [[0, 1, 1, 1, 1], [0, 2, 2, 2, 2, 2]]
    config = DualPrecisionConfig(budget=0.3, max_new_tokens=8, k=2, bootstrap_samples=0)
    two = evaluate_dual_precision(StubLM(disagree_at={5, 11}), evaluation[:2], calibration, config, record=str(path))
    assert len(path.read_text().splitlines()) == 1 + 2 + 2
    prefix_lm = StubLM(disagree_at={5, 11})
    one = evaluate_dual_precision(prefix_lm, evaluation[:1], calibration, config, record=str(path))
    assert prefix_lm.calls == []  # calibration and prompt 1 from the record
    fresh = evaluate_dual_precision(StubLM(disagree_at={5, 11}), evaluation[:1], calibration, config)
    assert _without_timing(one) == _without_timing(fresh)
    assert one["replay"]["num_prompts"] == 1 and two["replay"]["num_prompts"] == 2
    more_lm = StubLM(disagree_at={5, 11})
    three = evaluate_dual_precision(more_lm, evaluation, calibration, config, record=str(path))
    assert more_lm.calls[0] == ("high", 4)  # only prompt 3 (4 ids) is decoded
    full = evaluate_dual_precision(StubLM(disagree_at={5, 11}), evaluation, calibration, config)
    assert _without_timing(three) == _without_timing(full)
    changed_lm = StubLM(disagree_at={5, 11})
    evaluate_dual_precision(changed_lm, [[0, 3], [0, 8, 1]], calibration, config, record=str(path))
    assert changed_lm.calls[0] == ("high", 3)  # prompt 2 differs from the recorded one: recomputed


def test_sampled_evaluation_verified_is_exact_in_distribution():
    high, low = _markov_tables()
    lm = MarkovDualLM(high, low)
    from draftkit.dual_precision import top2_margin

    margins = top2_margin(low.log()).sort().values  # (V,) one 4-bit margin per last token
    config = DualPrecisionConfig(margin_threshold=float(margins[1:3].mean()), max_new_tokens=16, k=2,
                                 bootstrap_samples=0, temperature=1.0, top_p=0.95, seed=3)  # 2 of 4 escalate
    report = evaluate_dual_precision(lm, [[2], [1], [0]], [], config)
    assert report["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0}
    methods = report["methods"]
    assert methods["verified"]["kl_mean"] == pytest.approx(0.0, abs=1e-6)  # every token from the 8-bit p
    assert methods["all_low"]["kl_mean"] > 0.05
    assert 0.0 < methods["margin_gate"]["escalation_rate"] < 1.0
    again = evaluate_dual_precision(lm, [[2], [1], [0]], [], config)
    assert _without_timing(again) == _without_timing(report)  # seeded per prompt: reproducible


# ---------------------------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny_lm(tiny_target_dir):
    """The tiny Llama's session with a precision switch, in float64 (exact enough that kernel numerics never flip
    a tie)."""
    from draftkit.target.frozen import load_target

    model, _ = load_target(str(tiny_target_dir), "float64")
    return TargetSession.with_precision_switch(model)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_verified_equals_all_high_on_tiny_model(tiny_lm, k):
    accepted = rejected = 0
    for prompt in PROMPTS[:3]:
        high = greedy_decode(tiny_lm, prompt, DecodeConfig(16), precision="high")
        traj = verified_decode(tiny_lm, prompt, k, DecodeConfig(16))
        assert traj.tokens == high.tokens
        torch.testing.assert_close(traj.logits, high.logits, rtol=1e-5, atol=1e-5)
        wb = tiny_lm.precision_bytes
        assert traj.weight_bytes_read(wb) == pytest.approx(wb.high + sum(d * wb.low + wb.high for d, _ in traj.rounds))
        accepted += sum(a for _, a in traj.rounds)
        rejected += sum(a < d for d, a in traj.rounds)
    assert accepted > 0 and rejected > 0  # both paths of the accept rule ran


def test_gated_all_escalate_is_all_high_with_zero_kl(tiny_lm):
    for prompt in PROMPTS[:2]:
        high = greedy_decode(tiny_lm, prompt, DecodeConfig(16), precision="high")
        low = greedy_decode(tiny_lm, prompt, DecodeConfig(16), precision="low")
        every = greedy_decode(tiny_lm, prompt, DecodeConfig(16), gate=Gate("margin", -2.0))  # -margin > -2 always
        none = greedy_decode(tiny_lm, prompt, DecodeConfig(16), gate=Gate("entropy", 1e9))
        assert every.tokens == high.tokens and all(every.escalated)
        assert none.tokens == low.tokens and not any(none.escalated)
        ref = teacher_forced_logits(tiny_lm, prompt, every.tokens, "high")
        assert kl_from_logits(ref, every.logits).abs().max() < 1e-7
        # the random tiny model is near uniform, so 4-bit KL is small, but far from numerics
        assert kl_from_logits(teacher_forced_logits(tiny_lm, prompt, low.tokens, "high"), low.logits).mean() > 1e-4


def test_gated_overwrites_kv_of_escalated_steps(tiny_lm):
    """Mixed run == a cache-free recomputation with each position's K/V at the precision the run used."""
    prompt = PROMPTS[1]
    steps, _ = replay_steps(tiny_lm, prompt, greedy_decode(tiny_lm, prompt, DecodeConfig(12)).tokens)
    gate = Gate("entropy", threshold_for_budget(steps.scores["entropy"], 0.5))
    traj = greedy_decode(tiny_lm, prompt, DecodeConfig(12), gate=gate)
    assert 0 < sum(traj.escalated) < len(traj.tokens)
    # replay the run with a fresh cache, step by step, using the recorded decisions
    tiny_lm.reset()
    x = list(prompt)
    for tok, esc, logits in zip(traj.tokens, traj.escalated, traj.logits):
        out = tiny_lm.forward(x, 1, precision="high" if esc else "low")[0][-1]
        torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)
        x = [tok]


def test_threshold_from_budget_hits_it_on_calibration_data(tiny_lm):
    steps = []
    for prompt in PROMPTS:
        traj = greedy_decode(tiny_lm, prompt, DecodeConfig(24), keep_logits=False)
        steps.append(replay_steps(tiny_lm, prompt, traj.tokens)[0])
    n = sum(s.flip.numel() for s in steps)
    for budget in (0.05, 0.10, 0.15, 0.30):
        gates = calibrate_thresholds(steps, budget)
        for kind, gate in gates.items():
            scores = torch.cat([s.scores[kind] for s in steps])
            realised = float((scores > gate.threshold).double().mean())
            assert realised == round(budget * n) / n, (kind, budget)
            assert abs(realised - budget) <= 0.5 / n + 1e-12
    assert gates["margin"].natural_threshold == -gates["margin"].threshold


def test_replay_flip_labels(tiny_lm):
    prompt = PROMPTS[0]
    high = greedy_decode(tiny_lm, prompt, DecodeConfig(10))
    steps, tf_high = replay_steps(tiny_lm, prompt, high.tokens)
    torch.testing.assert_close(tf_high, high.logits, rtol=1e-5, atol=1e-5)  # same prefix, same distribution
    low = teacher_forced_logits(tiny_lm, prompt, high.tokens, "low")
    assert torch.equal(steps.flip, low.argmax(-1) != high.logits.argmax(-1))
    probs = low.softmax(-1).topk(2).values
    torch.testing.assert_close(steps.scores["margin"], -(probs[:, 0] - probs[:, 1]))


# ---------------------------------------------------------------------------------------------- evaluation


def test_config_bad_input():
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        DualPrecisionConfig(budget=1.5)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        DualPrecisionConfig(budget=0.0)
    with pytest.raises(ValueError, match="choose one"):
        DualPrecisionConfig(budget=0.1, entropy_threshold=2.0)
    assert DualPrecisionConfig().budget == 0.15
    assert DualPrecisionConfig(margin_threshold=0.1).budget is None


def test_no_quantizable_linears(tiny_target_dir):
    from draftkit.target.frozen import load_target

    model, _ = load_target(str(tiny_target_dir), "float32")
    with pytest.raises(ValueError, match="no quantizable linears"):
        TargetSession.with_precision_switch(model, QuantConfig(include=("*.does_not_exist.*",)))


def test_evaluate_report_on_tiny_model(tiny_lm):
    config = DualPrecisionConfig(budget=0.2, max_new_tokens=10, k=2, bootstrap_samples=20)
    report = evaluate_dual_precision(tiny_lm, PROMPTS[:2], PROMPTS[2:], config)
    methods = report["methods"]
    assert list(methods) == ["all_high", "all_low", "entropy_gate", "margin_gate", "verified"]
    for entry in methods.values():
        assert {"bytes_per_token", "bytes_ratio_vs_high", "kl_mean", "escalation_rate", "exact_match"} <= set(entry)
    wb = tiny_lm.precision_bytes
    assert methods["all_high"]["bytes_per_token"] == wb.high and methods["all_high"]["kl_mean"] < 1e-6
    assert methods["all_low"]["bytes_ratio_vs_high"] == pytest.approx(wb.rho)
    assert methods["verified"]["exact_match"] == 1.0 and methods["verified"]["kl_mean"] < 1e-6
    e = methods["entropy_gate"]["escalation_rate"]
    assert methods["entropy_gate"]["bytes_ratio_models"]["i"] == pytest.approx(wb.rho + e)
    replay = report["replay"]
    assert {"num_steps", "flip_rate", "auc_entropy", "auc_margin", "catch_at_budget"} <= set(replay)
    assert replay["num_steps"] == 20
    assert report["thresholds"]["source"] == "calibrated" and report["calibration"]["num_steps"] == 20
    assert report["mcnemar"]["exact_match"]["all_high|verified"] == {"b": 0, "c": 0, "p": 1.0}


def test_evaluate_with_correctness_labels(tiny_lm):
    config = DualPrecisionConfig(entropy_threshold=3.0, max_new_tokens=6, k=1, bootstrap_samples=0,
                                 methods=("all_low", "entropy_gate", "margin_gate"))
    report = evaluate_dual_precision(tiny_lm, PROMPTS[:3], [], config, is_correct=lambda i, toks: i != 1)
    assert list(report["methods"]) == ["all_high", "all_low", "entropy_gate"]  # no margin threshold given
    assert report["methods"]["all_low"]["accuracy"] == pytest.approx(2 / 3)
    assert report["mcnemar"]["correct"]["all_high|all_low"]["p"] == 1.0


# ---------------------------------------------------------------------------------------------- command


def _write_prompts(path, texts):
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def test_cli_end_to_end(tiny_target_dir, tmp_path, fake_precision):
    from draftkit.commands import main

    choice = fake_precision("float32", 30.0)
    prompts = _write_prompts(tmp_path / "p.jsonl", [f"question number {i}?" for i in range(6)])
    out, tb = tmp_path / "report.json", tmp_path / "tb"
    rc = main(["evaluate-dual-precision", "--target", str(tiny_target_dir), "--prompts", prompts,
               "--calibration_prompts", "2", "--num_prompts", "3", "--max_new_tokens", "6", "--k", "2",
               "--bootstrap_samples", "10", "--output", str(out), "--tensorboard", str(tb)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["sizes"] == {"calibration_prompts": 2, "evaluation_prompts": 3, "max_new_tokens": 6, "k": 2}
    assert not set(report["prompts"]["evaluation_ids"]) & set(report["prompts"]["calibration_ids"])
    assert report["methods"]["verified"]["exact_match"] == 1.0
    assert report["dtype"] == "float32"  # the default for dual precision (issue 16), whatever auto would pick
    assert report["precision"] == {"requested": "float32", "dtype": "float32", "auto": choice.as_dict()}
    assert report["template"] == "chat" and report["quant"]["group_size"] is None  # the tiny tokenizer: ChatML
    assert report["record"] == str(tmp_path / "report.prompts.jsonl")
    assert len((tmp_path / "report.prompts.jsonl").read_text().splitlines()) == 1 + 2 + 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb)).Reload()
    assert {"dual_precision/catch_vs_budget", "dual_precision/bytes_vs_kl"} <= set(events.Tags()["images"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--budget", "1.2"], "(0, 1)"),
        (["--budget", "0"], "(0, 1)"),
        (["--budget", "0.1", "--margin_threshold", "0.2"], "choose one"),
        (["--num_prompts", "50"], "only 4 prompts remain"),
    ],
)
def test_cli_bad_options(tiny_target_dir, tmp_path, capsys, extra, message):
    from draftkit.commands import main

    prompts = _write_prompts(tmp_path / "p.jsonl", [f"q{i}" for i in range(6)])
    assert main(["evaluate-dual-precision", "--target", str(tiny_target_dir), "--prompts", prompts,
                 "--calibration_prompts", "2", *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_cli_plain_template_sampling_groups_and_resume(tiny_target_dir, tmp_path, caplog, capsys):
    from draftkit.commands import main

    prompts = _write_prompts(tmp_path / "p.jsonl", [f"question number {i}?" for i in range(5)])
    out = tmp_path / "r.json"
    argv = ["evaluate-dual-precision", "--target", str(tiny_target_dir), "--prompts", prompts, "--calibration_prompts",
            "2", "--max_new_tokens", "5", "--k", "2", "--bootstrap_samples", "0", "--template", "plain",
            "--group_size", "32", "--temperature", "0.8", "--top_p", "0.9", "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["template"] == "plain" and report["quant"]["group_size"] == 32
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 0}
    assert report["weight_bytes"]["scales"] == 8 * (2 * (64 + 32 + 32 + 64 + 128 + 128) + 4 * 64)
    assert report["methods"]["verified"]["kl_mean"] == pytest.approx(0.0, abs=1e-5)
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0  # everything comes from the record
    assert "resuming from" in caplog.text and "evaluation prompt 1/3" not in caplog.text
    again = json.loads(out.read_text())
    assert again["methods"] == report["methods"] and again["replay"] == report["replay"]
    assert main([*argv[:-2], "--group_size", "64", "--output", str(out)]) == 2  # same record, another quantizer
    assert "r.prompts.jsonl: a record of a different run" in capsys.readouterr().err


def test_cli_overlap_warning_and_bad_records(tiny_target_dir, tmp_path, caplog):
    from draftkit.data.prompts import load_prompts, split_prompts
    from draftkit.commands import main

    prompts = _write_prompts(tmp_path / "p.jsonl", [f"q{i}" for i in range(5)])
    calib = _write_prompts(tmp_path / "c.jsonl", ["q1", "q3", "other"])
    _, evaluation, overlap = split_prompts(load_prompts(prompts), load_prompts(calib), None)
    assert overlap == 2 and len(evaluation) == 5
    with caplog.at_level(logging.WARNING):
        rc = main(["evaluate-dual-precision", "--target", str(tiny_target_dir), "--prompts", prompts, "--calibration_prompts", calib,
                   "--max_new_tokens", "2", "--bootstrap_samples", "0", "--output", str(tmp_path / "r.json")])
    assert rc == 0
    assert "2 of 5 evaluation prompts also appear in the calibration prompts" in caplog.text
    assert json.loads((tmp_path / "r.json").read_text())["prompts"]["overlap"] == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"answer": "42"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl record 2 has no prompt text"):
        load_prompts(str(bad))


# ---------------------------------------------------------------------------------------------- real target


@pytest.mark.slow
def test_smollm2_verified_equals_all_high():
    from draftkit.data.prompts import load_prompts
    from draftkit.commands.evaluate_dual_precision import SMOLLM2_REF
    from draftkit.target.frozen import load_target

    model, tok = load_target(SMOLLM2_REF, "float32")
    lm = TargetSession.with_precision_switch(model)
    assert len(lm.precision_layers) == 30 * 7 and round(lm.precision_bytes.rho, 3) == 0.675
    text = load_prompts("mt-bench")[0].text
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    prompt = tok(chat, add_special_tokens=False)["input_ids"]
    cfg = DecodeConfig(12, eos_token_ids=(tok.eos_token_id,))
    high = greedy_decode(lm, prompt, cfg)
    verified = verified_decode(lm, prompt, 2, cfg)
    assert verified.tokens == high.tokens
    steps, _ = replay_steps(lm, prompt, high.tokens)
    assert steps.flip.shape == (len(high.tokens),) and (steps.scores["entropy"] >= 0).all()
