"""Tree speculative decoding: EAGLE-2/3 draft trees verified in one target forward.

A round (EAGLE-2, arXiv 2406.16858, ``eagle/model/cnets.py::topK_genrate``; SGLang
``speculative/eagle_utils.py``):

1. Draft. The head feeds its pending step-0 rows (as in chain drafting) and the top-k draft tokens of
   the last row become the depth-1 nodes. For depth d = 1..D-1, the frontier (the best ``topk`` nodes of
   depth d by score; all of them at d = 1) is fed to the head in one pass, each node over the draft cache,
   its ancestors and itself (a tree attention mask, position L + d - 1, feature = its parent's pre-norm
   output); each frontier node proposes its top-k children. A node's score is its cumulative draft
   log-probability (temperature 1). Of all candidates (topk at depth 1, topk^2 at every later depth) the
   best N by score are kept; a parent scores at least as high as its children, so ranking by (score
   desc, depth asc) keeps the kept set a tree.
2. Verify. The target runs [x_L, n_1..n_N] in one forward over its KV cache, node i at position
   L + depth(i), attending to the cache, the root, its ancestors and itself.
3. Accept. T = 0: walk from the root to the child whose token is the target's argmax, while one exists
   (the longest path that matches greedy decoding); the argmax after the last accepted node is the
   correction or bonus token. T > 0: multi-draft rejection sampling with deterministic drafts (SpecInfer
   arXiv 2305.09781 §4.2 with one-hot draft distributions; EAGLE ``evaluate_posterior``; SGLang
   ``tree_speculative_sampling_target_only``): at a node with target distribution p, try its children in
   score order, accepting child c with probability p(c) / sum(p) and otherwise setting p(c) = 0; when no
   child is accepted, sample the next token from what is left of p. Because the children are distinct
   tokens fixed before the target is read, every emitted token is distributed exactly as p.
4. Compact. The target cache keeps the prefix, the root and the accepted path (rows gathered, so the
   accepted nodes' positions are L+1..L+a as in a chain); the draft cache drops its tree rows, and the
   accepted positions' aux states become its next step-0 rows (as in a chain).

At T = 0 a chain of k drafts is the tree (depth k, top-k 1, N k): same drafts, same verify rows, same result. At
T > 0 they differ (both lossless): the chain samples its drafts from the head and accepts one with probability
min(1, p/q) (speculative sampling, ``verify.rejection_verify``; vLLM's rejection sampler), while the tree's drafts
are the head's top tokens, fixed before the target is read, each accepted with probability p(c) (the target-only
rule above), which accepts less where the target is flat; ``--k/--tree auto`` therefore decode their shortlist at
the run's temperature before they pick (``decoding.cost``).

Hybrid rounds (``TreeConfig.lookup``): the prompt-lookup continuation of the sequence (``PromptLookupDrafter``,
up to L tokens) joins the head's draft. ``lookup`` mode: it is one more root path of the tree (:func:`add_branch`;
tokens the head also proposed are merged into its nodes), verified in the same forward under the same tree mask,
so a round accepts the longer of the two matches. ``switch`` mode: when prompt lookup has a continuation it is the
round's draft on its own (a chain; the head does not run), else the head's tree is. Either way the head's next
step-0 rows are the target's aux states at the accepted positions, whichever drafter proposed them
(``Eagle3Drafter.commit`` keeps the rows of a round the head sat out). Which drafter proposed each node is kept
(``DraftTree.sources``) for the report's share of rounds and accepted tokens per drafter.

Shapes: L tokens before the round's root, D depth, K top-k, N kept nodes, V target vocab, V_d draft
vocab, H draft hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draftkit.sampling import check_finite_logits, probs_from_logits, sample_from_probs
from draftkit.decoding.drafters import Eagle3Drafter, PromptLookupDrafter
from draftkit.decoding.metrics import HEAD, LOOKUP
from draftkit.decoding.verify import GenerationResult, Round, Sync, speculative_loop
from draftkit.precision import synchronize
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession

__all__ = [
    "DraftTree",
    "Eagle3TreeDrafter",
    "HYBRID_ENGINES",
    "LOOKUP_MODES",
    "TreeConfig",
    "add_branch",
    "generate_tree",
    "parse_lookup",
    "select_nodes",
    "tree_greedy_accept",
    "tree_mask",
    "tree_rejection_accept",
]


LOOKUP_MODES = ("lookup", "switch")
"""How a prompt-lookup continuation joins a round (``TreeConfig.lookup_mode``): ``lookup`` = as one more branch
of the head's tree, both verified in one forward; ``switch`` = instead of the head's draft, in the rounds where
prompt lookup has one (the head drafts the others)."""


HYBRID_ENGINES = {
    "llama.cpp": "runs the switch mode: --spec-type draft-eagle3,ngram-mod (a comma-separated chain of spec types; "
                 "the n-gram draft is used when it has a match; --spec-ngram-mod-n-match/-n-min/-n-max set the "
                 "n-gram); the lookup mode (both drafts in one verify) has no llama.cpp form",
    "vllm": "not yet: one speculative method per server (eagle3 or ngram); an open pull request combines them",
    "sglang": "not yet: one speculative algorithm per server (EAGLE3 or NGRAM)",
    "trtllm": "not yet: one speculative decoding mode per engine",
}
"""Which serving engines can run a head + prompt-lookup hybrid (as of this draftkit version); evaluate reports and
export sidecars carry it."""


def parse_lookup(text: str, option: str) -> tuple[int, str]:
    """``"lookup=L"`` or ``"switch=L"`` (a hybrid suffix, after ``+``) -> (L, mode).

    Raises:
        ValueError: naming ``option`` on anything else (L must be >= 1).
    """
    mode, _, value = text.partition("=")
    if mode in LOOKUP_MODES and value.isascii() and value.isdigit() and int(value) >= 1:
        return int(value), mode
    raise ValueError(f"{option}: the hybrid suffix after '+' is lookup=L (a prompt-lookup branch of up to L tokens "
                     f"joined to the head's draft) or switch=L (prompt lookup's draft instead of the head's when it "
                     f"has one), L >= 1; got {text!r}")


@dataclass(frozen=True)
class TreeConfig:
    """Tree topology, optionally with a prompt-lookup continuation joined to the head's draft (a hybrid).

    Args:
        depth: D, draft tokens on the longest path of the head's tree (draft head passes per round); a chain's k.
        topk: K, children proposed per expanded node and frontier width per depth.
        num_nodes: N, head draft nodes verified per round (the target runs N + 1 rows, plus the lookup branch's
            own nodes). SGLang's ``--speculative-num-draft-tokens`` is N + 1.
        lookup: L, most prompt-lookup (n-gram) tokens joined per round; 0 = the head alone.
        lookup_mode: how they join (:data:`LOOKUP_MODES`): ``lookup``, one more branch from the root, its
            tokens shared with the head's tree merged into its nodes (verify rows N + 1 + the new ones);
            ``switch``, the lookup chain alone when prompt lookup has a continuation (the head does not run
            that round), else the head's tree.

    Raises:
        ValueError: if a value is < 1 (L < 0), the mode is unknown or N exceeds the candidates the rule produces
            (K + (D-1) K^2).
    """

    depth: int
    topk: int
    num_nodes: int
    lookup: int = 0
    lookup_mode: str = "lookup"

    def __post_init__(self) -> None:
        if min(self.depth, self.topk, self.num_nodes) < 1:
            raise ValueError(f"tree depth, topk and N must be >= 1, got {self.depth},{self.topk},{self.num_nodes}")
        if self.num_nodes > self.max_nodes:
            raise ValueError(
                f"tree N={self.num_nodes} exceeds the {self.max_nodes} candidates of depth {self.depth} x top-k "
                f"{self.topk} (K + (D-1) K^2); lower N or raise depth/topk"
            )
        if self.lookup < 0 or self.lookup_mode not in LOOKUP_MODES:
            raise ValueError(f"lookup must be >= 0 and lookup_mode one of {LOOKUP_MODES}, got {self.lookup}, "
                             f"{self.lookup_mode!r}")

    @property
    def max_nodes(self) -> int:
        return self.topk + (self.depth - 1) * self.topk**2

    @property
    def max_accept(self) -> int:
        """Most drafts one round can accept: the head tree's depth, or the lookup branch's length."""
        return max(self.depth, self.lookup)

    @classmethod
    def chain(cls, k: int, lookup: int = 0, lookup_mode: str = "lookup") -> "TreeConfig":
        """The chain of k drafts as a tree (with a prompt-lookup branch of up to ``lookup`` tokens)."""
        return cls(k, 1, k, lookup, lookup_mode)

    @classmethod
    def parse(cls, text: str, option: str = "--tree", auto: bool = True) -> "TreeConfig":
        """Read ``"depth,topk,N"`` (e.g. ``"5,4,16"``), optionally with a hybrid suffix ``+lookup=L`` or
        ``+switch=L`` (:func:`parse_lookup`, e.g. ``"4,2,7+lookup=8"``).

        Args:
            text: the option's value.
            option: the option named in errors.
            auto: whether the option also takes ``auto`` (said in the error message).

        Raises:
            ValueError: naming ``option`` when the text is not three integers (and a suffix) or the tree is invalid.
        """
        head, plus, extra = str(text).replace(" ", "").partition("+")
        parts = head.split(",")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{option} takes depth,topk,N (e.g. 5,4,16){' or auto' if auto else ''}, got {text!r}")
        lookup, mode = parse_lookup(extra, option) if plus else (0, "lookup")
        try:
            return cls(*(int(p) for p in parts), lookup, mode)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from exc

    @property
    def suffix(self) -> str:
        """The hybrid suffix of :meth:`parse` (``"+lookup=8"``), or ``""`` for the head alone."""
        return f"+{self.lookup_mode}={self.lookup}" if self.lookup else ""

    def __str__(self) -> str:
        return f"{self.depth},{self.topk},{self.num_nodes}{self.suffix}"

    @property
    def is_chain(self) -> bool:
        """The head drafts a chain (top-k 1, N = depth); a hybrid's lookup branch aside."""
        return self.topk == 1 and self.num_nodes == self.depth

    @property
    def head_only(self) -> "TreeConfig":
        """The same head shape without the prompt-lookup branch."""
        return TreeConfig(self.depth, self.topk, self.num_nodes)


