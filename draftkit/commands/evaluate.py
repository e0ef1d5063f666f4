"""``draftkit evaluate``: acceptance length and speedup of a trained head on MT-bench or a prompt file.

The harness (plain, speculative and prompt-lookup decoding per prompt, the report keys) is
``draftkit.decoding.harness``, the float32 lossless check ``draftkit.decoding.lossless``; this verb loads the head
and its target (checked once per load), runs them, and writes the report.

Shapes: none (a command).
"""

from __future__ import annotations

import logging
from typing import Literal, Optional, Union

__all__ = ["evaluate"]

log = logging.getLogger(__name__)


def evaluate(
    checkpoint: str,
    output: str,
    prompts: str = "mt-bench",
    k: Union[int, Literal["auto"], None] = None,
    tree: Optional[str] = None,
    calibration_prompts: int = 4,
    calibration_tokens: int = 48,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    num_prompts: Optional[int] = None,
    dtype: str = "auto",
    draft_dtype: Optional[str] = None,
    target: Optional[str] = None,
    seed: int = 0,
    threads: Optional[int] = None,
    baseline: bool = True,
    prompt_lookup: bool = True,
    tensorboard: Optional[str] = None,
    sweep: Optional[str] = None,
    lossless_check: bool = True,
    kernels: str = "auto",
    device: str = "auto",
    hybrid: bool = True,
    prompt_lookup_k: Optional[int] = None,
    device_map: Optional[str] = None,
) -> dict:
    """Measure acceptance length tau and speedup of a draft head on prompts (chain or EAGLE-2 tree drafting).

    Args:
        checkpoint: training .ckpt or exported head directory.
        output: report JSON path (written atomically).
        prompts: mt-bench (80 first turns), or a .jsonl / .json / .txt prompt file.
        k: draft tokens per round (chain; default 5 when no ``tree`` is given), or auto: the cost model
            (``decoding.cost``) picks k from measured target/draft costs and a greedy calibration (and, with
            ``hybrid``, whether prompt lookup joins it). ``k`` and ``tree`` are one topology each: give one (more
            topologies in one run: ``sweep``).
        tree: ``depth,topk,N``: tree drafting (EAGLE-2 rule, N draft nodes verified in one target forward), or
            auto: the cost model picks among chains and trees (or plain decoding when nothing pays; at
            ``temperature`` > 0 its best few shapes by the greedy calibration are decoded at that temperature
            before it picks: a tree's fixed drafts are accepted with the target's probability of each, not
            min(1, p/q) as a chain's sampled ones). A suffix
            ``+lookup=L`` joins a prompt-lookup continuation of up to L tokens to the head's draft as one more
            branch, verified in the same forward; ``+switch=L`` drafts the lookup continuation instead of the
            head's in the rounds that have one (``decoding.tree``). Chains take the suffix in ``--sweep``
            (``k=2+lookup=8``) or as ``--tree 2,1,2+lookup=8``.
        calibration_prompts: auto: the first prompts used to calibrate.
        calibration_tokens: auto: tokens decoded per calibration prompt (greedy, or sampled at ``temperature``).
        temperature: sampling temperature; 0 = greedy.
        top_k: top-k sampling; 0 = off.
        top_p: nucleus sampling; 1 = off.
        max_new_tokens: generated tokens per prompt.
        num_prompts: first N prompts (default: all).
        dtype: target dtype: auto (bfloat16 where this CPU computes it fast, else float32), float32 (the exact
            lossless check), bfloat16 or float16.
        draft_dtype: head dtype (default: dtype).
        target: target reference (default: the checkpoint's).
        seed: sampling seed (prompt i uses seed + i).
        threads: torch CPU threads (default: torch's).
        baseline: also run plain decoding (speedup, greedy_equal).
        prompt_lookup: also run prompt-lookup drafting.
        tensorboard: write TensorBoard scalars and the acceptance plot here.
        sweep: more topologies measured in the same run, space-separated ``k=K`` and ``tree=D,K,N`` entries, each
            optionally with ``+lookup=L`` or ``+switch=L`` (e.g. "k=1 k=2 tree=5,4,16 k=2+lookup=8"): each prompt
            runs plain decoding once, then every topology, so their speedups share the machine's load; the report's
            ``sweep`` holds each one's keys (a hybrid's ``drafter_share``: the head's, prompt lookup's and both
            drafters' share of rounds and of accepted tokens).
        lossless_check: at temperature 0 with the baseline, when the timed dtype is not float32: decode every
            prompt again in float32 (plain and each topology that ran, untimed) and report ``lossless``:
            ``greedy_equal`` there, its dtype and near ties. Speed is what users see in their fast dtype, where
            batched verification may round differently from one-row decoding; losslessness is a float32 property.
            At float32 the timed run's ``greedy_equal`` is the check.
        kernels: the target's and the draft head's linear kernels (``draftkit.kernels``): auto
            (prepacked oneDNN weights where a probe measures them faster on this CPU and dtype, else stock), onednn
            or stock, or compiled (the target's decoder stack under ``torch.compile``, the LM head and the draft
            head packed as auto decides; compiling takes minutes before the first prompt, never chosen by auto);
            the report's ``setup.kernels`` (target) and ``setup.head_kernels`` say which ran, why, and the packed
            copies' bytes. ``--k auto``/``--tree auto`` calibrate on the kernels that run; the float32
            losslessness pass of a compiled run uses auto's kernels (a second compile would cost minutes more).
        device: where the target and the head run: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N;
            the precision policy and the kernels decide for that device.
        hybrid: let ``--k auto`` / ``--tree auto`` pick a hybrid of the head and prompt lookup; turn off for a head
            served by an engine that cannot run both in one server (the report's ``hybrid.engines``: llama.cpp
            can, with ``--spec-type draft-eagle3,ngram-mod``; vLLM, SGLang and TensorRT-LLM not yet).
        prompt_lookup_k: tokens per round of the prompt-lookup baseline (default: the main topology's k or depth).
        device_map: a target larger than one GPU: accelerate places its layers across the visible GPUs as it
            loads (Hugging Face's ``device_map``: ``auto``, ``balanced``, ``balanced_low_0`` or ``sequential``),
            and each target forward runs them in turn (pipeline placement, one GPU busy at a time, so the speed is
            that of one GPU plus the transfers; an engine with tensor parallelism serves such a target faster);
            the head runs on the GPU of the target's input embedding. None: the whole target on ``device``.
            ``--kernels compiled`` is refused with it.

    Returns:
        The report dict (see ``draftkit.decoding.harness``).

    Raises:
        ValueError, OSError: on bad options, unreadable files, or a head that does not match the target.
    """
    import torch

    from draftkit.data.prompts import load_prompts
    from draftkit.decoding.harness import Topology, evaluate_head
    from draftkit.decoding.lossless import lossless_block, lossless_pass
    from draftkit.decoding.report import format_summary, write_tensorboard
    from draftkit.export.head_target import load_head_and_target
    from draftkit.jsonio import check_writable, write_json_atomic
    from draftkit.precision import DTYPES, precision_record, resolve_device, resolve_dtype, set_threads
    from draftkit.sampling import DecodeConfig
    from draftkit.decoding.tree import TreeConfig
    from draftkit.kernels.option import use_kernels

    if k is not None and tree is not None:
        raise ValueError(f"--k {k} and --tree {tree} are two topologies: give one (the other is not run); measure "
                         f"both in one run with --sweep \"k={k} tree={tree}\"" if "auto" not in (k, tree) else
                         f"--k {k} and --tree {tree}: give one (--tree auto rates chains too)")
    k = 5 if k is None else k
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"--k must be >= 1 (an integer) or auto, got {k!r}")
    check_writable(output, "--output")  # before decoding, not after
    auto = "tree" if tree == "auto" else ("k" if k == "auto" else None)
    tree_config = TreeConfig.parse(tree) if tree not in (None, "auto") else None
    k = 5 if k == "auto" else k
    sweep_list = [Topology.parse(entry) for entry in sweep.split()] if sweep else None
    DecodeConfig(max_new_tokens, temperature, top_k, top_p)  # its option checks, before anything loads
    for opt, value in (("dtype", dtype), ("draft_dtype", draft_dtype)):
        if value is not None and value not in DTYPES:
            raise ValueError(f"--{opt} must be one of {', '.join(DTYPES)}, got {value!r}")
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise ValueError(f"--device_map must be one of {', '.join(DEVICE_MAPS)}, got {device_map!r}")
    if device_map is not None and kernels == "compiled":
        raise ValueError("--kernels compiled compiles a target on one device; with --device_map use auto or stock")
    device = resolve_device(device)
    device_type = torch.device(device).type
    precision = precision_record(dtype, device_type)
    dtype = precision["dtype"]
    draft_dtype = resolve_dtype(draft_dtype, device_type, "--draft_dtype") if draft_dtype else dtype
    set_threads(threads)
    prompt_list = load_prompts(prompts, num_prompts)
    head, frozen, tokenizer, meta, target_ref = load_head_and_target(checkpoint, target, dtype, device, draft_dtype,
                                                                     device_map=device_map)
    with use_kernels(kernels, frozen, head) as applied:
        report = evaluate_head(
            head, frozen, tokenizer, prompt_list, k=k, temperature=temperature, top_k=top_k, top_p=top_p,
            max_new_tokens=max_new_tokens, seed=seed, chat_template=meta.get("chat_template"), baseline=baseline,
            prompt_lookup=prompt_lookup, tree=tree_config, auto=auto, calibration_prompts=calibration_prompts,
            calibration_tokens=calibration_tokens, sweep=sweep_list, trained_length=meta.get("trained_length"),
            hybrid=hybrid, prompt_lookup_k=prompt_lookup_k, check=False,  # load_head_and_target checked it
        )
        kernels_record = {"kernels": applied.target.as_dict(), "head_kernels": applied.head.as_dict()}
    if not meta.get("trained_length"):
        log.info("head %s records no trained length (trained before draftkit stored it): prompt lengths not checked",
                 checkpoint)
    report["setup"].update(dataset=prompts, checkpoint=str(checkpoint), head_fingerprint=meta["head_fingerprint"],
                           target=target_ref, device_map=_placement(frozen, device_map),
                           draft_dtype=draft_dtype, precision=precision, **kernels_record)
    if lossless_check and baseline and temperature == 0:
        if dtype == draft_dtype == "float32":  # the timed run is the check
            report["lossless"] = lossless_block(report, "timed run")
        else:  # both again in float32, the timed copies freed first (compiled: auto's kernels, not a second compile)
            del head, frozen
            head, frozen, tokenizer, _, _ = load_head_and_target(checkpoint, target_ref, "float32", device,
                                                                 device_map=device_map)
            with use_kernels("auto" if kernels == "compiled" else kernels, frozen, head):
                report["lossless"] = lossless_pass(
                    head, frozen, tokenizer, prompt_list, Topology.in_report(report), max_new_tokens=max_new_tokens,
                    seed=seed, chat_template=meta.get("chat_template"), check=False,
                )
    write_json_atomic(output, report)
    if tensorboard:
        write_tensorboard(report, tensorboard)
    print(format_summary(report))
    if report.get("lossless"):
        ll = report["lossless"]
        print(f"lossless ({ll['dtype']}, {ll['source']}): greedy_equal {ll['greedy_equal']}/{report['num_prompts']}"
              f" (speed above in {dtype})")
    print(f"report: {output}")
    return report


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
"""``--device_map`` values: accelerate's placement strategies (``transformers`` ``from_pretrained(device_map=)``)."""


def _placement(frozen, device_map: str | None) -> dict | None:
    """The report's ``setup.device_map``: the strategy and how many decoder layers landed on each device; None
    for a target on one device."""
    if device_map is None:
        return None
    from collections import Counter

    where = getattr(frozen.model, "hf_device_map", None) or {}
    if not where or set(where) == {""}:  # everything landed on one device
        device = where.get("", next(frozen.model.parameters()).device)
        return {"strategy": device_map, "decoder_layers_per_device": {str(device): frozen.num_layers}}
    layers = Counter(str(dev) for name, dev in where.items() if ".layers." in f".{name}.")
    return {"strategy": device_map, "decoder_layers_per_device": dict(sorted(layers.items()))}
