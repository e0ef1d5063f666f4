"""Hybrid drafting (head + prompt lookup in one verify): the joined tree and its mask, losslessness, the head
alone where nothing repeats, the head's features after rounds it sat out, drafter shares, and the cost model's
pricing of rounds that differ."""

import pytest
import torch
from decoding_stubs import TINY_PROMPTS

from draftkit.decoding.cost import CostTable, Played, choose, predict, round_seconds
from draftkit.decoding.drafters import Eagle3Drafter, PromptLookupDrafter
from draftkit.decoding.harness import Topology, evaluate_head
from draftkit.decoding.metrics import HEAD, LOOKUP
from draftkit.decoding.tree import (
    HYBRID_ENGINES,
    DraftTree,
    Eagle3TreeDrafter,
    TreeConfig,
    add_branch,
    generate_tree,
    tree_mask,
)
from draftkit.decoding.verify import generate_plain, generate_speculative
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession

# hand-made head tree: root -> n0 (40), n1 (41); n0 -> n2 (42), n3 (43); n1 -> n4 (44)
HEAD_TREE = DraftTree(torch.tensor([40, 41, 42, 43, 44]), torch.tensor([-1, -1, 0, 0, 1]),
                      torch.tensor([1, 1, 2, 2, 2]), torch.tensor([-0.1, -1.0, -0.5, -3.0, -1.2]))


def _root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_add_branch_merges_the_shared_prefix_and_appends_the_rest():
    joined = add_branch(HEAD_TREE, torch.tensor([40, 43, 50, 51]))  # shares n0 -> n3, then 50 -> 51 below n3
    assert joined.tokens.tolist() == [40, 41, 42, 43, 44, 50, 51]
    assert joined.parents.tolist() == [-1, -1, 0, 0, 1, 3, 5]
    assert joined.depths.tolist() == [1, 1, 2, 2, 2, 3, 4]
    assert joined.sources.tolist() == [HEAD | LOOKUP, HEAD, HEAD, HEAD | LOOKUP, HEAD, LOOKUP, LOOKUP]
    assert joined.scores[:5].tolist() == HEAD_TREE.scores.tolist() and joined.scores[5:].isneginf().all()
    apart = add_branch(HEAD_TREE, torch.tensor([45, 40]))  # diverges at the root: a new root child, 40 below it
    assert apart.parents.tolist()[5:] == [-1, 5] and apart.depths.tolist()[5:] == [1, 2]
    inside = add_branch(HEAD_TREE, torch.tensor([41, 44]))  # wholly inside the head's tree: nothing new
    assert inside.tokens.tolist() == HEAD_TREE.tokens.tolist()
    assert inside.sources.tolist() == [HEAD, HEAD | LOOKUP, HEAD, HEAD, HEAD | LOOKUP]
    empty = torch.zeros(0, dtype=torch.long)
    alone = add_branch(DraftTree(empty, empty, empty, empty.float()), torch.tensor([7, 8, 9]))  # switch mode
    assert alone.parents.tolist() == [-1, 0, 1] and alone.depths.tolist() == [1, 2, 3]
    assert alone.sources.tolist() == [LOOKUP] * 3
    for tree in (joined, apart, inside, alone):  # every sibling set keeps distinct tokens
        kids = tree.children()
        assert all(len({int(tree.tokens[c]) for c in k}) == len(k) for k in kids)


