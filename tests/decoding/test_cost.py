"""The cost model: interpolation, the optimum on a synthetic cost table, plain fallback, calibration."""

import pytest
import torch

from draftkit.decoding.cost import (
    calibrate_sampled,
    CostTable,
    calibrate_rounds,
    candidate_topologies,
    choose,
    greedy_sequences,
    measure_costs,
    fastest,
    monotone,
    predict,
)
from draftkit.decoding.metrics import HEAD
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession
from draftkit.decoding.tree import Eagle3TreeDrafter, TreeConfig, generate_tree
from draftkit.decoding.verify import generate_speculative

MS = 1e-3
# a CPU-like target: +1 ms per verified row up to 4, then +1 ms per 2 rows
TABLE = CostTable(verify={1: 10 * MS, 2: 11 * MS, 4: 13 * MS, 8: 15 * MS, 16: 19 * MS}, first=2 * MS,
                  step={1: 1 * MS, 2: 1.2 * MS, 4: 1.5 * MS})


def test_cost_table_interpolates():
    assert TABLE.verify_seconds(3) == pytest.approx(12 * MS)
    assert TABLE.verify_seconds(12) == pytest.approx(17 * MS)
    assert TABLE.verify_seconds(32) == pytest.approx(27 * MS)  # last segment extended: 0.5 ms per row
    # chain k=2: step 0 + one head pass + verify of 3 rows
    assert TABLE.round_seconds(TreeConfig.chain(2)) == pytest.approx((2 + 1 + 12) * MS)
    # tree (3, 2, 8): step 0 + two passes of width 2 + verify of 9 rows
    assert TABLE.round_seconds(TreeConfig(3, 2, 8)) == pytest.approx((2 + 2.4 + 15.5) * MS)


def test_cost_model_picks_the_known_optimum():
    taus = {TreeConfig.chain(1): 1.6, TreeConfig.chain(2): 2.0, TreeConfig.chain(3): 2.2, TreeConfig(3, 2, 8): 2.6}
    # tokens/ms: 1.6/13 = .1231, 2.0/15 = .1333, 2.2/17 = .1294, 2.6/19.9 = .1307; plain 1/10
    preds = predict(taus, TABLE)
    assert [p.tree for p in preds] == [TreeConfig.chain(2), TreeConfig(3, 2, 8), TreeConfig.chain(3), TreeConfig.chain(1)]
    best = choose(preds)
    assert best.tree == TreeConfig.chain(2)
    assert best.speedup == pytest.approx(2.0 / 15 * 10)
    assert best.tokens_per_s == pytest.approx(2.0 / (15 * MS))
    # a better tree wins once its tau pays for its extra rows
    assert choose(predict({**taus, TreeConfig(3, 2, 8): 2.7}, TABLE)).tree == TreeConfig(3, 2, 8)


def test_cost_model_falls_back_to_plain():
    steep = CostTable(verify={1: 10 * MS, 2: 20 * MS, 8: 80 * MS}, first=2 * MS, step={1: 1 * MS})
    preds = predict({TreeConfig.chain(1): 1.9, TreeConfig.chain(3): 2.5}, steep)
    assert all(p.speedup < 1 for p in preds)
    assert choose(preds) is None
    assert choose([]) is None


def test_candidate_topologies():
    chains = candidate_topologies(False, max_depth=3)
    assert chains == [TreeConfig.chain(1), TreeConfig.chain(2), TreeConfig.chain(3)]
    trees = candidate_topologies(True, max_depth=3, topks=(2,), nodes=(4, 8, 16))
    assert trees[3:] == [TreeConfig(2, 2, 4), TreeConfig(3, 2, 4), TreeConfig(3, 2, 8)]