@dataclass
class DraftTree:
    """A round's draft tree, nodes in an order where every parent precedes its children.

    Attributes:
        tokens: (N,) int64 target ids.
        parents: (N,) int64 index of each node's parent, -1 for a child of the root.
        depths: (N,) int64 in 1..D.
        scores: (N,) float32 cumulative draft log-probability (-inf for a node only prompt lookup proposed).
        sources: (N,) int64 which drafter proposed each node, a bit mask of ``metrics.HEAD`` (1) and
            ``metrics.LOOKUP`` (2); None = the head alone.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    sources: torch.Tensor | None = None

    def as_lists(self) -> tuple:
        """The tree as plain lists (picklable with no device): ``(tokens, parents, depths, scores, sources)``."""
        return (self.tokens.tolist(), self.parents.tolist(), self.depths.tolist(), self.scores.tolist(),
                None if self.sources is None else self.sources.tolist())

    @classmethod
    def from_lists(cls, lists: tuple, device) -> "DraftTree":
        """The tree :meth:`as_lists` gave, on ``device``."""
        tokens, parents, depths, scores, sources = lists

        def ints(x):
            return torch.tensor(x, dtype=torch.long, device=device)

        return cls(ints(tokens), ints(parents), ints(depths), torch.tensor(scores, dtype=torch.float32, device=device),
                   None if sources is None else ints(sources))

    def node_sources(self) -> torch.Tensor:
        """(N,) int64 :attr:`sources`, the head's mask (1) everywhere when None."""
        if self.sources is None:
            return torch.full_like(self.tokens, HEAD)
        return self.sources

    def children(self) -> list[list[int]]:
        """Children of each flattened row (row 0 the root, row i + 1 node i), in node order."""
        kids: list[list[int]] = [[] for _ in range(self.tokens.shape[0] + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask of the flattened tree [root, n_1..n_N].

    Args:
        parents: (N,) int64 parent index per node (-1 = root); parents precede children.

    Returns:
        (N+1, N+1) bool; entry [i, j] is True when row j is row i or one of its ancestors (the root is
        every row's ancestor).

    Raises:
        ValueError: if a parent does not precede its child.
    """
    n = parents.shape[0]
    mask = torch.eye(n + 1, dtype=torch.bool, device="cpu")  # built on the host (N small row ORs), copied once
    mask[:, 0] = True
    for i, p in enumerate(parents.tolist()):
        if p >= i:
            raise ValueError(f"tree node {i} has parent {p}: parents must precede their children")
        mask[i + 1] |= mask[p + 1]
    return mask.to(parents.device)


def add_branch(tree: DraftTree, ids: torch.Tensor) -> DraftTree:
    """Join a chain of draft tokens (a prompt-lookup continuation) to a tree as one more root path.

    Steps: 1. walk from the root down the tree's nodes whose tokens equal ids[0], ids[1], ... (siblings hold
    distinct tokens, so the walk is unique) and mark them as proposed by both drafters; 2. append the rest of
    ``ids`` as a chain under the last node reached (a new branch, after every existing node, so parents still
    precede children). Sibling tokens stay distinct, which greedy path acceptance and multi-draft rejection
    sampling (:func:`tree_rejection_accept`) need. The verify of the joined tree is one forward whose tree mask
    (:func:`tree_mask`) has the new branch as one more root path (as SAM-Decoding, arXiv 2411.10666, joins its
    suffix-automaton draft to an EAGLE-2 tree; llama.cpp's ``--spec-type draft-eagle3,ngram-mod`` instead lets
    the n-gram draft replace the head's, this module's ``switch`` mode).

    Args:
        tree: the head's tree (N nodes; may be empty).
        ids: (m,) int64 target ids of the chain, ids[0] a child of the root.

    Returns:
        The joined :class:`DraftTree`: the N nodes as they were (sources gaining ``LOOKUP`` on the shared path),
        then the m' <= m new nodes (source ``LOOKUP``, score -inf).
    """
    kids, tokens = tree.children(), tree.tokens.tolist()
    sources = tree.node_sources().clone()
    row, shared = 0, 0
    for t in ids.tolist():
        nxt = next((c for c in kids[row] if tokens[c] == t), None)
        if nxt is None:
            break
        sources[nxt] |= LOOKUP
        row, shared = nxt + 1, shared + 1
    rest = ids[shared:]
    n, m = tree.tokens.shape[0], rest.shape[0]
    dev = tree.tokens.device
    new_parents = torch.arange(n - 1, n + m - 1, device=dev)  # (m,): each new node under the previous one
    if m:
        new_parents[0] = row - 1  # the last shared node (-1: the root)
    first_depth = 1 + (int(tree.depths[row - 1]) if row else 0)
    return DraftTree(
        torch.cat([tree.tokens, rest]),  # (N + m,)
        torch.cat([tree.parents, new_parents]),  # (N + m,)
        torch.cat([tree.depths, first_depth + torch.arange(m, device=dev)]),  # (N + m,)
        torch.cat([tree.scores, torch.full((m,), float("-inf"), device=dev)]),  # (N + m,)
        torch.cat([sources, torch.full((m,), LOOKUP, dtype=torch.long, device=dev)]),  # (N + m,)
    )


def select_nodes(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor, n: int
) -> DraftTree:
    """Keep the best n candidates by (score desc, depth asc, index asc): EAGLE-2's re-ranking.

    Args:
        tokens, parents, depths, scores: (M,) the candidates; parents index into them (-1 = root) and
            precede their children.
        n: nodes to keep (<= M).

    Returns:
        :class:`DraftTree` of the n kept nodes, in rank order, parents re-indexed.
    """
    score, depth = scores.tolist(), depths.tolist()  # one copy each, not two host reads per candidate
    keys = sorted(range(tokens.shape[0]), key=lambda i: (-score[i], depth[i], i))[:n]
    new = {old: j for j, old in enumerate(keys)}
    par = parents.tolist()
    # a parent scores >= its child and is shallower, so it ranks first: the kept set is a tree
    new_parents = torch.tensor([new[par[i]] if par[i] >= 0 else -1 for i in keys], dtype=torch.long,
                               device=tokens.device)
    idx = torch.tensor(keys, dtype=torch.long, device=tokens.device)
    return DraftTree(tokens[idx], new_parents, depths[idx], scores[idx])


def tree_greedy_accept(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance: the longest root path whose tokens equal the target's argmax.

    Args:
        tree: the verified tree.
        target_argmax: (N+1,) int64 target argmax at each flattened row (row 0 the root).

    Returns:
        (accepted node indices along the path, next token: the argmax after the last accepted node).
    """
    kids, tokens = tree.children(), tree.tokens.tolist()
    best = target_argmax.tolist()
    path, row = [], 0
    while True:
        nxt = next((c for c in kids[row] if tokens[c] == best[row]), None)
        if nxt is None:
            return path, int(best[row])
        path.append(nxt)
        row = nxt + 1


def tree_rejection_accept(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Multi-draft rejection sampling over a tree of deterministic drafts (see the module docstring).

    The walk tries a row's children in node order, accepting child c with probability p(c) / (mass of p not yet
    rejected at the row). Every node's uniform is drawn up front (one per node, in node order) and every node's
    test is made on the device at once, so a round reads the host a fixed number of times (the tree's structure,
    the tests, the next token) whatever path it takes; on a GPU each read is a synchronisation. The unused
    uniforms change no probability: each child still meets its own independent uniform.

    Args:
        tree: the verified tree (sibling tokens are distinct).
        target_probs: (N+1, V) float32 warped target distribution at each flattened row.
        generator: RNG on ``target_probs``' device.

    Returns:
        (accepted node indices along the path, next token), the emitted tokens distributed as the target's.
    """
    kids, tokens = tree.children(), tree.tokens.tolist()
    n, dev = len(tokens), target_probs.device
    accept: list[bool] = []
    if n:
        row_of, earlier = [0] * n, torch.zeros(n, n, device="cpu")  # (N, N) built on the host, copied once:
        # earlier[c, j] = 1 for j an earlier sibling of c
        for row, cs in enumerate(kids):
            for i, c in enumerate(cs):
                row_of[c] = row
                earlier[c, cs[:i]] = 1
        rows = torch.tensor(row_of, device=dev)
        mass = target_probs[rows, tree.tokens]  # (N,) p(c) at c's parent row
        left = target_probs.sum(-1)[rows] - earlier.to(dev) @ mass  # (N,) mass left once earlier siblings fail
        u = torch.rand(n, generator=generator, device=dev)
        accept = ((u * left < mass) & (mass > 0)).tolist()  # one copy; p(c) = 0 is never accepted
    path, row = [], 0
    while (c := next((c for c in kids[row] if accept[c]), None)) is not None:
        path.append(c)
        row = c + 1
    p = target_probs[row].clone()  # (V,)
    if kids[row]:
        p[torch.tensor([tokens[c] for c in kids[row]], device=dev)] = 0
    p = torch.where(p.sum() > 0, p, target_probs[row])  # all mass on rejected children: kept for round-off
    return path, int(sample_from_probs(p, generator))


class Eagle3TreeDrafter(Eagle3Drafter):
    """Tree drafting (EAGLE-2's rule) with an EAGLE3 head and its own KV cache; also drafts chains, and hybrids
    with prompt lookup (``TreeConfig.lookup``).

    Args:
        head: an :class:`~draftkit.heads.eagle3_llama.Eagle3LlamaHead` in eval mode, ``embed_tokens`` loaded.
        lookup: the prompt-lookup drafter of hybrid rounds (default ``PromptLookupDrafter()``: suffixes of 3
            then 2 tokens).
    """

    def __init__(self, head, lookup: PromptLookupDrafter | None = None) -> None:
        super().__init__(head)
        self.lookup = lookup or PromptLookupDrafter()

    @torch.no_grad()
    def propose_tree(self, tokens: torch.Tensor, tree: TreeConfig) -> DraftTree:
        """Feed the pending rows, then grow and prune the tree (:meth:`expand`); a hybrid joins the prompt-lookup
        continuation of up to ``tree.lookup`` tokens (:func:`add_branch`), or in ``switch`` mode drafts it
        alone when there is one: the head then does not run, and its pending rows wait, joined by the round's
        accepted ones at :meth:`commit`.

        Args:
            tokens: (L+1,) the sequence so far.
            tree: the topology.

        Returns:
            The :class:`DraftTree` (N head nodes, plus the lookup branch's new ones).
        """
        extra = self.lookup.continuation(tokens, tree.lookup) if tree.lookup else tokens[:0]
        if extra.numel() and tree.lookup_mode == "switch":
            empty = tokens.new_zeros(0)
            return add_branch(DraftTree(empty, empty, empty, empty.float()), extra)
        z, h = self.feed_pending(tokens)
        drafted = self.expand(z, h, tokens.shape[0] - 1, tree)
        return add_branch(drafted, extra) if extra.numel() else drafted

    @torch.no_grad()
    def expand(self, z: torch.Tensor, h: torch.Tensor, L: int, tree: TreeConfig) -> DraftTree:
        """Grow the candidates depth by depth and keep the best N; the draft cache ends at its L rows.

        Args:
            z: (V_d,) draft logits of the root (the last step-0 row).
            h: (1, 1, H) pre-norm output of that row.
            L: position of the root; the draft cache holds L step-0 rows.
            tree: the topology.

        Returns:
            The N-node :class:`DraftTree`.

        Raises:
            ValueError: if top-k exceeds the draft vocabulary.
        """
        k = tree.topk
        if k > z.shape[-1]:
            raise ValueError(f"tree top-k {k} exceeds the draft vocabulary of {z.shape[-1]} tokens")
        check_finite_logits(z, "draft logits at tree depth 1")
        logp, ids = z.float().log_softmax(-1).topk(k)  # (K,)
        toks, scores = [ids], [logp]
        parents, depths = [-1] * k, [1] * k
        rows: dict[int, int] = {}  # node -> its draft cache row, for the nodes fed to the head
        frontier, feature = list(range(k)), h.expand(1, k, h.shape[-1])  # (1, K, H)
        all_toks = ids
        for d in range(1, tree.depth):
            s = self.cache.length
            f = len(frontier)
            mask = torch.zeros(f, s + f, dtype=torch.bool, device="cpu")  # on the host: one copy, not a launch an entry
            mask[:, :L] = True
            for j, node in enumerate(frontier):
                mask[j, s + j] = True
                a = parents[node]
                while a >= 0:
                    mask[j, rows[a]] = True
                    a = parents[a]
                rows[node] = s + j
            ids_t = self.draft_target_ids[all_toks[frontier]]  # (F,)
            pos = torch.full((1, f), L + d - 1, device=self.device)
            logits, hf = self.head(ids_t[None], feature, pos, self.cache,
                                   attn_mask=mask.to(self.device))  # (1, F, V_d), (1, F, H)
            check_finite_logits(logits[0], f"draft logits at tree depth {d + 1}")
            lp, ci = logits[0].float().log_softmax(-1).topk(k, dim=-1)  # (F, K)
            cum = torch.cat(scores)[frontier][:, None] + lp  # (F, K)
            base = len(parents)
            toks.append(ci.reshape(-1))
            scores.append(cum.reshape(-1))
            parents += [node for node in frontier for _ in range(k)]
            depths += [d + 1] * (f * k)
            all_toks = torch.cat(toks)
            if d + 1 < tree.depth:
                best = cum.reshape(-1).topk(min(k, f * k)).indices  # (K,) best candidates of depth d+1
                frontier = (base + best).tolist()
                feature = hf[:, best // k]  # (1, K, H): each new frontier node reads its parent's h
        self.cache.crop(L)
        target_ids = self.draft_target_ids[all_toks]
        dev = target_ids.device
        return select_nodes(
            target_ids, torch.tensor(parents, device=dev), torch.tensor(depths, device=dev), torch.cat(scores),
            tree.num_nodes,
        )


@torch.no_grad()
def generate_tree(
    target: TargetSession,
    drafter,
    prompt_ids: torch.Tensor,
    tree: TreeConfig,
    cfg: DecodeConfig,
    generator: torch.Generator | None = None,
    sync: Sync | None = None,
) -> GenerationResult:
    """Tree speculative decoding (see the module docstring); the loop is ``speculative_loop``.

    Args:
        target: the target session (reset here).
        drafter: an :class:`Eagle3TreeDrafter`, or any drafter with ``propose_tree(tokens, tree)``,
            ``reset``, ``commit`` and ``round_bytes``.
        prompt_ids: (n,) int64 templated prompt.
        tree: the topology (depth, top-k, N).
        cfg: stop and sampling options.
        generator: RNG for sampling (acceptance draws and corrections).
        sync: a target sharded across the ranks (``decoding.verify.Sync``): every rank verifies rank 0's tree (its
            own head may have drafted another one, of another size, which would part the collective forwards) and
            applies rank 0's accepted path and next token; the drafter's state after a round does not depend on
            the tree it drafted (its cache is cut back to the root), so the ranks stay in step. None = a single
            process.

    Returns:
        :class:`GenerationResult`; ``stats`` counts per round the accepted path length (<= depth, or the lookup
        branch's length) and the verified nodes as drafted, and which drafter proposed them
        (``AcceptanceStats.share``).

    Raises:
        ValueError: on an empty prompt or one that does not fit the context window.
    """

    def tree_round(seq: torch.Tensor, L: int) -> Round:
        t1 = time.perf_counter()
        draft = drafter.propose_tree(seq[:L + 1], tree)
        dev = seq.device
        if sync is not None:  # rank 0's tree on every rank: the verify forward is collective
            draft = DraftTree.from_lists(sync(draft.as_lists()), dev)
        synchronize(dev)  # the draft's kernels finish inside the draft time (CUDA runs them asynchronously)
        t2 = time.perf_counter()
        n = draft.tokens.shape[0]
        mask = torch.cat([torch.ones(n + 1, L, dtype=torch.bool, device=dev), tree_mask(draft.parents).to(dev)], 1)
        pos = L + torch.cat([draft.depths.new_zeros(1), draft.depths]).to(dev)  # (N+1,)
        logits, aux = target.forward(torch.cat([seq[L:L + 1], draft.tokens]), position_ids=pos, attn_mask=mask)
        if cfg.greedy:
            check_finite_logits(logits, "target verify logits")
            path, nxt = tree_greedy_accept(draft, logits.argmax(-1))
        else:
            p = probs_from_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # (N+1, V)
            path, nxt = tree_rejection_accept(draft, p, generator)
        if sync is not None:  # rank 0's round on every rank, before the caches keep its path
            path, nxt = sync((path, nxt))
        rows = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long, device=dev)  # root + path
        target.keep(torch.cat([torch.arange(L, device=dev), L + rows]))
        drafter.commit(aux[rows])
        synchronize(dev)
        t3 = time.perf_counter()
        accepted = draft.tokens[path].tolist() if path else []
        src = draft.node_sources().tolist()
        kind = 0
        for bit in src:
            kind |= bit
        head_passes = tree.depth if kind & HEAD else 0
        return Round(accepted, nxt, n, target.weight_bytes + drafter.round_bytes(head_passes), t2 - t1, t3 - t2,
                     sources=(kind, [src[i] for i in path]))

    return speculative_loop(target, drafter, prompt_ids, cfg, tree_round, tree.max_accept, generator, sync)
