"""Decoding on a tiny random Llama target with a tiny random EAGLE3 head (float32, offline)."""

import pytest
import torch
from decoding_stubs import TINY_PROMPTS, greedy_references, joint_pvalue, target_joint

from draftkit.sampling import probs_from_logits
from draftkit.decoding.drafters import Draft, Eagle3Drafter
from draftkit.decoding.verify import generate_plain, generate_speculative, generate_uncached, greedy_verify
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession
from draftkit.heads.eagle3_llama import KVCache

PROMPTS = TINY_PROMPTS


class OracleDrafter(Eagle3Drafter):
    """The real head and cache, but the proposed ids are replaced by the known greedy output for the
    first ``pattern[r]`` positions and a wrong token afterwards, so acceptance is controlled."""

    def __init__(self, head, greedy_tokens: list[int], prompt_len: int, pattern: list[int]) -> None:
        super().__init__(head)
        self.greedy, self.n, self.pattern, self.round = greedy_tokens, prompt_len, pattern, 0

    def propose(self, tokens, k, cfg, generator):
        draft = super().propose(tokens, k, cfg, generator)  # advances and rolls back the draft cache
        good = self.pattern[self.round % len(self.pattern)]
        self.round += 1
        start = tokens.shape[0] - self.n  # index in the output of the token after tokens[-1]
        ids = [self.greedy[start + i] if start + i < len(self.greedy) else 0 for i in range(k)]
        ids = [t if i < good else (t + 1) % 320 for i, t in enumerate(ids)]
        return Draft(torch.tensor(ids), None, draft.logits, draft.t2d)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cached_equals_uncached(tiny, temperature):
    target, _ = tiny
    session = TargetSession(target)
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        cfg = DecodeConfig(max_new_tokens=24, temperature=temperature, top_k=20)
        cached = generate_plain(session, ids, cfg, torch.Generator().manual_seed(3)).tokens
        uncached = generate_uncached(target, ids, cfg, torch.Generator().manual_seed(3))
        assert cached == uncached
        assert len(cached) == 24


def test_greedy_speculative_equals_plain_random_head(tiny, tiny_head):
    session, cfg, refs = greedy_references(tiny[0], 32)
    for ids, plain in refs:
        spec = generate_speculative(session, Eagle3Drafter(tiny_head), ids, 5, cfg, collect_kl=True)
        assert spec.tokens == plain
        assert spec.stats.rounds == spec.target_forwards
        kl = spec.stats.kl_per_position()
        assert len(kl) == 5 and all(x > 0 for x in kl)


def test_greedy_speculative_with_controlled_acceptance(tiny, tiny_head):
    target, _ = tiny
    session = TargetSession(target)
    ids = torch.tensor(PROMPTS[1])
    pattern = [3, 0, 5, 1, 2]  # tokens per cycle: 4 + 1 + 6 + 2 + 3 = 16
    cfg = DecodeConfig(max_new_tokens=1 + 16 * 2)
    plain = generate_plain(session, ids, cfg)
    drafter = OracleDrafter(tiny_head, plain.tokens, len(PROMPTS[1]), pattern)
    spec = generate_speculative(session, drafter, ids, 5, cfg)
    assert spec.tokens == plain.tokens
    assert spec.stats.accepted == pattern * 2
    assert spec.stats.tau() == pytest.approx(16 / 5)
    # the loop committed the accepted positions' aux states: flushing them gives a fresh prefill's cache
    seq = ids.tolist() + spec.tokens
    Eagle3Drafter.propose(drafter, torch.tensor(seq), 1, cfg, None)
    full = target(torch.tensor([seq[:-1]]))
    cache = KVCache()
    tiny_head(torch.tensor([seq[1:]]), tiny_head.project(full.aux_hidden_states), torch.arange(len(seq) - 1)[None], cache)
    torch.testing.assert_close(drafter.cache.k, cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drafter.cache.v, cache.v, atol=1e-5, rtol=1e-5)


