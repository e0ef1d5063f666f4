"""Host reads in the decoding loops: each op that copies a device value to the host (``.item()``, ``int(t)``,
``bool(t)``, boolean indexing) is a synchronisation on a GPU, so the loops read the host once a round, not once a
draft token, tree candidate or batch row. Counted on the CPU with a dispatch mode
(``draftkit.testing.HostReadCounter``, as ``benchmarks/host_syncs.py`` counts a training step's)."""

import torch

from draftkit.decoding.drafters import Eagle3Drafter
from draftkit.decoding.tree import DraftTree, select_nodes, tree_rejection_accept
from draftkit.generation.torch_engine import generate_batch
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession
from draftkit.testing import HostReadCounter


def _draftkit_reads():
    """draftkit's own host reads (those inside ``transformers``, e.g. its mask helpers' padding checks, are the
    library's and left out)."""
    return HostReadCounter(skip=("transformers",))


def _draft_reads(target, head, k: int, temperature: float = 0.0) -> tuple[int, torch.Tensor]:
    session = TargetSession(target)
    prompt = torch.tensor([256, 1, 2, 3, 4, 5])
    _, aux = session.forward(prompt, logits_to_keep=1)
    drafter = Eagle3Drafter(head)
    drafter.reset(prompt, aux)
    with _draftkit_reads() as reads:
        draft = drafter.propose(torch.cat([prompt, prompt[-1:]]), k, DecodeConfig(8, temperature),
                                torch.Generator().manual_seed(0))
    return sum(reads.counts.values()), draft.ids


def test_a_greedy_chain_round_reads_the_host_once_whatever_k(tiny, tiny_head):
    """One read (the finiteness check of the k stacked logits) for k = 1, 2 and 5: it used to be one a token."""
    target, _ = tiny
    counts = {k: _draft_reads(target, tiny_head, k)[0] for k in (1, 2, 5)}
    assert counts == {1: 1, 2: 1, 5: 1}
    assert _draft_reads(target, tiny_head, 5)[1].shape == (5,)


def test_a_sampled_chain_round_reads_the_host_once_whatever_k(tiny, tiny_head):
    """Sampled drafting (T = 1) too: one read a round for k = 1, 2 and 5 (it checked each position: k reads)."""
    target, _ = tiny
    assert {k: _draft_reads(target, tiny_head, k, 1.0)[0] for k in (1, 2, 5)} == {1: 1, 2: 1, 5: 1}


def test_tree_selection_reads_no_scalar_per_candidate():
    """EAGLE-2's re-ranking of 68 candidates (5 x 4 tree) copies scores and depths once: no per-candidate read
    (it made 136), and the kept set is the plain sort's."""
    g = torch.Generator().manual_seed(0)
    m = 68
    parents = torch.tensor([-1] * 4 + [i // 16 for i in range(m - 4)])  # 4 roots, 16 children each
    depths = torch.tensor([1] * 4 + [2] * (m - 4))
    scores = -torch.rand(m, generator=g) - depths  # a child scores below its parent
    tokens = torch.arange(100, 100 + m)
    with _draftkit_reads() as reads:
        tree = select_nodes(tokens, parents, depths, scores, 16)
    assert sum(reads.counts.values()) == 0
    order = sorted(range(m), key=lambda i: (-float(scores[i]), int(depths[i]), i))[:16]
    assert tree.tokens.tolist() == [100 + i for i in order]


def test_greedy_generate_reads_per_step_not_per_row(tiny):
    """The torch engine's greedy batch: one read a step (the finiteness check of the batch's logits) for 1 row and
    for 4 (it made 2 a row), and each row's tokens equal its own one-row decode."""
    target, _ = tiny
    prompts = [[256, 1, 2, 3], [256, 9, 8], [256, 4, 5, 6, 7], [256, 11]]
    cfg = DecodeConfig(max_new_tokens=3)
    with _draftkit_reads() as one:
        alone = [generate_batch(target.model, [p], cfg, [], 0) for p in prompts]
    with _draftkit_reads() as four:
        batched = generate_batch(target.model, prompts, cfg, [], 0)
    assert batched == [a[0] for a in alone]
    assert [b[1] for b in batched] == ["length"] * 4
    per_step_one = one.counts["_local_scalar_dense"] / (len(prompts) * 3)
    per_step_four = four.counts["_local_scalar_dense"] / 3
    assert per_step_four == per_step_one == 1



def test_greedy_verify_copies_once_and_matches_the_prefix_rule():
    """Greedy verification reads the host once for its check and copies drafts and argmaxes together; it accepts
    the longest prefix equal to the target's argmax and returns the argmax after it (bonus when all match)."""
    from draftkit.decoding.verify import greedy_verify

    logits = torch.zeros(6, 10)
    logits[torch.arange(6), torch.tensor([3, 1, 4, 1, 5, 9])] = 1.0  # target argmax per row
    with _draftkit_reads() as reads:
        got = greedy_verify(torch.tensor([3, 1, 7, 1, 5]), logits)
    assert got == (2, 4) and sum(reads.counts.values()) == 1
    assert greedy_verify(torch.tensor([3, 1, 4, 1, 5]), logits) == (5, 9)
    assert greedy_verify(torch.tensor([2, 1, 4, 1, 5]), logits) == (0, 3)
    assert greedy_verify(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 3)


def test_sampled_tree_acceptance_reads_one_scalar_whatever_the_path():
    """Multi-draft rejection sampling over a 5 x 4 tree of 16 nodes: one scalar read (the next token; the
    structure and every node's test come over as one list copy each) on each of 200 draws, paths of 0 to 5 nodes
    among them; the child-by-child walk read a scalar per child it tried, plus a mass check and the next token."""
    parents = torch.tensor([-1, -1, -1, -1, 0, 0, 0, 1, 4, 4, 7, 8, 8, 10, 11, 13])
    depths = torch.tensor([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5])
    tree = DraftTree(torch.arange(16) * 3, parents, depths, torch.zeros(16))
    probs = torch.full((17, 48), 0.2 / 47)
    probs[torch.arange(17)[1:], (torch.arange(16) * 3)] = 0.0
    for row in range(17):  # most of each row's mass on its first child: long paths
        kids = (parents + 1 == row).nonzero().flatten().tolist()
        if kids:
            probs[row, kids[0] * 3] = 0.8
    probs /= probs.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(0)
    lengths, reads = set(), set()
    for _ in range(200):
        with _draftkit_reads() as counter:
            path, _ = tree_rejection_accept(tree, probs, g)
        reads.add(sum(counter.counts.values()))
        lengths.add(len(path))
    assert reads == {1}
    assert {0, 5} <= lengths