def test_calibration_replays_greedy_tree_decoding(tiny, tiny_head):
    """The calibration's rounds equal those greedy tree decoding actually plays (last round aside): accepted
    drafts, verified nodes (a hybrid's lookup nodes included) and whether the head drafted, for chains, trees and
    both hybrid modes (this prompt's greedy output repeats itself, so prompt lookup drafts in some rounds)."""
    target, _ = tiny
    session = TargetSession(target)
    prompt = torch.tensor([256, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 8])
    seqs = greedy_sequences(session, [prompt], 30)
    heads = [TreeConfig.chain(1), TreeConfig.chain(3), TreeConfig(3, 2, 5), TreeConfig(4, 3, 12)]
    topologies = heads + [TreeConfig(3, 2, 5, 6), TreeConfig.chain(2, 4, "switch"), TreeConfig(4, 3, 12, 4, "switch")]
    rounds = calibrate_rounds(Eagle3TreeDrafter(tiny_head), session, seqs, topologies)
    for t in topologies:
        real = generate_tree(session, Eagle3TreeDrafter(tiny_head), prompt, t, DecodeConfig(max_new_tokens=30))
        assert real.tokens == seqs[0][1].tolist()
        assert [p.accepted for p in rounds[t][:-1]] == real.stats.accepted[:-1], t
        assert [p.nodes for p in rounds[t][:-1]] == real.stats.drafted[:-1], t
        assert [p.head for p in rounds[t]] == [bool(s & HEAD) for s in real.stats.round_sources], t
        assert sum(p.accepted + 1 for p in rounds[t]) == 29  # every token after the first, once
        assert all(p.head and p.nodes == t.num_nodes for p in rounds[t]) == (t in heads), t


def test_sampled_calibration_plays_each_shape_as_it_decodes(tiny, tiny_head):
    """At T > 0 a topology's calibration rounds are exactly those it plays decoding the prompts with their
    generators: a chain as the chain (sampled drafts), a tree and a hybrid chain as trees; greedy is refused."""
    from draftkit.decoding.metrics import HEAD

    target, _ = tiny
    session = TargetSession(target)
    prompts = [torch.tensor([256, 33, 44, 55, 66]), torch.tensor([256, 7, 8, 9])]
    cfg = DecodeConfig(40, 1.0)

    def gen(i):
        return torch.Generator().manual_seed(10 + i)

    shapes = [TreeConfig.chain(3), TreeConfig(3, 2, 5), TreeConfig.chain(2, 4)]
    rounds = calibrate_sampled(Eagle3TreeDrafter(tiny_head), session, prompts, cfg, gen, shapes)
    assert list(rounds) == shapes
    for t in shapes:
        real = [generate_speculative(session, Eagle3TreeDrafter(tiny_head), p, 3, cfg, gen(i)) if t == shapes[0]
                else generate_tree(session, Eagle3TreeDrafter(tiny_head), p, t, cfg, gen(i))
                for i, p in enumerate(prompts)]
        assert [r.accepted for r in rounds[t]] == [a for g in real for a in g.stats.accepted], t
        assert [r.nodes for r in rounds[t]] == [d for g in real for d in g.stats.drafted], t
        if t != shapes[0]:
            assert [r.head for r in rounds[t]] == [bool(s & HEAD) for g in real for s in g.stats.round_sources]
    assert {a for r in rounds.values() for a in (p.accepted for p in r)} >= {0, 1}
    with pytest.raises(ValueError, match="temperature > 0"):
        calibrate_sampled(Eagle3TreeDrafter(tiny_head), session, prompts, DecodeConfig(8), gen, shapes)


def test_measure_costs_shapes(tiny, tiny_head):
    target, _ = tiny
    costs = measure_costs(TargetSession(target), Eagle3TreeDrafter(tiny_head), torch.arange(3, 20), [4, 9], [2], 2)
    assert sorted(costs.verify) == [1, 4, 9] and sorted(costs.step) == [1, 2]
    assert costs.first > 0 and all(v > 0 for v in costs.verify.values())
    assert costs.verify == costs.measured["verify"] and costs.step == monotone(costs.measured["step"])


