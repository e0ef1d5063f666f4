"""The lossless check of ``draftkit evaluate``: speculative decoding at temperature 0 emits exactly the tokens of
plain greedy decoding, for every topology that ran.

Speed is measured in the dtype users serve in (bfloat16 where the device computes it fast), where the batched
verify forward may round differently from one-row decoding and flip a near-tie; losslessness is a float32
property. So when the timed run was not float32, the head and the target are loaded again in float32 and
:func:`lossless_pass` decodes every prompt, untimed, with plain decoding and with each topology (the harness's
``greedy_equal``, ``decoding.harness``); at float32 the timed run's own ``greedy_equal`` is the check
(:func:`lossless_block`). Speculative sampling (Leviathan et al., arXiv 2211.17192) is lossless in distribution;
at temperature 0 that is token-for-token equality, up to genuine ties of the target's top-2 logits
(``greedy_near_ties``: a gap below ``harness.NEAR_TIE``).

Shapes: none (decoding runs in ``decoding.harness``).
"""

from __future__ import annotations

from collections.abc import Sequence

from draftkit.decoding.harness import Topology, evaluate_head

__all__ = ["lossless_block", "lossless_pass"]


def lossless_block(report: dict, source: str) -> dict:
    """The report's ``lossless`` block, read from a harness report that ran plain decoding at temperature 0.

    Args:
        report: an :func:`~draftkit.decoding.harness.evaluate_drafter` report (its ``greedy_equal`` set).
        source: where the equality was measured: ``timed run`` or ``float32 pass``.

    Returns:
        ``{"dtype": the target's dtype name, "source", "greedy_equal": prompts equal for the main topology,
        "greedy_near_ties": int, "per_topology": [{"topology", "greedy_equal", "greedy_near_ties"}, ...]}``
        (the main topology first, then every ``sweep`` entry).
    """
    entries = report["sweep"] or [report]
    return {"dtype": report["setup"]["target_dtype"], "source": source, "greedy_equal": report["greedy_equal"],
            "greedy_near_ties": report["greedy_near_ties"],
            "per_topology": [{"topology": e.get("topology", report["setup"]["topology"]),
                              "greedy_equal": e["greedy_equal"], "greedy_near_ties": e["greedy_near_ties"]}
                             for e in entries]}


def lossless_pass(
    head,
    target,
    tokenizer,
    prompts,
    topologies: Sequence[Topology],
    *,
    max_new_tokens: int = 128,
    seed: int = 0,
    chat_template: str | None = None,
    check: bool = True,
) -> dict:
    """Decode every prompt greedily with plain decoding and with each topology, untimed (no warm-up, no KL, no
    prompt lookup), and return the :func:`lossless_block` of that run.

    Args:
        head: an ``Eagle3LlamaHead``, in the dtype to check (float32 for ``draftkit evaluate``).
        target: its ``FrozenTarget``, in that dtype.
        tokenizer, prompts, chat_template: as :func:`~draftkit.decoding.harness.evaluate_drafter`.
        topologies: the topologies to check, the main one first (e.g. what a timed run ran:
            :meth:`Topology.in_report`).
        max_new_tokens: tokens per prompt (the timed run's, so the same tokens are compared).
        seed: as the timed run's (greedy decoding draws nothing; kept for identical runs).
        check: run ``check_head_matches_target`` (False where the loader checked this head already).

    Returns:
        :func:`lossless_block` with source ``<dtype> pass``.

    Raises:
        ValueError: on an empty ``topologies``, and as :func:`~draftkit.decoding.harness.evaluate_head`.
    """
    if not topologies:
        raise ValueError("lossless_pass: no topology to check")
    report = evaluate_head(
        head, target, tokenizer, prompts, k=topologies[0].k, tree=topologies[0].tree, temperature=0.0,
        max_new_tokens=max_new_tokens, seed=seed, chat_template=chat_template, baseline=True, prompt_lookup=False,
        collect_kl=False, warmup=False, sweep=list(topologies[1:]) or None, check=check,
    )
    return lossless_block(report, f"{report['setup']['target_dtype']} pass")
