"""A dual-precision evaluation of a target reference: the library behind ``draftkit evaluate-dual-precision``.

:func:`evaluate_target` loads the target, puts the precision switch on it (int8 codes per output channel or group
and their 4-bit slices, ``draftkit.quant``; ``TargetSession.with_precision_switch``), applies the linear kernels
to the float layers left, encodes the calibration and evaluation prompts with the target's tokenizer (chat
template or plain text), runs :func:`~draftkit.dual_precision.evaluate.evaluate_dual_precision` and completes
its report with what ran. Choosing and splitting the prompts, and writing the report, are the command's.

Shapes: P prompts, n generated tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from draftkit.data.prompts import Prompt, encode_prompt, resolve_template
from draftkit.dual_precision.evaluate import DualPrecisionConfig, evaluate_dual_precision
from draftkit.dual_precision.report import answer_checker, quant_record
from draftkit.kernels.linears import KERNELS
from draftkit.kernels.option import use_kernels
from draftkit.quant import QuantConfig
from draftkit.target.frozen import load_target
from draftkit.target.session import TargetSession
from draftkit.target.tokens import stop_token_ids

__all__ = ["evaluate_target"]

log = logging.getLogger(__name__)


def evaluate_target(
    target: str,
    evaluation: Sequence[Prompt],
    calibration: Sequence[Prompt],
    config: DualPrecisionConfig,
    quant: QuantConfig,
    *,
    dtype: str = "float32",
    template: str = "auto",
    kernels: str = "auto",
    record: str | None = None,
) -> dict:
    """Dual-precision evaluation of ``target`` on prompts (dual-precision.md §4-7).

    1. Load the target in ``dtype`` and quantize its decoder linears (``quant``) into one two-precision session.
    2. Apply ``kernels`` to the ``nn.Linear`` layers quantization left (the 16-bit LM head, or none).
    3. Resolve ``template`` for the tokenizer and encode both prompt lists; the stop ids are the tokenizer's and
       the generation config's.
    4. :func:`evaluate_dual_precision` with the answer check of ``dual_precision.report``, resuming from
       ``record``, whose header holds the target, dtype, template and quantization (not the kernels: a resumed run
       may use others).

    Args:
        target: target reference (local dir, hub id, ``pypi:``, ``chunks:``).
        evaluation: evaluation prompts.
        calibration: calibration prompts, disjoint from ``evaluation`` (unused with fixed thresholds).
        config: the evaluation's knobs.
        quant: the int8 scheme, slicing and group size.
        dtype: compute dtype, resolved (``float32``, ``bfloat16`` or ``float16``).
        template: ``chat``, ``plain`` or ``auto`` (chat when the tokenizer has a template).
        kernels: ``auto``, ``onednn`` or ``stock`` (``draftkit.kernels.option``).
        record: per-prompt JSONL record path, or None.

    Returns:
        :func:`evaluate_dual_precision`'s report plus ``kernels``, ``target``, ``dtype``, ``template`` (the one
        used), ``record``, ``quant`` (``report.quant_record``) and ``timing_s.load_and_quantize`` (seconds).

    Raises:
        ValueError: naming ``--target`` when it cannot carry a precision switch, ``--kernels`` when unknown, and as
            :func:`evaluate_dual_precision` (e.g. a record of another run).
    """
    t_load = time.perf_counter()
    model, tokenizer = load_target(target, dtype)
    try:
        lm = TargetSession.with_precision_switch(model, quant)
    except ValueError as err:
        raise ValueError(f"--target {target}: {err}") from err
    applied = use_kernels(kernels, model, options=KERNELS)  # after quantizing: only the float linears left are packed
    t_load = time.perf_counter() - t_load
    eos = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    chosen = resolve_template(template, tokenizer, target)
    if template == "auto":
        log.info("--template auto: %s (the tokenizer %s)", chosen,
                 "has a chat template" if chosen == "chat" else "has no chat template")
    quant_report = quant_record(quant, lm)
    eval_ids = [encode_prompt(p, tokenizer, chosen) for p in evaluation]
    calib_ids = [encode_prompt(p, tokenizer, chosen) for p in calibration]
    with applied:
        report = evaluate_dual_precision(
            lm, eval_ids, calib_ids, config, eos, answer_checker(tokenizer, evaluation), record=record,
            record_header={"target": target, "dtype": dtype, "template": chosen, "quant": quant_report},
        )
        report["kernels"] = applied.target.as_dict()
    report.update(target=target, dtype=dtype, template=chosen, record=record, quant=quant_report)
    report["timing_s"]["load_and_quantize"] = t_load
    return report
