"""The evaluation harness behind ``draftkit evaluate`` and the ``AcceptanceLengthMonitor`` callback: acceptance
length and speedup of a drafter on prompts.

For every prompt (chat template applied, ``add_generation_prompt=True``) the same harness runs, one after
the other so that machine load hits all alike:

1. plain decoding with the target's KV cache (the baseline; at T = 0 it also records the target's top-2
   logit gap at every token, for the lossless check);
2. speculative decoding with the head (a chain of k drafts per round or a tree, draft KV cache, one target
   verify forward per round; or a hybrid, the head's draft joined by a prompt-lookup continuation,
   ``decoding.tree``), and with ``sweep`` every further topology in turn;
3. prompt-lookup (n-gram) drafting with the same k, or ``prompt_lookup_k`` (baseline drafter).

The report (JSON, stable keys) carries tau (bonus token counted), per-position acceptance alpha_i,
acceptance rate, per draft position the KL on the draft vocab (target renormalised over it,
``metrics.KL_DEFINITION``, stated in the report as ``kl_definition``), the target mass outside the draft
vocab and the expected acceptance sum min(p, q) = 1 - TV(p, q) over the full vocab (all at T = 1;
``decoding.metrics``), weight bytes read per emitted
token, target forwards per token, tokens/s of speculative and plain decoding and their ratio,
``greedy_equal`` (prompts whose speculative output equals plain greedy output; T = 0 only) with the first
differing position and top-2 gap per prompt, prompt-lookup tau, and for a hybrid ``drafter_share`` (the head's,
prompt lookup's and both drafters' share of rounds and of accepted tokens, ``metrics.AcceptanceStats.share``) and
``hybrid`` (its lookup branch and which serving engines run such a hybrid). Byte and forward counts cover the
decode phase (after the prefill); tokens/s covers whole calls, prefill included. The text summary, TensorBoard
scalars and figures of a report are in ``draftkit.decoding.report``.

Shapes: n prompt tokens, k drafts per round, V target vocab, V_d draft vocab, H_t target hidden.
"""

from __future__ import annotations

import logging
import os
import platform
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from draftkit.data.prompts import Prompt, encode_prompt
from draftkit.decoding import cost
from draftkit.decoding.drafters import Drafter, PromptLookupDrafter
from draftkit.decoding.metrics import (
    DISTRIBUTION_METRICS,
    KL_DEFINITION,
    AcceptanceStats,
    acceptance_length,
    conditional_acceptance,
)
from draftkit.decoding.tree import HYBRID_ENGINES, Eagle3TreeDrafter, TreeConfig, generate_tree, parse_lookup
from draftkit.decoding.verify import Sync, generate_plain, generate_speculative
from draftkit.heads.checkpoint import check_head_matches_target
from draftkit.sampling import DecodeConfig, NonFiniteLogitsError, check_sampling
from draftkit.target.session import TargetSession
from draftkit.target.tokens import stop_token_ids

__all__ = [
    "Topology",
    "evaluate_drafter",
    "evaluate_head",
]

log = logging.getLogger(__name__)

NEAR_TIE = 1e-4  # a top-2 logit gap below this is a genuine tie at float32 round-off


# -- prompts ------------------------------------------------------------------------------------------------
def _as_prompts(prompts) -> list[Prompt]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            out.append(p)
        elif isinstance(p, str):
            out.append(Prompt(str(i), [{"role": "user", "content": p}]))
        elif isinstance(p, torch.Tensor):
            out.append(Prompt(str(i), ids=[int(x) for x in p.reshape(-1)]))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p):
            out.append(Prompt(str(i), list(p)))
        elif isinstance(p, (list, tuple)):
            out.append(Prompt(str(i), ids=[int(x) for x in p]))
        else:
            raise ValueError(f"prompt {i}: expected a string, messages, token ids or Prompt, got {type(p).__name__}")
    return out


