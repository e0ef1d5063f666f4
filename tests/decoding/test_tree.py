"""Tree speculative decoding: masks and positions against per-path runs, losslessness, chain equivalence."""

import pytest
import torch
from decoding_stubs import (
    TINY_PROMPTS,
    StatelessDrafter,
    chi2_pvalue,
    greedy_references,
    joint_pvalue,
    target_joint,
)

from draftkit.decoding.drafters import Eagle3Drafter
from draftkit.decoding.verify import generate_speculative
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession
from draftkit.decoding.tree import (
    DraftTree,
    Eagle3TreeDrafter,
    TreeConfig,
    generate_tree,
    select_nodes,
    tree_greedy_accept,
    tree_mask,
    tree_rejection_accept,
)

PROMPTS = TINY_PROMPTS
# hand-made 2-level tree: root -> n0, n1; n0 -> n2, n3; n1 -> n4
PARENTS = torch.tensor([-1, -1, 0, 0, 1])
DEPTHS = torch.tensor([1, 1, 2, 2, 2])


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(PARENTS[node])
    return out[::-1]


def test_tree_mask_hand_made():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(PARENTS), expected)
    with pytest.raises(ValueError, match="parents must precede"):
        tree_mask(torch.tensor([1, -1]))


def test_tree_config_parse_and_limits():
    assert TreeConfig.parse("5, 4, 16") == TreeConfig(5, 4, 16)
    assert TreeConfig.chain(3) == TreeConfig(3, 1, 3) and TreeConfig.chain(3).is_chain
    assert TreeConfig(3, 2, 10).max_nodes == 2 + 2 * 4
    with pytest.raises(ValueError, match="exceeds the 10 candidates"):
        TreeConfig(3, 2, 11)
    with pytest.raises(ValueError, match="--tree takes depth,topk,N"):
        TreeConfig.parse("5x4")


def test_select_nodes_keeps_a_tree_in_rank_order():
    # candidates: 0,1 at depth 1; 2,3 children of 0; 4 child of 1 whose score ties its parent (q = 1)
    scores = torch.tensor([-0.1, -1.0, -0.5, -3.0, -1.0])
    tree = select_nodes(torch.tensor([10, 11, 12, 13, 14]), PARENTS, DEPTHS, scores, 4)
    assert tree.tokens.tolist() == [10, 12, 11, 14]  # rank: score desc, the shallower node first on a tie
    assert tree.parents.tolist() == [-1, 0, -1, 2]
    assert tree.depths.tolist() == [1, 2, 1, 2]