def test_sync_applies_rank_zeros_picks_and_rounds(tiny, tiny_head):
    """The ``sync`` hook (a target sharded across ranks): a "rank 1" whose drafter accepts nothing, given the
    values "rank 0" (the controlled-acceptance drafter) exchanged, emits rank 0's tokens with rank 0's accepted
    counts and forwards; plain decoding emits the synced tokens, not its own picks. Trees and auto refuse it."""
    from draftkit.decoding.harness import evaluate_drafter
    from draftkit.decoding.tree import TreeConfig

    target, _ = tiny
    session = TargetSession(target)
    ids = torch.tensor(PROMPTS[1])
    pattern = [3, 0, 5, 1, 2]
    cfg = DecodeConfig(max_new_tokens=1 + 16 * 2)
    plain = generate_plain(session, ids, cfg)
    sent = []
    rank0 = generate_speculative(session, OracleDrafter(tiny_head, plain.tokens, len(PROMPTS[1]), pattern), ids, 5,
                                 cfg, sync=lambda value: sent.append(value) or value)
    assert sent[0] == plain.tokens[0] and len(sent) == 1 + rank0.stats.rounds
    received = iter(sent)
    rank1 = generate_speculative(session, OracleDrafter(tiny_head, plain.tokens, len(PROMPTS[1]), [0]), ids, 5, cfg,
                                 sync=lambda value: next(received))
    assert rank1.tokens == rank0.tokens == plain.tokens
    assert rank1.stats.accepted == pattern * 2 and rank1.target_forwards == rank0.target_forwards == 10
    assert session.length == len(PROMPTS[1]) + len(plain.tokens) - 1  # rank 0's length, not its own
    other = generate_plain(session, torch.tensor(PROMPTS[0]), cfg).tokens
    picks = iter(other)
    assert generate_plain(session, ids, cfg, sync=lambda value: next(picks)).tokens == other
    with pytest.raises(ValueError, match=r"^sync \(a target sharded across the ranks\) cannot run auto: its choice "
                                         r"rests on each rank's own timings"):
        evaluate_drafter(Eagle3Drafter(tiny_head), target, None, [PROMPTS[1]], eos_token_ids=[],
                         sync=lambda value: value, auto="k")


def test_sync_makes_every_rank_verify_rank_zeros_tree(tiny, tiny_head):
    """Trees under ``sync``: "rank 1" drafts with another head (other trees: another acceptance on its own); given
    what "rank 0" exchanged (its first token, then per round its tree and its accepted path and next token), it
    verifies rank 0's trees, so it emits rank 0's tokens with rank 0's accepted counts, node counts and forwards."""
    from decoding_stubs import make_head

    from draftkit.decoding.tree import Eagle3TreeDrafter, TreeConfig, generate_tree

    target, _ = tiny
    session = TargetSession(target)
    ids = torch.tensor(PROMPTS[1])
    cfg = DecodeConfig(max_new_tokens=24)
    shape = TreeConfig.parse("3,2,4+lookup=3")  # a hybrid: rank 0's lookup branch adds nodes to its trees
    plain = generate_plain(session, ids, cfg)
    sent = []
    rank0 = generate_tree(session, Eagle3TreeDrafter(tiny_head), ids, shape, cfg,
                          sync=lambda value: sent.append(value) or value)
    assert len(sent) == 1 + 2 * rank0.stats.rounds and sent[0] == plain.tokens[0]
    assert [len(tree[0]) for tree in sent[1::2]] == rank0.stats.drafted
    other = make_head(target, seed=1)
    alone = generate_tree(session, Eagle3TreeDrafter(other), ids, shape, cfg)
    assert alone.stats.accepted != rank0.stats.accepted  # on its own, rank 1 would part from rank 0
    received = iter(sent)
    rank1 = generate_tree(session, Eagle3TreeDrafter(other), ids, shape, cfg, sync=lambda value: next(received))
    assert next(received, None) is None  # it exchanged exactly as often as rank 0
    assert rank1.tokens == rank0.tokens == plain.tokens
    assert (rank1.stats.accepted, rank1.stats.drafted) == (rank0.stats.accepted, rank0.stats.drafted)
    assert rank1.target_forwards == rank0.target_forwards


def _layer_kv(cache, i):
    layer = cache.layers[i]
    return layer.keys, layer.values