# -- evaluation ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """One drafting configuration: a chain of k drafts per round (``tree`` None), or a tree or a hybrid with
    prompt lookup (``tree``; k = the most drafts a round can accept, ``TreeConfig.max_accept``)."""

    k: int
    tree: TreeConfig | None = None

    @classmethod
    def of(cls, tree: TreeConfig | None, k: int = 0) -> "Topology":
        """The topology of a tree (or of the chain k when ``tree`` is None)."""
        return cls(k) if tree is None else cls(tree.max_accept, tree)

    @property
    def name(self) -> str:
        tree = self.tree
        if tree is None:
            return f"chain k={self.k}"
        # a hybrid chain runs as a tree of one path; a plain chain shape spelled tree=D,1,D keeps the tree's name
        # (at T > 0 it verifies by the tree's rule, not the chain's: see decoding.tree)
        base = (f"chain k={tree.depth}" if tree.is_chain and tree.lookup else
                f"tree depth={tree.depth} topk={tree.topk} N={tree.num_nodes}")
        return base + (f" + {tree.lookup_mode}={tree.lookup}" if tree.lookup else "")

    @classmethod
    def parse(cls, text: str, option: str = "--sweep") -> "Topology":
        """``k=K`` (a chain of K drafts) or ``tree=D,K,N`` (``TreeConfig.parse``), either with a prompt-lookup
        hybrid suffix ``+lookup=L`` or ``+switch=L`` (``tree.parse_lookup``), e.g. ``k=2+lookup=8``.

        Raises:
            ValueError: naming ``option`` and the entry, on anything else.
        """
        kind, _, value = text.strip().partition("=")
        value, plus, extra = value.partition("+")
        if kind == "k" and value.isascii() and value.isdigit() and int(value) >= 1:
            if not plus:
                return cls(int(value))
            return cls.of(TreeConfig.chain(int(value), *parse_lookup(extra, f"{option} {text}")))
        if kind == "tree" and value:
            return cls.of(TreeConfig.parse(value + plus + extra, f"{option} {text}", auto=False))
        raise ValueError(f"{option}: {text!r} is not k=K (K >= 1) or tree=DEPTH,TOPK,N, each optionally with "
                         "+lookup=L or +switch=L")

    @classmethod
    def in_report(cls, report: dict) -> list["Topology"]:
        """Every topology a :func:`evaluate_drafter` report ran, the main one first (``--k auto``'s choice as it
        ran): the inverse of the ``k`` and ``tree`` keys it writes for each (the top level, or each ``sweep``
        entry)."""
        entries = report["sweep"] or [report]
        return [cls(e["k"], None if e["tree"] is None else TreeConfig(**e["tree"])) for e in entries]

    def report(self) -> dict | None:
        """The report's ``hybrid`` block: the prompt-lookup branch and the engines that run such a hybrid; None
        for the head alone."""
        tree = self.tree
        if tree is None or not tree.lookup:
            return None
        return {"lookup_tokens": tree.lookup, "mode": tree.lookup_mode, "lookup_ngram": PromptLookupDrafter().describe(),
                "engines": HYBRID_ENGINES}


class _Tally:
    """Totals of one topology over the prompts of an evaluation, and its part of the report."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.stats = AcceptanceStats(topology.k)
        self.tot: defaultdict[str, float] = defaultdict(float)
        self.rows: list[dict] = []
        self.equal = self.near_ties = 0

    def add(self, spec, plain, base: dict, greedy: bool) -> None:
        """One prompt's speculative result ``spec`` (and its plain run, or None; ``base``: the row's shared keys)."""
        self.stats.extend(spec.stats)
        for key, value in (("tokens", len(spec.tokens)), ("s", spec.seconds), ("decode_tokens", spec.decode_tokens),
                           ("bytes", spec.weight_bytes), ("forwards", spec.target_forwards),
                           ("draft_s", spec.draft_seconds), ("verify_s", spec.verify_seconds)):
            self.tot[key] += value
        row = {**base, "new_tokens": len(spec.tokens), "rounds": spec.stats.rounds, "tau": spec.stats.tau(),
               "tokens_per_s": len(spec.tokens) / spec.seconds}
        if plain is not None and greedy:
            diff = _first_diff(spec.tokens, plain.tokens)
            gap = plain.top2_gaps[diff] if diff is not None and diff < len(plain.top2_gaps) else None
            row.update(equal=diff is None, first_diff=diff, top2_gap=gap)
            self.equal += diff is None
            self.near_ties += diff is not None and gap is not None and gap < NEAR_TIE
        self.rows.append(row)

    def report(self, baseline_tps: float | None, plain_bytes: float, greedy_check: bool) -> dict:
        """The topology's report keys (those of the module docstring), ``topology`` and ``per_prompt``."""
        stats, tot, k, tree = self.stats, self.tot, self.topology.k, self.topology.tree
        alpha = stats.per_position()
        tokens_per_s = tot["tokens"] / tot["s"]
        return {
            "k": k,
            "tau": stats.tau(),
            "acceptance_per_position": alpha,
            "acceptance_rate": stats.rate(),
            **{f"{name}_per_position": stats.per_position_mean(name) for name in DISTRIBUTION_METRICS},
            "bytes_per_token": {"speculative": _safe_div(tot["bytes"], tot["decode_tokens"]), "plain": plain_bytes},
            "target_forwards_per_token": _safe_div(tot["forwards"], tot["decode_tokens"]),
            "tokens_per_s": tokens_per_s,
            "speedup": tokens_per_s / baseline_tps if baseline_tps else None,
            "greedy_equal": self.equal if greedy_check else None,
            "acceptance_conditional": conditional_acceptance(alpha) if alpha else None,
            "greedy_near_ties": self.near_ties if greedy_check else None,
            "rounds": stats.rounds,
            "new_tokens": int(tot["tokens"]),
            "draft_ms_per_round": 1000 * tot["draft_s"] / max(1, stats.rounds),
            "verify_ms_per_round": 1000 * tot["verify_s"] / max(1, stats.rounds),
            "tree": None if tree is None else {"depth": tree.depth, "topk": tree.topk, "num_nodes": tree.num_nodes,
                                               **({"lookup": tree.lookup, "lookup_mode": tree.lookup_mode}
                                                  if tree.lookup else {})},
            "verified_tokens_per_round": 1 + sum(stats.drafted) / max(1, stats.rounds),
            "accepted_length_histogram": [stats.accepted.count(a) for a in range(k + 1)],
            # which drafter proposed the verified and the accepted drafts (head, lookup, both); None for a chain
            "drafter_share": stats.share(),
            "hybrid": self.topology.report(),
            "topology": self.topology.name,
            "per_prompt": self.rows,
        }


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@contextmanager
def _naming_prompt(index: int, prompt: Prompt, target, drafter, stage: str = ""):
    """Re-raise a :class:`NonFiniteLogitsError` of the decoding inside with the prompt (index and id) and the
    target's and the drafter's dtypes, so that ``evaluate`` names which prompt produced NaN/inf logits."""
    try:
        yield
    except NonFiniteLogitsError as e:
        target_dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
        head = getattr(drafter, "dtype", None)
        head_dtype = f", head dtype {str(head).removeprefix('torch.')}" if head is not None else ""
        raise NonFiniteLogitsError(
            f"prompt {index} (id {prompt.id!r}){stage}: {e} [target dtype {target_dtype}{head_dtype}]",
            e.position, e.dtype,
        ) from e