def test_cover_pads_to_the_cheapest_row_count():
    """The float32 verify timings of SmolLM2 on 2 AVX512-BF16 cores (benchmarks/verify_rows.py, ms): 2-7 rows
    are cheapest run as 8 (7 is within the margin), and a chain k = 1 is priced at the 8-row forward."""
    cpu = CostTable(verify={1: 60.6 * MS, 2: 103.9 * MS, 3: 124.4 * MS, 4: 89.7 * MS, 8: 82.0 * MS}, first=3 * MS,
                    step={1: 3 * MS})
    assert cpu.cover(1) == (1, pytest.approx(60.6 * MS))
    for n in (2, 3, 4, 5, 6):
        assert cpu.cover(n) == (8, pytest.approx(82.0 * MS)), n
    assert cpu.cover(7) == (7, pytest.approx(83.925 * MS))  # 8 rows only 2.3 % cheaper: under PAD_MARGIN
    assert cpu.cover(8) == (8, pytest.approx(82.0 * MS))
    assert cpu.cover(10) == (10, pytest.approx(82.0 * MS))  # past the last entry: a falling segment stays flat
    assert cpu.padding() == {n: 8 for n in range(2, 7)}
    assert cpu.round_seconds(TreeConfig.chain(1)) == pytest.approx(85.0 * MS)
    assert TABLE.padding() == {}  # a nondecreasing table pads nothing
    assert CostTable(verify={1: 5 * MS, 2: 5 * MS}, first=0, step={1: 0}).cover(1) == (1, 5 * MS)  # ties: fewer rows
    near = CostTable(verify={1: 1.0, 4: 0.99, 8: 0.90}, first=0, step={1: 0})  # 4 rows 1 % faster: never padded to
    assert near.padding() == {n: 8 for n in range(1, 7)} and near.cover(1) == (8, 0.90)
    assert near.cover(7) == (7, pytest.approx(0.9225))  # 8 rows 2.4 % faster than the interpolated 7
    assert CostTable(verify={1: 1.0, 4: 1.0 - 1e-12}, first=0, step={1: 0}).padding() == {}  # noise never pads
    assert CostTable(verify={1: 1.0, 2: 0.5}, first=0, step={1: 0}).cover(3) == (3, 0.5)  # never free past the end


def test_monotone_pools_adjacent_violators():
    # the verify medians measured on a loaded CPU in session 4 (ms): 2, 4 and 5 rows pool into their mean
    assert monotone({1: 61.0, 2: 109.0, 4: 101.0, 5: 91.0, 17: 106.0, 65: 191.0}) == pytest.approx(
        {1: 61.0, 2: 301 / 3, 4: 301 / 3, 5: 301 / 3, 17: 106.0, 65: 191.0})
    # a violation that reaches back past an earlier pool: (3, 2) -> 2.5, then 1 pulls all three to 2
    assert monotone({1: 3.0, 2: 2.0, 3: 1.0, 4: 5.0}) == pytest.approx({1: 2.0, 2: 2.0, 3: 2.0, 4: 5.0})
    assert monotone(TABLE.verify) == TABLE.verify  # already nondecreasing: unchanged
    assert monotone({7: 1.0}) == {7: 1.0}