def test_cache_rollback_equals_fresh_prefill(tiny, tiny_head):
    """After rounds with rejections, both caches equal a fresh prefill of the accepted sequence."""
    target, _ = tiny
    prompt = torch.tensor(PROMPTS[0])
    greedy = generate_plain(TargetSession(target), prompt, DecodeConfig(max_new_tokens=30)).tokens
    session, drafter = TargetSession(target), Eagle3Drafter(tiny_head)
    cfg = DecodeConfig(max_new_tokens=30)
    logits, aux = session.forward(prompt, logits_to_keep=1)
    drafter.reset(prompt, aux)
    seq = prompt.tolist() + [int(logits[-1].argmax())]
    for planned in (2, 0, 4, 1):
        drafter.propose(torch.tensor(seq), 4, cfg, None)
        out = len(seq) - len(prompt)
        ids = [greedy[out + i] if i < planned else (greedy[out + i] + 1) % 320 for i in range(4)]
        L = session.length
        logits, aux = session.forward(torch.tensor(seq[-1:] + ids))
        a, nxt = greedy_verify(torch.tensor(ids), logits)
        assert a == planned
        session.crop(L + a + 1)
        drafter.commit(aux[: a + 1])
        seq += ids[:a] + [nxt]
    assert seq[len(prompt):] == greedy[: len(seq) - len(prompt)]
    # target: the cropped cache equals a prefill of everything but the last (not yet verified) token
    fresh = TargetSession(target)
    fresh.forward(torch.tensor(seq[:-1]))
    assert session.length == fresh.length == len(seq) - 1
    for i in range(target.num_layers):
        for got, want in zip(_layer_kv(session.cache, i), _layer_kv(fresh.cache, i)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # draft: once the pending rows are fed, the cache equals step-0 rows of a fresh full prefill
    drafter.propose(torch.tensor(seq), 4, cfg, None)
    full = target(torch.tensor([seq[:-1]]))
    cache = KVCache()
    n = len(seq) - 1
    tiny_head(torch.tensor([seq[1:]]), tiny_head.project(full.aux_hidden_states), torch.arange(n)[None], cache)
    assert drafter.cache.length == n
    torch.testing.assert_close(drafter.cache.k, cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drafter.cache.v, cache.v, atol=1e-5, rtol=1e-5)


def test_drafter_chain_equals_head_forward(tiny, tiny_head):
    """Eagle3Drafter's last-row-only step and chaining equal the head's own forward step by step."""
    target, _ = tiny
    prompt = torch.tensor(PROMPTS[1])
    out = target(prompt[None])
    x = int(out.logits[0, -1].argmax())
    drafter = Eagle3Drafter(tiny_head)
    drafter.reset(prompt, out.aux_hidden_states[0])
    draft = drafter.propose(torch.tensor(prompt.tolist() + [x]), 3, DecodeConfig(), None)
    n = prompt.numel()
    cache = KVCache()
    ids = torch.tensor([prompt.tolist()[1:] + [x]])
    logits, h = tiny_head(ids, tiny_head.project(out.aux_hidden_states), torch.arange(n)[None], cache)
    expected = []
    for j in range(3):
        z = logits[0, -1]
        expected.append(z)
        t = tiny_head.draft_to_target(z.argmax())
        logits, h = tiny_head(t.view(1, 1), h[:, -1:], torch.tensor([[n + j]]), cache)
    torch.testing.assert_close(draft.logits, torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert draft.ids.tolist() == [int(tiny_head.draft_to_target(z.argmax())) for z in expected]
    assert bool(tiny_head.t2d[draft.ids].all())
    assert drafter.cache.length == n  # chained rows rolled back


def test_sampled_draft_distribution_is_mapped_through_d2t(tiny, tiny_head):
    target, _ = tiny
    prompt = torch.tensor(PROMPTS[0])
    out = target(prompt[None])
    drafter = Eagle3Drafter(tiny_head)
    drafter.reset(prompt, out.aux_hidden_states[0])
    cfg = DecodeConfig(temperature=0.8, top_p=0.9)
    draft = drafter.propose(torch.tensor(prompt.tolist() + [5]), 4, cfg, torch.Generator().manual_seed(0))
    assert draft.probs.shape == (4, 320)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(4))
    assert float(draft.probs[:, ~tiny_head.t2d].abs().sum()) == 0.0
    expected = probs_from_logits(draft.logits, 0.8, 0, 0.9)  # (4, V_d) in draft order
    torch.testing.assert_close(draft.probs[:, tiny_head.t2d], expected)
    assert bool((draft.probs[torch.arange(4), draft.ids] > 0).all())


class SelfDrafter:
    """Drafts from the target's own distribution at another temperature (no cache): overlapping p and q."""

    def __init__(self, target, temperature: float) -> None:
        self.target, self.temperature, self.memo = target, temperature, {}

    def reset(self, prompt_ids, aux):
        pass

    def commit(self, aux):
        pass

    def round_bytes(self, drafted):
        return 0

    def propose(self, tokens, k, cfg, generator):
        ids, probs, seq = [], [], tokens
        for _ in range(k):
            key = tuple(seq.tolist())
            if key not in self.memo:
                self.memo[key] = probs_from_logits(self.target(seq[None]).logits[0, -1], self.temperature)
            q = self.memo[key]
            d = torch.multinomial(q, 1, generator=generator)
            ids.append(d[0])
            probs.append(q)
            seq = torch.cat([seq, d])
        return Draft(torch.stack(ids), torch.stack(probs))


def test_sampled_speculative_distribution_tiny_target(tiny):
    """Speculative sampling with the real cached target gives the target's (top-k warped) distribution."""
    target, _ = tiny
    cfg = DecodeConfig(max_new_tokens=2, temperature=1.0, top_k=3)
    session, drafter = TargetSession(target), SelfDrafter(target, 2.0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.tensor(PROMPTS[0])

    def run():
        return generate_speculative(session, drafter, prompt, 1, cfg, g).tokens

    assert joint_pvalue(run, 400, target_joint(target, PROMPTS[0], 2, 3)) > 1e-3


def test_bench_scripted_acceptance(tiny, tiny_head):
    from draftkit.decoding.bench import bench_decode

    target, tokenizer = tiny
    prompts = [torch.tensor(p) for p in PROMPTS]
    # 1 + rounds emitting 2, 4, 3, 5, 1, 3 = 19 tokens: whole rounds only
    result = bench_decode(target, tokenizer, tiny_head, prompts, k=5, max_new_tokens=19, pattern=[1, 3, 2, 4, 0, 2])
    assert result["outputs_equal_plain"] == 2
    assert result["scripted_tau"] == pytest.approx(3.0)
    assert result["head_tau"] >= 1.0 and result["draft_ms_per_round"] > 0
    # HF generate() on the same model and ids: the same greedy tokens, its speed beside plain's
    assert result["hf_outputs_equal_plain"] == 2
    assert result["plain_vs_hf_generate"] == pytest.approx(
        result["plain_tokens_per_s"] / result["hf_generate_tokens_per_s"])


def test_expected_acceptance_matches_measured_acceptance_rate_at_t1(tiny, tiny_head):
    """At T = 1 with k = 1 every drafted token is verified, and speculative sampling accepts it with probability
    sum min(p, q) (q zero outside the draft vocab): the mean of the reported expected acceptance and the
    measured acceptance rate agree within sampling noise (4 standard deviations of the mean of the rounds'
    Bernoulli outcomes)."""
    target, _ = tiny
    session = TargetSession(target)
    cfg = DecodeConfig(max_new_tokens=200, temperature=1.0)
    stats = None
    for seed in range(10):
        prompt = torch.tensor(PROMPTS[seed % 2])
        spec = generate_speculative(session, Eagle3Drafter(tiny_head), prompt, 1, cfg,
                                    torch.Generator().manual_seed(seed), collect_kl=True)
        stats = spec.stats if stats is None else (stats.extend(spec.stats) or stats)
    measured, expected = stats.rate(), stats.per_position_mean("expected_accept")[0]
    outside = stats.per_position_mean("outside_mass")[0]
    noise = (expected * (1 - expected) / stats.rounds) ** 0.5
    assert stats.rounds > 1000
    assert abs(measured - expected) < 4 * noise, (measured, expected, noise)
    assert 0.1 < outside < 0.4  # 64 of the 320 ids lie outside the 256-id draft vocab