def _safe_div(a: float, b: float) -> float | None:
    return a / b if b else None


def evaluate_drafter(
    drafter: Drafter,
    target,
    tokenizer,
    prompts,
    *,
    k: int = 5,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    seed: int = 0,
    chat_template: str | None = None,
    eos_token_ids: list[int] | None = None,
    baseline: bool = True,
    prompt_lookup: bool = True,
    collect_kl: bool = True,
    warmup: bool = True,
    tree: TreeConfig | None = None,
    auto: str | None = None,
    calibration_prompts: int = 4,
    calibration_tokens: int = 48,
    sweep: list[Topology] | None = None,
    trained_length: int | None = None,
    hybrid: bool = True,
    prompt_lookup_k: int | None = None,
    sync: Sync | None = None,
) -> dict:
    """Run plain, speculative and prompt-lookup decoding on every prompt and build the report.

    Args:
        drafter: any :class:`Drafter` (an ``Eagle3TreeDrafter``, or another engineer's drafter).
        target: a ``FrozenTarget``.
        tokenizer: the target's tokenizer (chat template, EOS); may be None when prompts are token ids and
            ``eos_token_ids`` is given.
        prompts: :class:`Prompt` objects, strings (one user turn), message lists or token-id lists.
        k: draft tokens per round.
        temperature, top_k, top_p: sampling (temperature 0 = greedy).
        max_new_tokens: per prompt.
        seed: prompt i samples with a generator seeded ``seed + i`` (the same for all three decoders).
        chat_template: a Jinja template, or None for the tokenizer's own.
        eos_token_ids: stop ids (None = ``draftkit.target.tokens.stop_token_ids``: the tokenizer's EOS and the
            target generation config's EOS ids).
        baseline: run plain decoding (needed for speedup and ``greedy_equal``).
        prompt_lookup: run the prompt-lookup baseline.
        collect_kl: record the distribution metrics per draft position (``kl``, ``outside_mass``,
            ``expected_accept``; ``decoding.metrics.distribution_metrics``; chains).
        warmup: one short untimed run of each decoder first.
        tree: draft a tree (``decoding.tree``; needs a drafter with ``propose_tree``) instead of a chain.
        auto: ``"k"`` or ``"tree"``: choose the chain k (or also trees) with ``decoding.cost`` from a
            greedy calibration on the first ``calibration_prompts`` prompts (``calibration_tokens`` each)
            and measured costs, then evaluate the choice (chain k = 1 as reference when plain wins);
            the report's ``auto`` holds the choice, its predicted and measured speedup and every prediction.
        sweep: more topologies to measure in the same run: on every prompt, after the one plain run, each
            topology decodes in turn (the chosen or given one first), so their ratios share the machine's
            load; the report's ``sweep`` lists each one's keys (as the top level's) with its own ``per_prompt``.
        trained_length: the head's trained sequence length (tokens), when recorded: a prompt whose tokens plus
            ``max_new_tokens`` exceed it is warned about (index, id, both lengths) and listed in the report's
            ``setup.prompts_over_trained_length``.
        hybrid: let ``auto`` also pick a hybrid of the head and prompt lookup (``TreeConfig.lookup``); off for a
            head served where no engine runs both (the report's ``hybrid.engines``).
        prompt_lookup_k: tokens per round of the prompt-lookup baseline (default: the main topology's k).
        sync: for a target sharded across the ranks, every rank decodes the same prompts and applies rank 0's
            tokens and rounds (``decoding.verify.Sync``), so that their collective forwards stay in lockstep; the
            report's tokens and acceptance are then rank 0's on every rank; chains, trees and hybrids (each rank
            verifies rank 0's tree), not ``auto``. None = a single process.

    Returns:
        The report dict (see the module docstring and :func:`main`).

    Raises:
        NonFiniteLogitsError: (a ValueError) when the target or the drafter produces NaN/inf logits, naming
            the prompt (index and id), the logits' position and the target's and the head's dtypes.
        ValueError: on an empty prompt list, k < 1, a bad sampling option, max_new_tokens < 1, an unknown
            ``auto``, ``sync`` with ``auto``, or a prompt that does not fit the
            target's context window (names the prompt): prompt + ``max_new_tokens`` + the depth that can run (k,
            the tree's depth, or with ``auto`` the deepest candidate it may pick), and for a calibration prompt
            prompt + ``calibration_tokens``.
    """
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    if auto not in (None, "k", "tree"):
        raise ValueError(f"auto must be None, 'k' or 'tree', got {auto!r}")
    check_sampling(temperature, top_k, top_p)
    if sync is not None and auto:
        raise ValueError("sync (a target sharded across the ranks) cannot run auto: its choice rests on each rank's "
                         "own timings; give the chain k, a tree or a sweep")
    prompts = _as_prompts(prompts)
    if not prompts:
        raise ValueError("no prompts to evaluate: the prompt list is empty")
    if eos_token_ids is None:
        eos_token_ids = stop_token_ids(tokenizer, getattr(target, "generation_config", None))
    cfg = DecodeConfig(max_new_tokens, temperature, top_k, top_p, tuple(eos_token_ids))
    session = TargetSession(target)
    device = next(target.parameters()).device
    depth, depth_name = _draft_depth(k, tree, auto, sweep or [])
    encoded = []
    over_trained: list[str] = []  # prompts whose prompt + new tokens exceed the head's trained length
    for i, p in enumerate(prompts):
        ids = encode_prompt(p, tokenizer, "chat", chat_template)
        if not ids:
            raise ValueError(f"prompt {p.id} is empty after templating; remove it from the prompt file")
        if trained_length and len(ids) + max_new_tokens > trained_length:
            over_trained.append(p.id)
            log.warning(
                "prompt %d (%s): %d tokens + max_new_tokens %d = %d exceed the head's trained length of %d tokens; "
                "its acceptance past that is untrained (heads trained on shorter sequences degrade there)",
                i, p.id, len(ids), max_new_tokens, len(ids) + max_new_tokens, trained_length,
            )
        need = len(ids) + max_new_tokens + depth
        if need > session.max_length:
            raise ValueError(
                f"prompt {p.id}: {len(ids)} tokens + max_new_tokens {max_new_tokens} + {depth_name} {depth} = {need} "
                f"does not fit the target's context window of {session.max_length} tokens; shorten it or lower "
                "--max_new_tokens"
            )
        if auto and i < calibration_prompts and len(ids) + calibration_tokens > session.max_length:
            raise ValueError(
                f"prompt {p.id}: {len(ids)} tokens + calibration_tokens {calibration_tokens} = "
                f"{len(ids) + calibration_tokens} does not fit the target's context window of {session.max_length} "
                "tokens; lower --calibration_tokens"
            )
        encoded.append(torch.tensor(ids, dtype=torch.long, device=device))

    def gen(i: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed + i)

    auto_report = None
    if auto:
        auto_report = _choose_topology(
            drafter, session, encoded, auto == "tree", calibration_prompts, calibration_tokens, cfg,
            lambda i: _naming_prompt(i, prompts[i], target, drafter, f" (--{auto} auto calibration)"), hybrid, gen)
        tree = auto_report.pop("_tree")
        k = tree.depth
    if tree is not None and tree.is_chain and not tree.lookup and auto:
        tree = None  # a chosen chain runs as the chain (the same drafts at T = 0)
    topologies = list(dict.fromkeys([Topology.of(tree, k), *(sweep or [])]))  # the main one first, no duplicates
    k = topologies[0].k
    if prompt_lookup_k is not None and prompt_lookup_k < 1:
        raise ValueError(f"prompt_lookup_k must be >= 1, got {prompt_lookup_k}")
    lookup_k = prompt_lookup_k or (tree.depth if tree is not None else k)

    def speculate(top: Topology, ids, run_cfg, g, kl=False):
        if top.tree is not None:
            return generate_tree(session, drafter, ids, top.tree, run_cfg, g, sync=sync)
        return generate_speculative(session, drafter, ids, top.k, run_cfg, g, collect_kl=kl, sync=sync)

    if warmup:
        short = DecodeConfig(min(4, max_new_tokens), temperature, top_k, top_p, cfg.eos_token_ids)
        with _naming_prompt(0, prompts[0], target, drafter, " (warm-up)"):
            generate_plain(session, encoded[0], short, gen(0), sync=sync)
            for top in topologies:
                speculate(top, encoded[0], short, gen(0))

    tallies = [_Tally(t) for t in topologies]
    lookup_stats = AcceptanceStats(lookup_k)
    tot: defaultdict[str, float] = defaultdict(float)  # plain and prompt-lookup totals over prompts
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        base: dict[str, Any] = {"id": p.id, "prompt_tokens": int(ids.numel())}
        plain = None
        with _naming_prompt(i, p, target, drafter):
            if baseline:
                plain = generate_plain(session, ids, cfg, gen(i), record_gaps=cfg.greedy, sync=sync)
                tot["plain_tokens"] += len(plain.tokens)
                tot["plain_s"] += plain.seconds
                tot["plain_decode_tokens"] += plain.decode_tokens
                tot["plain_decode_s"] += plain.seconds - plain.prefill_seconds
                base["baseline_new_tokens"] = len(plain.tokens)
                base["baseline_tokens_per_s"] = len(plain.tokens) / plain.seconds
            for tally in tallies:  # every topology on this prompt before the next: load hits all alike
                tally.add(speculate(tally.topology, ids, cfg, gen(i), collect_kl), plain, base, cfg.greedy)
            if prompt_lookup:
                lookup = generate_speculative(session, PromptLookupDrafter(), ids, lookup_k, cfg, gen(i), sync=sync)
                lookup_stats.extend(lookup.stats)
                tot["lookup_tokens"] += len(lookup.tokens)
                tot["lookup_s"] += lookup.seconds
                tallies[0].rows[-1]["prompt_lookup_tau"] = lookup.stats.tau()
        log.info("prompt %d/%d (%s): tau %s, %d tokens", i + 1, len(prompts), p.id, tallies[0].rows[-1]["tau"],
                 tallies[0].rows[-1]["new_tokens"])

    baseline_tps = _safe_div(tot["plain_tokens"], tot["plain_s"]) if baseline else None
    plain_bytes = float(session.weight_bytes)
    results = [t.report(baseline_tps, plain_bytes, baseline and cfg.greedy) for t in tallies]
    threads = torch.get_num_threads()
    if auto_report is not None:
        auto_report["measured_speedup"] = 1.0 if auto_report["choice"] == "plain" else results[0]["speedup"]
    main = results[0]
    report = {
        "num_prompts": len(prompts),
        "temperature": temperature,
        **{key: value for key, value in main.items() if key not in ("topology", "per_prompt")},
        "kl_definition": KL_DEFINITION,
        "baseline_tokens_per_s": baseline_tps,
        "prompt_lookup_tau": lookup_stats.tau() if prompt_lookup else None,
        # extras beyond the keys
        "prompt_lookup_tau_drafted": lookup_stats.tau_drafted() if prompt_lookup else None,
        "prompt_lookup_tokens_per_s": _safe_div(tot["lookup_tokens"], tot["lookup_s"]) if prompt_lookup else None,
        "plain_ms_per_token": _safe_div(1000 * tot["plain_decode_s"], tot["plain_decode_tokens"]) if baseline else None,
        "auto": auto_report,
        # every topology of a sweep, the first being the one above, with the same keys and its own per_prompt
        "sweep": results if len(results) > 1 else None,
        "setup": {
            "engine": f"draftkit (torch {torch.__version__})",
            "topology": main["topology"],
            "batch_size": 1,
            "top_k": top_k,
            "top_p": top_p,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
            "trained_length": trained_length,
            "prompts_over_trained_length": over_trained,
            "device": str(device),
            "hardware": f"{platform.machine()} {os.cpu_count()} cpus, {threads} torch threads",
            "cpu": cpu_name() if torch.device(device).type == "cpu" else None,  # the summary names the device else
            "prompt_lookup_k": lookup_k if prompt_lookup else None,
        },
        "per_prompt": main["per_prompt"],
    }
    return report


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where there is one, else ``platform.processor()``) and the vector
    instruction set torch dispatches to (``torch.backends.cpu.get_cpu_capability()``), e.g.
    ``"Intel(R) Xeon(R) ... (AVX512)"``."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def _draft_depth(k: int, tree: TreeConfig | None, auto: str | None, sweep: list[Topology]) -> tuple[int, str]:
    """Most drafts one round can add past the output, for the context-window check, and its name.

    A round's verify reaches position L + depth (the drafts of a chain, a tree's longest path), so a prompt
    needs prompt + max_new_tokens + depth positions. ``auto`` picks its topology only after a calibration, so
    the deepest candidate it may pick (``cost.candidate_topologies``) is checked up front, not the k passed in;
    a deeper ``sweep`` entry sets the depth instead.
    """
    if auto:
        depth = max(t.max_accept for t in cost.candidate_topologies(auto == "tree", lookups=HYBRID_LOOKUPS))
        name = f"the deepest --{auto} auto depth"
    elif tree is not None:
        depth, name = tree.max_accept, "tree depth"
    else:
        depth, name = k, "k"
    deepest = max(sweep, key=lambda t: t.k, default=None)
    if deepest is not None and deepest.k > depth:
        return deepest.k, f"--sweep {deepest.name} depth"
    return depth, name


