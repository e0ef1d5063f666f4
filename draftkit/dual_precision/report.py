"""The dual-precision report: its answer check, quantization record, text summary, TensorBoard figures and
strict-JSON form (what ``draftkit evaluate-dual-precision`` writes beside ``evaluate``'s report of
``draftkit.dual_precision.evaluate``).

Shapes: none (reports).
"""

from __future__ import annotations

import math
import re
from typing import Callable

__all__ = ["answer_checker", "final_number", "format_summary", "json_safe", "quant_record", "write_tensorboard"]


def final_number(text: str) -> str | None:
    """The last number of an answer (after the last ``####``, GSM8K's answer mark, when there is one), without
    thousands separators or a trailing period; None when it has no number."""
    text = text.split("####")[-1]
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def answer_checker(tokenizer, prompts) -> Callable[[int, list[int]], bool] | None:
    """``is_correct(i, tokens)`` comparing the :func:`final_number` of the decoded tokens with prompt i's
    reference ``answer``, or None unless every prompt has one (``draftkit.data.prompts.Prompt``)."""
    if not all(p.answer is not None for p in prompts):
        return None

    def is_correct(i: int, tokens: list[int]) -> bool:
        got = final_number(tokenizer.decode(tokens, skip_special_tokens=True))
        return got is not None and got == final_number(str(prompts[i].answer))

    return is_correct


def quant_record(quant, lm) -> dict:
    """The report's ``quant`` block of a ``QuantConfig`` and the target session it quantized (its
    ``precision_layers``)."""
    return {"include": list(quant.include), "quantize_lm_head": quant.quantize_lm_head,
            "slicing": quant.slicing, "scheme": quant.scheme, "group_size": quant.group_size,
            "code_range": quant.code_range if quant.scheme == "asymmetric" else None,
            "num_quantized_linears": len(lm.precision_layers)}


def json_safe(obj):
    """nan/inf -> None (strict JSON), recursively through dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def format_summary(report: dict) -> str:
    """The report's text summary: the replay line, catch rates at a 15 % budget, one row per method."""
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
