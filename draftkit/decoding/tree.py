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

A chain of k drafts is the tree (depth k, top-k 1, N k): same drafts, same verify rows, same result.

Shapes: L tokens before the round's root, D depth, K top-k, N kept nodes, V target vocab, V_d draft
vocab, H draft hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draftkit.sampling import check_finite_logits, probs_from_logits, sample_from_probs
from draftkit.decoding.drafters import Eagle3Drafter
from draftkit.decoding.verify import GenerationResult, Round, speculative_loop
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession

__all__ = [
    "DraftTree",
    "Eagle3TreeDrafter",
    "TreeConfig",
    "generate_tree",
    "select_nodes",
    "tree_greedy_accept",
    "tree_mask",
    "tree_rejection_accept",
]


@dataclass(frozen=True)
class TreeConfig:
    """Tree topology.

    Args:
        depth: D, draft tokens on the longest path (draft head passes per round); a chain's k.
        topk: K, children proposed per expanded node and frontier width per depth.
        num_nodes: N, draft nodes verified per round (the target runs N + 1 rows). SGLang's
            ``--speculative-num-draft-tokens`` is N + 1.

    Raises:
        ValueError: if a value is < 1 or N exceeds the candidates the rule produces (K + (D-1) K^2).
    """

    depth: int
    topk: int
    num_nodes: int

    def __post_init__(self) -> None:
        if min(self.depth, self.topk, self.num_nodes) < 1:
            raise ValueError(f"tree depth, topk and N must be >= 1, got {self.depth},{self.topk},{self.num_nodes}")
        if self.num_nodes > self.max_nodes:
            raise ValueError(
                f"tree N={self.num_nodes} exceeds the {self.max_nodes} candidates of depth {self.depth} x top-k "
                f"{self.topk} (K + (D-1) K^2); lower N or raise depth/topk"
            )

    @property
    def max_nodes(self) -> int:
        return self.topk + (self.depth - 1) * self.topk**2

    @classmethod
    def chain(cls, k: int) -> "TreeConfig":
        """The chain of k drafts as a tree."""
        return cls(k, 1, k)

    @classmethod
    def parse(cls, text: str, option: str = "--tree", auto: bool = True) -> "TreeConfig":
        """Read ``"depth,topk,N"`` (e.g. ``"5,4,16"``).

        Args:
            text: the option's value.
            option: the option named in errors.
            auto: whether the option also takes ``auto`` (said in the error message).

        Raises:
            ValueError: naming ``option`` when the text is not three integers or the tree is invalid.
        """
        parts = str(text).replace(" ", "").split(",")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{option} takes depth,topk,N (e.g. 5,4,16){' or auto' if auto else ''}, got {text!r}")
        try:
            return cls(*(int(p) for p in parts))
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from exc

    def __str__(self) -> str:
        return f"{self.depth},{self.topk},{self.num_nodes}"

    @property
    def is_chain(self) -> bool:
        return self.topk == 1 and self.num_nodes == self.depth


@dataclass
class DraftTree:
    """A round's draft tree, nodes in an order where every parent precedes its children.

    Attributes:
        tokens: (N,) int64 target ids.
        parents: (N,) int64 index of each node's parent, -1 for a child of the root.
        depths: (N,) int64 in 1..D.
        scores: (N,) float32 cumulative draft log-probability.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

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
    mask = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    mask[:, 0] = True
    for i, p in enumerate(parents.tolist()):
        if p >= i:
            raise ValueError(f"tree node {i} has parent {p}: parents must precede their children")
        mask[i + 1] |= mask[p + 1]
    return mask


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
    keys = sorted(range(tokens.shape[0]), key=lambda i: (-float(scores[i]), int(depths[i]), i))[:n]
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

    Args:
        tree: the verified tree (sibling tokens are distinct).
        target_probs: (N+1, V) float32 warped target distribution at each flattened row.
        generator: RNG.

    Returns:
        (accepted node indices along the path, next token), the emitted tokens distributed as the target's.
    """
    kids, tokens = tree.children(), tree.tokens.tolist()
    path, row = [], 0
    while True:
        p = target_probs[row].clone()  # (V,)
        for c in kids[row]:
            u = torch.rand((), generator=generator, device=p.device)
            if u * p.sum() < p[tokens[c]]:
                path.append(c)
                row = c + 1
                break
            p[tokens[c]] = 0
        else:
            if not p.sum() > 0:  # all mass on rejected children: probability 0, kept for round-off
                p = target_probs[row]
            return path, int(sample_from_probs(p, generator))


class Eagle3TreeDrafter(Eagle3Drafter):
    """Tree drafting (EAGLE-2's rule) with an EAGLE3 head and its own KV cache; also drafts chains.

    Args:
        head: an :class:`~draftkit.heads.eagle3_llama.Eagle3LlamaHead` in eval mode, ``embed_tokens`` loaded.
    """

    @torch.no_grad()
    def propose_tree(self, tokens: torch.Tensor, tree: TreeConfig) -> DraftTree:
        """Feed the pending rows, then grow and prune the tree (:meth:`expand`).

        Args:
            tokens: (L+1,) the sequence so far.
            tree: the topology.

        Returns:
            The N-node :class:`DraftTree`.
        """
        z, h = self.feed_pending(tokens)
        return self.expand(z, h, tokens.shape[0] - 1, tree)

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
            mask = torch.zeros(f, s + f, dtype=torch.bool, device=self.device)
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
            logits, hf = self.head(ids_t[None], feature, pos, self.cache, attn_mask=mask)  # (1,F,V_d), (1,F,H)
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

    Returns:
        :class:`GenerationResult`; ``stats`` counts per round the accepted path length (<= depth) and
        the N verified nodes as drafted.

    Raises:
        ValueError: on an empty prompt or one that does not fit the context window.
    """

    def tree_round(seq: torch.Tensor, L: int) -> Round:
        t1 = time.perf_counter()
        draft = drafter.propose_tree(seq[:L + 1], tree)
        t2 = time.perf_counter()
        n = draft.tokens.shape[0]
        dev = seq.device
        mask = torch.cat([torch.ones(n + 1, L, dtype=torch.bool, device=dev), tree_mask(draft.parents).to(dev)], 1)
        pos = L + torch.cat([draft.depths.new_zeros(1), draft.depths]).to(dev)  # (N+1,)
        logits, aux = target.forward(torch.cat([seq[L:L + 1], draft.tokens]), position_ids=pos, attn_mask=mask)
        if cfg.greedy:
            check_finite_logits(logits, "target verify logits")
            path, nxt = tree_greedy_accept(draft, logits.argmax(-1))
        else:
            p = probs_from_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # (N+1, V)
            path, nxt = tree_rejection_accept(draft, p, generator)
        rows = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long, device=dev)  # root + path
        target.keep(torch.cat([torch.arange(L, device=dev), L + rows]))
        drafter.commit(aux[rows])
        t3 = time.perf_counter()
        accepted = draft.tokens[path].tolist() if path else []
        return Round(accepted, nxt, n, target.weight_bytes + drafter.round_bytes(tree.depth), t2 - t1, t3 - t2)

    return speculative_loop(target, drafter, prompt_ids, cfg, tree_round, tree.depth, generator)