SAMPLED_SHORTLIST = 3
"""At T > 0, how many of the best shapes by the greedy prediction ``--k/--tree auto`` decode at the temperature
(with the best chain) before it picks (``cost`` module docstring)."""

HYBRID_LOOKUPS = (4, 8)
"""Prompt-lookup continuation lengths (tokens) of the hybrids ``--k auto`` / ``--tree auto`` rate."""


def choice_name(tree: TreeConfig) -> str:
    """The report's ``auto.choice`` of a topology: ``chain k=K`` or ``D,K,N``, with its hybrid suffix
    (``chain k=2+lookup=8``)."""
    return (f"chain k={tree.depth}" if tree.is_chain else f"{tree.depth},{tree.topk},{tree.num_nodes}") + tree.suffix


def _choose_topology(drafter, session, encoded, tree: bool, prompts: int, tokens: int, cfg: DecodeConfig,
                     naming=None, hybrid: bool = True, gen=None) -> dict:
    """Measure costs, calibrate tau and pick with ``decoding.cost`` (among the head's shapes and, with ``hybrid``,
    their prompt-lookup hybrids of :data:`HYBRID_LOOKUPS` tokens); at T > 0 the greedy prediction shortlists
    :data:`SAMPLED_SHORTLIST` shapes and the best chain, decoded at the run's temperature with ``gen(i)``
    (``cost.calibrate_sampled``) for the pick; the report's ``auto`` block (``naming``: see ``cost.Naming``)."""
    if prompts < 1 or tokens < 2:
        raise ValueError(f"calibration needs >= 1 prompt and >= 2 tokens, got {prompts}, {tokens}")
    topologies = cost.candidate_topologies(tree, lookups=HYBRID_LOOKUPS if hybrid else ())
    head_rows = {t.num_nodes + 1 for t in topologies}
    rows = sorted(head_rows | {n + t.lookup for n in head_rows for t in topologies if t.lookup})
    costs = cost.measure_costs(session, drafter, encoded[0], rows, sorted({t.topk for t in topologies}))
    sequences = cost.greedy_sequences(session, encoded[:prompts], tokens, cfg.eos_token_ids, naming)
    played = cost.calibrate_rounds(drafter, session, sequences, topologies, naming)
    shortlist = None
    if not cfg.greedy:
        greedy = cost.predict({t: acceptance_length([p.accepted for p in rounds]) for t, rounds in played.items()},
                              costs, {t: cost.round_seconds(t, rounds, costs) for t, rounds in played.items()})
        chain = next(p.tree for p in greedy if p.tree.is_chain and not p.tree.lookup)
        shortlist = list(dict.fromkeys([p.tree for p in greedy[:SAMPLED_SHORTLIST]] + [chain]))
        short = DecodeConfig(tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.eos_token_ids)
        played = cost.calibrate_sampled(drafter, session, encoded[:prompts], short, gen, shortlist, naming)
    taus = {t: acceptance_length([p.accepted for p in rounds]) for t, rounds in played.items()}
    seconds = {t: cost.round_seconds(t, rounds, costs) for t, rounds in played.items()}
    predictions = cost.predict(taus, costs, seconds)
    best = cost.choose(predictions)
    session.pad_rows = costs.padding()  # every later forward (plain and speculative) runs the cheapest cover
    log.info("auto: %s; verify rows padded %s", "plain decoding" if best is None else
             f"{best.tree} (predicted {best.speedup:.3f}x)", session.pad_rows or "nowhere")
    return {
        "_tree": TreeConfig.chain(1) if best is None else best.tree,
        "choice": "plain" if best is None else choice_name(best.tree),
        "predicted_speedup": 1.0 if best is None else best.speedup,
        "calibration": {"prompts": len(sequences), "tokens": tokens, "temperature": cfg.temperature,
                        "sampled": None if shortlist is None else [choice_name(t) for t in shortlist]},
        "verify_padding": dict(session.pad_rows),  # {rows: rows run}
        "costs_ms": {"verify": {n: 1000 * s for n, s in costs.verify.items()}, "draft_first": 1000 * costs.first,
                     "draft_step": {w: 1000 * s for w, s in costs.step.items()},
                     "draft_step_measured": {w: 1000 * s for w, s in costs.measured["step"].items()}},
        "predictions": [p.as_dict() for p in predictions],
    }


def evaluate_head(head, target, tokenizer, prompts, *, check: bool = True, **kwargs) -> dict:
    """Evaluate an EAGLE3 head against its target; see :func:`evaluate_drafter` for the options.

    The head runs in its own dtype and device (its step-0 features are cast to it); it is put in eval mode
    for the call and its previous mode restored. ``check``: run :func:`check_head_matches_target` first (False
    for a head its loader checked, ``export.head_target.load_head_and_target``: each load is checked once).

    Raises:
        ValueError: if the head does not match the target (names both), and as :func:`evaluate_drafter`.
    """
    if check:
        check_head_matches_target(head, target)
    was_training = head.training
    head.eval()
    try:
        return evaluate_drafter(Eagle3TreeDrafter(head), target, tokenizer, prompts, **kwargs)
    finally:
        head.train(was_training)
