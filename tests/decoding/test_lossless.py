"""The lossless check (``draftkit.decoding.lossless``) on the tiny target: speculative greedy output equals plain
greedy output for every topology, whatever the head drafts."""

import dataclasses

import pytest
import torch
from decoding_stubs import make_head

from draftkit.decoding.harness import Topology, evaluate_head
from draftkit.decoding.lossless import lossless_block, lossless_pass
from draftkit.decoding.tree import TreeConfig
from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead

PROMPTS = ["Tell me a story.", "abc abc abc abc", "hi"]
TOPOLOGIES = [Topology(3), Topology(1), Topology.parse("tree=2,2,3"), Topology.parse("k=2+lookup=4")]


def test_topologies_of_a_report_round_trip_and_the_pass_equals_plain_greedy(tiny):
    """The topologies a report ran come back typed (chain, tree, hybrid), and the pass over them finds every
    prompt equal, as the timed run's own greedy_equal does (both float32 here)."""
    target, tokenizer = tiny
    head = make_head(target)
    report = evaluate_head(head, target, tokenizer, PROMPTS, k=3, sweep=TOPOLOGIES[1:], max_new_tokens=8,
                           prompt_lookup=False, warmup=False, collect_kl=False)
    assert Topology.in_report(report) == TOPOLOGIES
    assert TOPOLOGIES[3].tree == TreeConfig(2, 1, 2, lookup=4)
    block = lossless_pass(head, target, tokenizer, PROMPTS, Topology.in_report(report), max_new_tokens=8)
    assert block == {**lossless_block(report, "timed run"), "source": "float32 pass"}
    assert block["dtype"] == "float32" and block["greedy_equal"] == len(PROMPTS)
    assert [t["topology"] for t in block["per_topology"]] == [
        "chain k=3", "chain k=1", "tree depth=2 topk=2 N=3", "chain k=2 + lookup=4"]
    assert all(t["greedy_equal"] == len(PROMPTS) for t in block["per_topology"])


def test_a_head_that_always_drafts_wrong_still_decodes_losslessly(tiny):
    """A head whose LM head is zeroed drafts one fixed token every time, which the target never emits here: no
    draft is accepted (tau 1: the bonus token alone), and the output is still plain greedy's, prompt for prompt."""
    target, tokenizer = tiny
    head = make_head(target)
    with torch.no_grad():
        head.lm_head.weight.zero_()
    chain = [Topology(3)]
    report = evaluate_head(head, target, tokenizer, PROMPTS, k=3, max_new_tokens=8, prompt_lookup=False,
                           warmup=False, collect_kl=False)
    assert report["acceptance_rate"] == 0.0 and report["tau"] == 1.0
    block = lossless_pass(head, target, tokenizer, PROMPTS, chain, max_new_tokens=8)
    assert block["greedy_equal"] == len(PROMPTS) and block["per_topology"][0]["greedy_equal"] == len(PROMPTS)


def test_the_pass_checks_the_head_and_needs_a_topology(tiny):
    target, tokenizer = tiny
    fields = dataclasses.asdict(make_head(target).config)
    other = Eagle3LlamaHead(Eagle3Config(**{**fields, "vocab_size": 300}))  # a head for another target
    with pytest.raises(ValueError, match=r"head V=300, target V=320"):
        lossless_pass(other, target, tokenizer, PROMPTS[:1], [Topology(2)], max_new_tokens=2)
    with pytest.raises(ValueError, match="no topology"):
        lossless_pass(make_head(target), target, tokenizer, PROMPTS[:1], [], max_new_tokens=2)
