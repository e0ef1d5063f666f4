"""Stub targets and drafters with fixed next-token tables, for exact acceptance-length checks."""

from __future__ import annotations

import torch

from draftkit.decoding.drafters import Draft
from draftkit.decoding.verify import generate_plain
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession
from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.selection.vocab import VocabMap


TINY_PROMPTS = [[256, 10, 72, 101, 108, 108, 111, 257, 10], [256, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 8]]


def greedy_references(target, max_new_tokens: int) -> tuple[TargetSession, DecodeConfig, list]:
    """(session, greedy config, [(prompt ids, plain greedy tokens)]) over ``TINY_PROMPTS``."""
    session = TargetSession(target)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    refs = []
    for prompt in TINY_PROMPTS:
        ids = torch.tensor(prompt)
        refs.append((ids, generate_plain(session, ids, cfg).tokens))
    return session, cfg, refs


def make_head(target, draft_vocab_size: int = 256, seed: int = 0) -> Eagle3LlamaHead:
    """A seeded random head for ``target`` with a random draft vocab of ``draft_vocab_size`` ids."""
    g = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(target.vocab_size, generator=g)[:draft_vocab_size]).values
    vocab = VocabMap.from_ids(used, target.vocab_size)
    cfg = Eagle3Config.from_target_config(target.config, target.aux_layer_ids, draft_vocab_size)
    torch.manual_seed(seed)
    head = Eagle3LlamaHead(cfg)
    head.set_vocab(vocab.d2t, vocab.t2d)
    head.load_embedding(target.input_embeddings().float())
    return head.eval()


class MarkovTarget:
    """Stub target session: the next-token distribution depends only on the current token.

    ``log_probs`` is a (V, V) table; row t holds log p(next | t). Aux states are the token ids as floats,
    shape (T, 1). Records every forward's input ids (``inputs``) and length so that tests can check them.
    """

    def __init__(self, log_probs: torch.Tensor) -> None:
        self.log_probs = log_probs
        self.seq: list[int] = []
        self.forward_lengths: list[int] = []
        self.inputs: list[list[int]] = []
        self.weight_bytes = 1000
        self.max_length = 1 << 20

    @property
    def length(self) -> int:
        return len(self.seq)

    def reset(self) -> None:
        self.seq = []

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0):
        ids = input_ids.tolist()
        self.seq += ids
        self.forward_lengths.append(len(ids))
        self.inputs.append(ids)
        logits = self.log_probs[input_ids]  # (T, V)
        aux = input_ids.float()[:, None]  # (T, 1)
        return (logits[-logits_to_keep:] if logits_to_keep else logits), aux

    def crop(self, length: int) -> None:
        assert length <= len(self.seq)
        self.seq = self.seq[:length]


def deterministic_table(vocab: int, step: int = 3) -> torch.Tensor:
    """log-prob table whose argmax after token t is (step * t + 1) % vocab, with a wide margin."""
    table = torch.full((vocab, vocab), -20.0)
    t = torch.arange(vocab)
    table[t, (step * t + 1) % vocab] = 0.0
    return table


class ScriptedDrafter:
    """Stub drafter: proposes the target's greedy chain with a scripted number of correct tokens.

    Round r proposes ``pattern[r % len(pattern)]`` correct tokens (following ``next_of``) and then
    wrong ones (correct + 1) up to k. With ``logits`` (k, V_d) and ``t2d`` (V,) every draft reports those
    fixed draft logits (for KL).
    """

    def __init__(self, next_of, pattern: list[int], vocab: int, logits=None, t2d=None) -> None:
        self.next_of, self.pattern, self.vocab = next_of, pattern, vocab
        self.logits, self.t2d = logits, t2d
        self.round = 0
        self.commits: list[int] = []

    def reset(self, prompt_ids, aux) -> None:
        self.round = 0

    def commit(self, aux) -> None:
        self.commits.append(aux.shape[0])

    def round_bytes(self, drafted: int) -> int:
        return 10 * drafted

    def propose(self, tokens, k, cfg, generator) -> Draft:
        good = self.pattern[self.round % len(self.pattern)]
        self.round += 1
        ids, last = [], int(tokens[-1])
        for i in range(k):
            nxt = self.next_of(last)
            ids.append(nxt if i < good else (nxt + 1) % self.vocab)
            last = ids[-1]
        return Draft(torch.tensor(ids), None, None if self.logits is None else self.logits[:k], self.t2d)


class StatelessDrafter:
    """Stub drafter base without state: reset and commit do nothing, drafting reads no weights."""

    def reset(self, prompt_ids, aux) -> None:
        pass

    def commit(self, aux) -> None:
        pass

    def round_bytes(self, drafted: int) -> int:
        return 0


class MarkovDrafter(StatelessDrafter):
    """Stub sampled drafter: draws each draft token from its own Markov table ``q`` (V, V) of probs."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q

    def propose(self, tokens, k, cfg, generator) -> Draft:
        ids, probs, last = [], [], int(tokens[-1])
        for _ in range(k):
            q = self.q[last]
            last = int(torch.multinomial(q, 1, generator=generator))
            ids.append(last)
            probs.append(q)
        return Draft(torch.tensor(ids), torch.stack(probs))


def target_joint(target, prompt: list[int], length: int, top_k: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every ``length``-token continuation under top-k warped sampling at T = 1."""
    from draftkit.sampling import probs_from_logits

    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, p in joint.items():
            probs = probs_from_logits(target(torch.tensor(prompt + list(seq))[None]).logits[0, -1], 1.0, top_k)
            for t in probs.nonzero()[:, 0].tolist():
                nxt[seq + (t,)] = p * float(probs[t])
        joint = nxt
    return joint


def joint_pvalue(run, n: int, joint: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of n outputs of ``run()`` (token lists) against ``joint``; every output must be a cell."""
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        out = tuple(run())
        counts[out] = counts.get(out, 0) + 1
    assert set(counts) <= set(joint), set(counts) - set(joint)
    cells = list(joint)
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    return chi2_pvalue(observed, torch.tensor([joint[c] * n for c in cells]))


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled into one."""
    observed, expected = observed.double(), expected.double()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(observed.numel() - 1))
    return float(torch.special.gammaincc(df / 2, stat / 2))