def test_fastest_interleaves_and_keeps_the_fastest_call(monkeypatch):
    """Calls run a, b, a, b, a, b; a slow spell in round 2 (8 s and 9 s) cannot move either estimate, and the
    median of 3 would be 5 s for a."""
    import draftkit.decoding.cost as cost

    # a: 1, 8, 5 s; b: 2, 9, 3 s
    clock = iter([0.0, 1.0, 1.0, 3.0, 3.0, 11.0, 11.0, 20.0, 20.0, 25.0, 25.0, 28.0])
    monkeypatch.setattr(cost.time, "perf_counter", lambda: next(clock))
    calls = []
    best = fastest({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert best == {"a": 1.0, "b": 2.0} and calls == ["a", "b"] * 3


def test_k_auto_calibration_names_the_prompt_and_dtype_of_non_finite_logits(tiny, tiny_head):
    """``--k auto``'s calibration stops on non-finite logits naming the prompt (index and id) and the dtypes, as
    evaluate's decoding does: a head whose lm_head weights overflow the draft logits (finite weights: NaN ones are
    refused before decoding) stops on prompt 0; NaN target logits on prompt 1's token 300 stop on prompt 1."""
    from draftkit.data.prompts import Prompt
    from draftkit.decoding.harness import evaluate_head
    from draftkit.sampling import NonFiniteLogitsError

    target, _ = tiny
    prompts = [Prompt("q-a", ids=[256, 1, 2, 3]), Prompt("q-b", ids=[256, 9, 300, 9])]

    def run(head):
        with pytest.raises(NonFiniteLogitsError) as err:
            evaluate_head(head, target, None, prompts, max_new_tokens=4, eos_token_ids=[257], auto="k",
                          calibration_prompts=2, calibration_tokens=4, prompt_lookup=False, warmup=False)
        return str(err.value)

    def nan_on_token_300(mod, args, out):
        return out * float("nan") if bool((args[0] == 300).any()) else out

    handle = target.model.get_input_embeddings().register_forward_hook(nan_on_token_300)
    try:
        msg = run(tiny_head)
    finally:
        handle.remove()
    assert msg.startswith("prompt 1 (id 'q-b') (--k auto calibration): non-finite target logits: 320 of 320 values "
                          "(float32) are NaN/inf, first at position [0] (vocab id 0) = nan")
    assert msg.endswith("[target dtype float32, head dtype float32]")
    with torch.no_grad():
        tiny_head.lm_head.weight.fill_(3e38)
    assert run(tiny_head) == (
        "prompt 0 (id 'q-a') (--k auto calibration): non-finite draft logits at tree depth 1: 256 of 256 values "
        "(float32) are NaN/inf, first at position [0] (vocab id 0) = nan; check the model's weights and inputs "
        "[target dtype float32, head dtype float32]")


# -- choices pinned where a neighbouring rule gives another answer (issue 56) -------------------------------------

from hypothesis import given, settings
from hypothesis import strategies as st


def test_cover_takes_the_cheapest_padding_not_the_last_cheaper_one():
    """4 rows are the cheapest; 8 rows are also cheaper than 1 but dearer than 4: cover picks 4."""
    t = CostTable(verify={1: 1.0, 4: 0.5, 8: 0.8, 16: 0.6}, first=0, step={1: 0})
    assert t.cover(1) == (4, 0.5)
    assert t.cover(6) == (16, 0.6)  # 8 and 16 both cheaper than the interpolated 6 (0.65): the cheaper 16
    assert t.padding()[1] == 4


def test_choose_needs_a_speedup_strictly_above_one_and_takes_the_fastest():
    from draftkit.decoding.cost import Prediction

    # exact binary fractions: plain 1 token / 0.5 s; chain 1 at tau 1.5 per 0.75 s is exactly plain's speed
    t = CostTable(verify={1: 0.5, 2: 0.5}, first=0.25, step={1: 0.0})
    tie = predict({TreeConfig.chain(1): 1.5}, t)
    assert tie[0].speedup == 1.0 and choose(tie) is None
    assert choose(predict({TreeConfig.chain(1): 1.625}, t)).tree == TreeConfig.chain(1)
    assert choose([Prediction(TreeConfig.chain(2), 2.0, 1.0, 2.0, 1.0)]) is None
    # the fastest is neither first nor last in the input
    preds = predict({TreeConfig.chain(1): 1.4, TreeConfig.chain(2): 2.0, TreeConfig.chain(3): 2.1}, TABLE)
    assert choose(list(reversed(preds))).tree == TreeConfig.chain(2)


def test_candidate_topologies_include_n_equal_to_the_candidate_count():
    # (2, 2): K + (D-1) K^2 = 6 candidates; N = 6 is allowed, 7 is not; N >= depth
    got = candidate_topologies(True, max_depth=2, topks=(2,), nodes=(1, 2, 6, 7))
    assert got[2:] == [TreeConfig(2, 2, 2), TreeConfig(2, 2, 6)]


def _isotonic_reference(values: list[float]) -> list[float]:
    """The min-max formula of isotonic regression: fit_i = max_{j <= i} min_{k >= i} mean(y_j..y_k)."""
    n = len(values)
    return [max(min(sum(values[j:k + 1]) / (k + 1 - j) for k in range(i, n)) for j in range(i + 1))
            for i in range(n)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8))
def test_monotone_equals_the_min_max_formula(values):
    table = {2 * i + 1: float(v) for i, v in enumerate(values)}  # keys need not be consecutive
    assert list(monotone(table).values()) == pytest.approx(_isotonic_reference([float(v) for v in values]))


def test_fastest_times_cuda_work_between_two_synchronisations(monkeypatch):
    """On a CUDA device each timed call sits between two device synchronisations (kernels run asynchronously:
    the clock alone would time their launch); ``precision.synchronize`` waits on CUDA only."""
    import draftkit.decoding.cost as cost
    import draftkit.precision as precision

    calls = []
    monkeypatch.setattr(cost, "synchronize", lambda device: calls.append(("sync", str(device))))
    fastest({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, "cuda:1")
    s = ("sync", "cuda:1")
    assert calls == [s, "a", s, s, "b", s] * 2

    waited = []
    monkeypatch.setattr(precision.torch.cuda, "synchronize", lambda device=None: waited.append(str(device)))
    for device in (None, "cpu", torch.device("cpu"), "cuda:1", torch.device("cuda", 0)):
        precision.synchronize(device)
    assert waited == ["cuda:1", "cuda:0"]