def test_target_tree_forward_equals_each_path(tiny):
    """One tree-masked forward over the cache gives, at every node, the logits and aux states of running
    the node's root path on its own; compacting to a path equals a cache that ran that path."""
    target, _ = tiny
    prompt = torch.tensor(PROMPTS[1])
    tokens = torch.tensor([40, 41, 42, 43, 44])  # n0..n4
    root = torch.tensor([7])
    session = TargetSession(target)
    session.forward(prompt)
    L = prompt.shape[0]
    mask = torch.cat([torch.ones(6, L, dtype=torch.bool), tree_mask(PARENTS)], 1)
    pos = L + torch.cat([torch.zeros(1, dtype=torch.long), DEPTHS])
    logits, aux = session.forward(torch.cat([root, tokens]), position_ids=pos, attn_mask=mask)  # (6, V), (6, A*H_t)
    ref = TargetSession(target)
    for node in range(5):
        path = torch.cat([root, tokens[_path(node)]])
        ref.reset()
        ref.forward(prompt)
        z, a = ref.forward(path)
        torch.testing.assert_close(logits[node + 1], z[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(aux[node + 1], a[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], z[0], atol=1e-5, rtol=1e-5)
    # keep the prefix, the root and the path n1 -> n4, then continue: equals a plain run of that path
    session.keep(torch.cat([torch.arange(L), L + torch.tensor([0, 2, 5])]))
    assert session.length == L + 3
    z_kept, _ = session.forward(torch.tensor([9]))
    ref.reset()
    ref.forward(prompt)
    z_ref, _ = ref.forward(torch.tensor([7, 41, 44, 9]))
    torch.testing.assert_close(z_kept[0], z_ref[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", [True, False])
def test_padded_forward_equals_unpadded(tiny, tree):
    """A forward padded with dummy rows (``pad_rows``, the cost model's cheapest cover) returns the unpadded
    logits and aux states and leaves the same cache: the next forward agrees too."""
    target, _ = tiny
    prompt = torch.tensor(PROMPTS[1])
    L = prompt.shape[0]
    ids = torch.tensor([7, 40, 41, 42, 43, 44])
    kwargs = {}
    if tree:
        kwargs = {"attn_mask": torch.cat([torch.ones(6, L, dtype=torch.bool), tree_mask(PARENTS)], 1),
                  "position_ids": L + torch.cat([torch.zeros(1, dtype=torch.long), DEPTHS])}
    out = []
    for pad_rows in ({}, {6: 9}):
        session = TargetSession(target)
        session.pad_rows = pad_rows
        session.forward(prompt)
        logits, aux = session.forward(ids, **kwargs)
        assert logits.shape == (6, target.config.vocab_size) and session.length == L + 6
        assert all(layer.keys.shape[-2] == L + 6 for layer in session.cache.layers)
        session.keep(torch.cat([torch.arange(L), L + torch.tensor([0, 2, 5])]) if tree else torch.arange(L + 3))
        nxt, _ = session.forward(torch.tensor([9]))
        out.append((logits, aux, nxt))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(4, 3, 10), (3, 1, 3)])
def test_greedy_decoding_with_padded_verify_equals_plain(tiny, tiny_head, shape):
    session, cfg, refs = greedy_references(tiny[0], 30)
    session.pad_rows = {n: 16 for n in range(1, 16)}  # every forward, plain ones too, runs 16 rows
    for ids, plain in refs:
        tree = generate_tree(session, Eagle3TreeDrafter(tiny_head), ids, TreeConfig(*shape), cfg)
        chain = generate_speculative(session, Eagle3Drafter(tiny_head), ids, shape[0], cfg)
        assert tree.tokens == chain.tokens == plain


def test_draft_tree_scores_equal_a_chain_along_each_path(tiny, tiny_head):
    """Every node's cumulative score equals the draft log-probabilities of a plain chain run along its
    path (checks the draft tree mask and positions), and the draft cache ends where it began."""
    target, _ = tiny
    prompt = torch.tensor(PROMPTS[0])
    session = TargetSession(target)
    _, aux = session.forward(prompt)
    seq = torch.cat([prompt, torch.tensor([65])])
    drafter = Eagle3TreeDrafter(tiny_head)
    drafter.reset(prompt, aux)
    tree = drafter.propose_tree(seq, TreeConfig(3, 2, 10))
    assert drafter.cache.length == prompt.shape[0]
    assert tree.tokens.shape == (10,) and tree.depths.max() == 3
    t2d_rank = torch.cumsum(tiny_head.t2d.long(), 0) - 1  # target id -> draft id
    kids = tree.children()
    for node in range(10):
        path = [node]
        while int(tree.parents[path[0]]) >= 0:
            path.insert(0, int(tree.parents[path[0]]))
        chain = Eagle3Drafter(tiny_head)
        chain.reset(prompt, aux)
        z, h = chain.feed_pending(seq)
        score = 0.0
        for j, n in enumerate(path):
            score += float(z.detach().float().log_softmax(-1)[t2d_rank[tree.tokens[n]]])
            z, h = chain._step(tree.tokens[n].view(1), h, prompt.shape[0] + j)
        assert score == pytest.approx(float(tree.scores[node]), abs=1e-4)
        # siblings are distinct tokens
        sib = kids[int(tree.parents[node]) + 1]
        assert len({int(tree.tokens[s]) for s in sib}) == len(sib)


@pytest.mark.parametrize("shape", [(5, 4, 32), (4, 3, 10), (3, 2, 3)])
def test_greedy_tree_equals_plain(tiny, tiny_head, shape):
    session, cfg, refs = greedy_references(tiny[0], 40)
    for ids, plain in refs:
        tree = generate_tree(session, Eagle3TreeDrafter(tiny_head), ids, TreeConfig(*shape), cfg)
        assert tree.tokens == plain
        assert tree.stats.rounds == tree.target_forwards
        assert all(d == shape[2] for d in tree.stats.drafted)
        assert sum(a + 1 for a in tree.stats.accepted) == len(plain) - 1


def test_tree_with_topk_1_is_the_chain(tiny, tiny_head):
    session, cfg, refs = greedy_references(tiny[0], 40)
    for ids, plain in refs:
        chain = generate_speculative(session, Eagle3Drafter(tiny_head), ids, 4, cfg)
        tree = generate_tree(session, Eagle3TreeDrafter(tiny_head), ids, TreeConfig.chain(4), cfg)
        assert tree.tokens == chain.tokens == plain
        assert tree.stats.accepted == chain.stats.accepted
        assert tree.stats.drafted == chain.stats.drafted
        assert tree.weight_bytes == chain.weight_bytes


# -- sampling -----------------------------------------------------------------------------------------------
def test_tree_rejection_sampling_reproduces_target_stub():
    """Stub tree over V = 6: the first emitted token follows p_root, and after an accepted child c the
    second follows p_c (joint chi-square)."""
    torch.manual_seed(0)
    V = 6
    probs = torch.softmax(torch.randn(6, V), -1)  # rows: root, n0..n4
    probs[0, 5] = 0
    probs[0] /= probs[0].sum()
    tree = DraftTree(torch.tensor([2, 5, 0, 1, 3]), PARENTS, DEPTHS, torch.zeros(5))  # n1 = token 5 has p = 0
    g = torch.Generator().manual_seed(1)
    n = 6000
    counts = torch.zeros(V, V + 1)  # (first, second or "none")
    for _ in range(n):
        path, nxt = tree_rejection_accept(tree, probs, g)
        emitted = tree.tokens[path].tolist() + [nxt]
        counts[emitted[0], emitted[1] if len(emitted) > 1 else V] += 1
    expected = torch.zeros(V, V + 1)
    for x in range(V):
        child = {2: 0, 5: 1}.get(x)  # root children tokens -> node
        if child is None:
            expected[x, V] = probs[0, x]
        else:
            expected[x, :V] = probs[0, x] * probs[child + 1]
    possible = expected.flatten() > 0
    assert counts.flatten()[~possible].sum() == 0  # token 5 (p = 0) and impossible pairs never occur
    assert chi2_pvalue(counts.flatten()[possible], n * expected.flatten()[possible]) > 1e-3


def _sequential_rejection(tree, probs, u, g):
    """The plain rule, child by child: child c meets uniform u[c]; p(c) zeroed when it fails."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    path, row = [], 0
    while True:
        p = probs[row].clone()
        for c in [c for c in range(len(tokens)) if parents[c] + 1 == row]:
            if u[c] * p.sum() < p[tokens[c]]:
                path.append(c)
                row = c + 1
                break
            p[tokens[c]] = 0
        else:
            return path, int(torch.multinomial(p if p.sum() > 0 else probs[row], 1, generator=g))


def test_tree_rejection_equals_the_child_by_child_rule_with_the_same_uniforms():
    """Every node tested at once on the device gives, over 300 seeds, exactly the path and next token of the
    child-by-child rule fed the same per-node uniforms and the same generator after them; paths of every length
    0-2 occur."""
    V = 6
    tree = DraftTree(torch.tensor([2, 5, 0, 1, 3]), PARENTS, DEPTHS, torch.zeros(5))
    lengths = set()
    for seed in range(300):
        probs = torch.softmax(torch.randn(6, V, generator=torch.Generator().manual_seed(1000 + seed)) * 2, -1)
        g, ref_g = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        u = torch.rand(5, generator=ref_g)
        got = tree_rejection_accept(tree, probs, g)
        assert got == _sequential_rejection(tree, probs, u, ref_g)
        lengths.add(len(got[0]))
    assert lengths == {0, 1, 2}


class OracleTreeDrafter(StatelessDrafter):
    """Stub tree drafter on the real target: root children [2nd best, an off-support token, best],
    and the best child gets children [2nd best, best] of its own (all from the target's raw logits)."""

    def __init__(self, target) -> None:
        self.target = target

    def propose_tree(self, tokens, tree) -> DraftTree:
        top = self.target(tokens[None]).logits[0, -1].topk(3).indices  # (3,)
        off = top[2]  # outside the top-2 warped support
        best = top[0]
        below = self.target(torch.cat([tokens, best.view(1)])[None]).logits[0, -1].topk(2).indices
        ids = torch.stack([top[1], off, best, below[1], below[0]])
        parents = torch.tensor([-1, -1, -1, 2, 2])
        return DraftTree(ids, parents, torch.tensor([1, 1, 1, 2, 2]), torch.zeros(5))


def test_tree_sampling_distribution_tiny_target(tiny):
    """Tree rejection sampling with the real cached target and compaction gives the target's (top-k
    warped) joint distribution of the first three new tokens (two of them from one tree round)."""
    target, _ = tiny
    cfg = DecodeConfig(max_new_tokens=3, temperature=1.0, top_k=2)
    session, drafter = TargetSession(target), OracleTreeDrafter(target)
    g = torch.Generator().manual_seed(0)
    prompt = torch.tensor(PROMPTS[0])

    def run():
        return generate_tree(session, drafter, prompt, TreeConfig(2, 3, 5), cfg, g).tokens

    assert joint_pvalue(run, 500, target_joint(target, PROMPTS[0], 3, 2)) > 1e-3


def test_tree_greedy_accept_walks_the_matching_path():
    tree = DraftTree(torch.tensor([2, 5, 0, 1, 3]), PARENTS, DEPTHS, torch.zeros(5))
    # root argmax 2 -> n0; n0's argmax 1 -> n3 (row 4); n3's argmax 7 is not a child: bonus 7
    best = torch.tensor([2, 1, 9, 9, 7, 9])
    assert tree_greedy_accept(tree, best) == ([0, 3], 7)
    assert tree_greedy_accept(tree, torch.tensor([4, 0, 0, 0, 0, 0])) == ([], 4)


def test_tree_config_allows_n_equal_to_depth_times_topk_candidates():
    """K + (D-1) K^2 candidates: (3, 2, 10) is the whole candidate set, (3, 2, 11) one too many; the chain
    (D, 1, D) is exactly its own candidate count."""
    assert TreeConfig(3, 2, 1).max_nodes == 10
    assert TreeConfig(3, 2, 10).num_nodes == 10
    with pytest.raises(ValueError, match="N=11 exceeds the 10 candidates"):
        TreeConfig(3, 2, 11)
    assert TreeConfig(4, 1, 4).is_chain and TreeConfig.chain(4) == TreeConfig(4, 1, 4)
    with pytest.raises(ValueError, match="N=5"):
        TreeConfig(4, 1, 5)
    assert not TreeConfig(4, 1, 3).is_chain


def test_select_nodes_breaks_score_ties_by_depth_then_index():
    from draftkit.decoding.tree import select_nodes

    tokens = torch.tensor([10, 11, 12, 13, 14])
    parents = torch.tensor([-1, -1, 0, 0, 1])
    depths = torch.tensor([1, 1, 2, 2, 2])
    scores = torch.tensor([-1.0, -1.0, -1.0, -2.0, -1.0])  # ties at -1 across depths and indices
    kept = select_nodes(tokens, parents, depths, scores, 3)
    assert kept.tokens.tolist() == [10, 11, 12] and kept.parents.tolist() == [-1, -1, 0]
    kept = select_nodes(tokens, parents, depths, scores, 4)
    assert kept.tokens.tolist() == [10, 11, 12, 14] and kept.parents.tolist() == [-1, -1, 0, 1]