def test_joined_tree_mask_equals_a_dense_reference_and_the_target_per_path(tiny):
    """The joined tree's mask is ancestor-or-self of the explicit root paths (a dense reference), and one
    tree-masked target forward gives each node the logits and aux states of running its root path alone."""
    joined = add_branch(HEAD_TREE, torch.tensor([40, 43, 50, 51]))
    parents = joined.parents.tolist()
    n = len(parents)
    dense = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    dense[:, 0] = True
    dense[0, 0] = True
    for node in range(n):
        for a in _root_path(parents, node):
            dense[node + 1, a + 1] = True
    assert torch.equal(tree_mask(joined.parents), dense)

    target, _ = tiny
    prompt = torch.tensor(TINY_PROMPTS[1])
    L = prompt.shape[0]
    root = torch.tensor([7])
    session = TargetSession(target)
    session.forward(prompt)
    mask = torch.cat([torch.ones(n + 1, L, dtype=torch.bool), dense], 1)
    pos = L + torch.cat([torch.zeros(1, dtype=torch.long), joined.depths])
    logits, aux = session.forward(torch.cat([root, joined.tokens]), position_ids=pos, attn_mask=mask)
    ref = TargetSession(target)
    for node in range(n):
        ref.reset()
        ref.forward(prompt)
        z, a = ref.forward(torch.cat([root, joined.tokens[_root_path(parents, node)]]))
        torch.testing.assert_close(logits[node + 1], z[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(aux[node + 1], a[-1], atol=1e-5, rtol=1e-5)


def _repeating_prompt(target) -> tuple[torch.Tensor, list[int]]:
    """A prompt whose answer repeats one of its spans: a tiny prompt followed by the first 34 tokens of its own
    greedy answer (which falls into a cycle), so greedy decoding goes on repeating what the prompt holds."""
    session = TargetSession(target)
    start = torch.tensor(TINY_PROMPTS[0])
    answer = generate_plain(session, start, DecodeConfig(max_new_tokens=60)).tokens
    prompt = torch.cat([start, torch.tensor(answer[:34])])
    return prompt, generate_plain(session, prompt, DecodeConfig(max_new_tokens=24)).tokens


@pytest.mark.parametrize("shape", [TreeConfig.chain(2, 6), TreeConfig(3, 2, 5, 6), TreeConfig.chain(2, 6, "switch")])
def test_repeated_span_takes_the_lookup_branch_and_equals_plain(tiny, tiny_head, shape):
    target, _ = tiny
    prompt, plain = _repeating_prompt(target)
    assert PromptLookupDrafter().continuation(torch.cat([prompt, torch.tensor(plain[:1])]), 6).numel()  # it repeats
    session = TargetSession(target)
    cfg = DecodeConfig(max_new_tokens=24)
    hybrid = generate_tree(session, Eagle3TreeDrafter(tiny_head), prompt, shape, cfg)
    alone = generate_tree(session, Eagle3TreeDrafter(tiny_head), prompt, shape.head_only, cfg)
    assert hybrid.tokens == alone.tokens == plain
    share = hybrid.stats.share()
    taken = share["round_counts"]["lookup" if shape.lookup_mode == "switch" else "both"]
    assert taken > 0 and share["accepted_counts"]["lookup"] > 0
    assert hybrid.stats.rounds < alone.stats.rounds and hybrid.stats.tau() > alone.stats.tau()
    assert sum(share["round_counts"].values()) == hybrid.stats.rounds
    assert sum(share["accepted_counts"].values()) == sum(hybrid.stats.accepted)
    if shape.lookup_mode == "switch":  # a switched round verifies the lookup chain alone, and reads no head weights
        assert share["round_counts"]["both"] == 0
        assert hybrid.weight_bytes < alone.weight_bytes


NO_REPEAT = [230, 40, 308, 81, 79, 196, 41, 170, 122]  # its 12-token greedy answer repeats no 2 tokens in a row


@pytest.mark.parametrize("mode", ["lookup", "switch"])
def test_no_repeat_leaves_the_head_alone_as_today(tiny, tiny_head, mode):
    """Where nothing repeats, a hybrid plays exactly the head's chain (as ``generate_speculative``) and tree:
    same tokens, same per-round accepted and verified counts, same bytes; every round is the head's."""
    target, _ = tiny
    prompt = torch.tensor(NO_REPEAT)
    session = TargetSession(target)
    cfg = DecodeConfig(max_new_tokens=12)
    plain = generate_plain(session, prompt, cfg).tokens
    seq = torch.cat([prompt, torch.tensor(plain)])
    assert all(not PromptLookupDrafter().continuation(seq[:i], 8).numel() for i in range(len(NO_REPEAT), len(seq)))
    chain = generate_speculative(session, Eagle3Drafter(tiny_head), prompt, 3, cfg)
    for today, shape in ((chain, TreeConfig.chain(3, 8, mode)),
                         (generate_tree(session, Eagle3TreeDrafter(tiny_head), prompt, TreeConfig(3, 2, 5), cfg),
                          TreeConfig(3, 2, 5, 8, mode))):
        hybrid = generate_tree(session, Eagle3TreeDrafter(tiny_head), prompt, shape, cfg)
        assert hybrid.tokens == today.tokens == plain
        assert hybrid.stats.accepted == today.stats.accepted and hybrid.stats.drafted == today.stats.drafted
        assert hybrid.weight_bytes == today.weight_bytes
        assert hybrid.stats.share()["round_counts"] == {"head": hybrid.stats.rounds, "lookup": 0, "both": 0}


def test_head_features_after_rounds_it_sat_out(tiny, tiny_head):
    """Rows committed while the head did not draft wait with the earlier ones: feeding them at once gives the
    draft of feeding them round by round (the target's aux states of every accepted position, in order)."""
    target, _ = tiny
    prompt = torch.tensor(TINY_PROMPTS[1])
    seq = torch.cat([prompt, torch.tensor([5, 6, 7, 8, 9])])
    _, aux = TargetSession(target).forward(seq[:-1])  # (n + 4, A*H_t)
    n = prompt.shape[0]
    stepwise, joined = Eagle3Drafter(tiny_head), Eagle3Drafter(tiny_head)
    for d in (stepwise, joined):
        d.reset(prompt, aux[:n])
    stepwise.feed_pending(seq[:n + 1])
    stepwise.commit(aux[n:n + 2])  # a round that accepted one draft, the head drafting it
    stepwise.feed_pending(seq[:n + 3])
    stepwise.commit(aux[n + 2:n + 4])
    z_step, _ = stepwise.feed_pending(seq)
    joined.commit(aux[n:n + 2])  # the head sat out the first rounds (a switch round drafted by prompt lookup)
    joined.commit(aux[n + 2:n + 4])
    assert joined.pending.shape[0] == n + 4
    z_joined, _ = joined.feed_pending(seq)
    torch.testing.assert_close(z_joined, z_step, atol=1e-5, rtol=1e-5)
    assert joined.cache.length == stepwise.cache.length == n + 4


MS = 1e-3
TABLE = CostTable(verify={1: 10 * MS, 2: 11 * MS, 4: 13 * MS, 8: 15 * MS, 16: 19 * MS}, first=2 * MS,
                  step={1: 1 * MS, 2: 1.2 * MS, 4: 1.5 * MS})


def test_cost_model_prices_each_round_and_never_picks_slower_than_plain():
    """Plain costs 10 ms a token. Per token: chain k=2 (tau 1.8, 15 ms a round) 8.33 ms; tree 3,2,8 (tau 1.9,
    19.9 ms) 10.47 ms, slower than plain; chain k=3 (tau 1.75, 17 ms) 9.71 ms, faster than plain but not the
    fastest, and the last faster one in the list; the lookup hybrid of chain k=2 accepts more (tau 2.0) but its
    branch adds 10 verify rows a round: 2 + 1 + 17.5 ms = 20.5 ms a round, 10.25 ms a token, slower than plain,
    though priced at its head's shape (15 ms a round) it would look fastest of all (7.5 ms). Its switch twin skips
    the head in the rounds prompt lookup drafts (4 nodes: 13.5 ms) and pays 15 ms in the others."""
    hybrid = TreeConfig.chain(2, 8)
    switch = TreeConfig.chain(2, 8, "switch")
    played = {
        TreeConfig.chain(2): [Played(1, 2, True), Played(0, 2, True), Played(1, 2, True), Played(1, 2, True),
                              Played(1, 2, True)],
        TreeConfig(3, 2, 8): [Played(1, 8, True)] * 9 + [Played(0, 8, True)],
        TreeConfig.chain(3): [Played(1, 3, True), Played(1, 3, True), Played(0, 3, True), Played(1, 3, True)],
        hybrid: [Played(1, 12, True)] * 4,
        switch: [Played(3, 4, False), Played(0, 2, True)],
    }
    taus = {t: sum(p.accepted + 1 for p in rounds) / len(rounds) for t, rounds in played.items()}
    assert taus == {TreeConfig.chain(2): 1.8, TreeConfig(3, 2, 8): 1.9, TreeConfig.chain(3): 1.75, hybrid: 2.0,
                    switch: 2.5}
    seconds = {t: round_seconds(t, rounds, TABLE) for t, rounds in played.items()}
    assert seconds[hybrid] == pytest.approx(20.5 * MS)
    assert seconds[switch] == pytest.approx((13.5 + 15) / 2 * MS)
    preds = predict(taus, TABLE, seconds)
    per_token = {p.tree: 1 / p.tokens_per_s for p in preds}
    assert per_token[TreeConfig.chain(2)] == pytest.approx(15 / 1.8 * MS)
    assert per_token[hybrid] == pytest.approx(10.25 * MS) and per_token[TreeConfig(3, 2, 8)] > 10 * MS
    assert choose(preds).tree == switch  # 5.7 ms a token: the cheapest of all
    without_switch = [p for p in preds if p.tree != switch]
    best = choose(without_switch)
    assert best.tree == TreeConfig.chain(2) and best.speedup == pytest.approx(10 / (15 / 1.8))
    assert choose(predict({hybrid: 2.0}, TABLE))  # priced at its head's shape the hybrid would have been chosen
    assert choose(predict({hybrid: 2.0}, TABLE, {hybrid: seconds[hybrid]})) is None  # its real rounds: plain wins
    for p in preds:  # what was picked or not, its price is its rounds' measured cost per token
        assert 1 / p.tokens_per_s == pytest.approx(seconds[p.tree] / taus[p.tree])
    assert all(1 / p.tokens_per_s <= 10 * MS for p in preds if choose([p]) is not None)


def test_topology_parse_and_report_of_hybrids():
    assert Topology.parse("k=2+lookup=8") == Topology(8, TreeConfig.chain(2, 8))
    assert Topology.parse("tree=4,2,7+switch=4") == Topology(4, TreeConfig(4, 2, 7, 4, "switch"))
    assert Topology.parse("k=2+lookup=8").name == "chain k=2 + lookup=8"
    assert Topology.parse("tree=4,2,7+switch=4").name == "tree depth=4 topk=2 N=7 + switch=4"
    assert TreeConfig.parse("5,4,16+lookup=3") == TreeConfig(5, 4, 16, 3)
    assert str(TreeConfig(5, 4, 16, 3, "switch")) == "5,4,16+switch=3" and str(TreeConfig(5, 4, 16)) == "5,4,16"
    assert Topology.parse("k=2+lookup=8").report()["engines"] == HYBRID_ENGINES
    assert Topology.parse("k=2").report() is None
    for bad in ("k=2+lookup=0", "k=2+ngram=3", "tree=4,2,7+lookup"):
        with pytest.raises(ValueError, match="--sweep"):
            Topology.parse(bad)


def test_evaluate_reports_each_drafters_share(tiny, tiny_head):
    """evaluate's sweep entry of a hybrid: greedy_equal, its drafter share (rounds and accepted tokens adding
    up), the hybrid block naming the engines; the head-only chain's share is all head."""
    target, _ = tiny
    prompt, _ = _repeating_prompt(target)
    report = evaluate_head(tiny_head, target, None, [prompt, torch.tensor(TINY_PROMPTS[1])], k=2, max_new_tokens=16,
                           eos_token_ids=[257], warmup=False, sweep=[Topology.parse("k=2+lookup=6")],
                           prompt_lookup_k=4)
    chain, hybrid = report["sweep"]
    assert chain["drafter_share"] is None and chain["hybrid"] is None
    assert hybrid["greedy_equal"] == 2 and hybrid["k"] == 6
    assert hybrid["tree"] == {"depth": 2, "topk": 1, "num_nodes": 2, "lookup": 6, "lookup_mode": "lookup"}
    share = hybrid["drafter_share"]
    assert sum(share["round_counts"].values()) == hybrid["rounds"] and share["round_counts"]["both"] > 0
    assert sum(share["rounds"].values()) == pytest.approx(1.0)
    assert sum(share["accepted_tokens"].values()) == pytest.approx(1.0)
    assert hybrid["hybrid"]["engines"]["llama.cpp"].startswith("runs the switch mode: --spec-type draft-eagle3,ngram-mod")
    assert hybrid["hybrid"]["lookup_ngram"] == "suffix of 3, then 2 tokens"
    assert report["setup"]["prompt_lookup_k"] == 4 and "(" in report["setup"]["cpu"]


def test_export_of_a_hybrid_report_gives_the_head_shape_and_names_the_engines(tmp_path):
    """A report whose cost-model pick is a hybrid exports its head's chain; the sidecar's speculation record
    carries the hybrid block (which engines run the lookup branch too); a choice that disagrees is refused."""
    import json

    from draftkit.export.speculation import Speculation

    hybrid = Topology.parse("k=2+switch=8").report()
    report = {"num_prompts": 20, "k": 8, "temperature": 0.0, "tau": 1.9, "speedup": 1.3, "hybrid": hybrid,
              "tree": {"depth": 2, "topk": 1, "num_nodes": 2, "lookup": 8, "lookup_mode": "switch"},
              "auto": {"choice": "chain k=2+switch=8", "predicted_speedup": 1.35, "measured_speedup": 1.3},
              "setup": {"device": "cpu"}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    shape = Speculation.from_report(path)
    assert shape.tree == TreeConfig.chain(2) and shape.k == 2
    record = shape.record()
    assert record["hybrid"] == hybrid and record["topology"] == "chain"
    assert record["hybrid"]["engines"]["vllm"].startswith("not yet")
    path.write_text(json.dumps({**report, "auto": {**report["auto"], "choice": "chain k=2"}}))
    with pytest.raises(ValueError, match="disagrees"):
        Speculation.from_report(path)
