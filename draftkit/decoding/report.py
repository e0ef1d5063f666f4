"""What ``draftkit evaluate`` shows of a report (``draftkit.decoding.harness.evaluate_head``): the fixed-width text
summary, the TensorBoard scalars and the figures (acceptance per draft position; tau and tokens/s against the
topology for ``--k auto`` / ``--tree auto`` predictions and for a ``--sweep``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from draftkit.decoding.metrics import DISTRIBUTION_METRICS

__all__ = ["format_summary", "write_tensorboard"]


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_summary(report: dict) -> str:
    """A fixed-width summary table of a report."""
    alpha = report["acceptance_per_position"] or []
    kl = report["kl_per_position"] or []
    lines = [
        (f"draftkit evaluate: {report['num_prompts']} prompts, {report['setup']['topology']}, T={report['temperature']}, "
         f"{report['setup']['target_dtype']}, {report['setup']['hardware']}"),
        f"  tau (bonus counted)        {_fmt(report['tau'])}",
        f"  acceptance rate            {_fmt(report['acceptance_rate'])}",
        f"  speculative tokens/s       {_fmt(report['tokens_per_s'], '.2f')}",
        f"  plain tokens/s             {_fmt(report['baseline_tokens_per_s'], '.2f')}",
        f"  speedup                    {_fmt(report['speedup'], '.3f')}x",
        f"  target forwards / token    {_fmt(report['target_forwards_per_token'])}",
        (f"  MB read / token spec|plain {_fmt((report['bytes_per_token']['speculative'] or 0) / 1e6, '.1f')} | "
         f"{report['bytes_per_token']['plain'] / 1e6:.1f}"),
        (f"  greedy_equal               {'-' if report['greedy_equal'] is None else report['greedy_equal']}"
         f"/{report['num_prompts']} (near-ties among the rest: {_fmt(report['greedy_near_ties'], 'd')})"),
        f"  prompt-lookup tau          {_fmt(report['prompt_lookup_tau'])}",
        "  position  " + " ".join(f"{i:>7d}" for i in range(1, len(alpha) + 1)),
        "  alpha_i   " + " ".join(f"{a:7.3f}" for a in alpha),
    ]
    if kl:
        lines.append("  KL_i      " + " ".join(f"{_fmt(x):>7s}" for x in kl) + "   (draft vocab, target renormalised)")
        lines.append("  outside_i " + " ".join(f"{_fmt(x):>7s}" for x in report["outside_mass_per_position"])
                     + "   (target mass outside the draft vocab)")
        lines.append("  E[acc]_i  " + " ".join(f"{_fmt(x):>7s}" for x in report["expected_accept_per_position"])
                     + "   (sum min(p, q) = 1 - TV, T = 1)")
    lines.append(f"  verified tokens / round    {_fmt(report['verified_tokens_per_round'], '.2f')}")
    auto = report.get("auto")
    if auto:
        lines.append(f"  auto choice                {auto['choice']}: predicted {_fmt(auto['predicted_speedup'])}x, "
                     f"measured {_fmt(auto['measured_speedup'])}x")
    if report.get("sweep"):
        lines.append("  sweep (same prompts, interleaved)   tau  tokens/s  speedup  verified/round  greedy_equal")
        for r in report["sweep"]:
            eq = "-" if r["greedy_equal"] is None else f"{r['greedy_equal']}/{report['num_prompts']}"
            lines.append(f"    {r['topology']:<30s} {_fmt(r['tau']):>6s} {_fmt(r['tokens_per_s'], '.2f'):>9s} "
                         f"{_fmt(r['speedup']):>8s} {_fmt(r['verified_tokens_per_round'], '.2f'):>15s} {eq:>13s}")
    lines += _what_you_get(report)
    return "\n".join(lines)


def _share(r: dict) -> str:
    """``rounds head 80% lookup 15% both 5%, accepted 70/25/5``: a hybrid's drafter share (``metrics``)."""
    share = r.get("drafter_share")
    if not share or not r.get("hybrid"):
        return ""
    rounds = " ".join(f"{name} {100 * f:.0f}%" for name, f in share["rounds"].items())
    acc = "/".join("-" if f is None else f"{100 * f:.0f}" for f in share["accepted_tokens"].values())
    return f"  rounds {rounds}; accepted % head/lookup/both {acc}"


def _what_you_get(report: dict) -> list[str]:
    """Per drafter, in the timed dtype, on the named CPU: tokens/s and the ratio to plain decoding, with each
    hybrid's drafter share and the float32 losslessness."""
    setup = report["setup"]
    plain = report["baseline_tokens_per_s"]
    if plain is None:
        return []
    dtype = setup["target_dtype"] + (f" (head {setup['draft_dtype']})" if setup.get("draft_dtype") not in
                                     (None, setup["target_dtype"]) else "")
    lines = [f"  what you get: {setup.get('cpu') or setup['device']}, {setup['hardware']}, {dtype}, batch 1, "
             f"{setup['max_new_tokens']} new tokens",
             f"    {'plain decoding':<36s} {plain:8.2f} tokens/s  1.000x"]
    lookup = report.get("prompt_lookup_tokens_per_s")
    if lookup:
        lines.append(f"    {'prompt lookup k=%s (no training)' % setup.get('prompt_lookup_k', report['k']):<36s} "
                     f"{lookup:8.2f} tokens/s  {lookup / plain:.3f}x  tau {_fmt(report['prompt_lookup_tau'])}")
    for r in report.get("sweep") or [dict(report, topology=setup["topology"])]:
        lines.append(f"    {r['topology']:<36s} {_fmt(r['tokens_per_s'], '8.2f')} tokens/s  {_fmt(r['speedup'])}x  "
                     f"tau {_fmt(r['tau'])}{_share(r)}")
    auto = report.get("auto")
    if auto:
        lines.append(f"    cost model's pick: {auto['choice']}")
    return lines


def write_tensorboard(report: dict, log_dir: str | Path, step: int = 0, prefix: str = "eval") -> None:
    """Scalars ``{prefix}/tau``, ``{prefix}/accept_rate_pos{i}``, ... and a per-position acceptance plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.utils.tensorboard import SummaryWriter

    scalars = {
        "tau": report["tau"], "acceptance_rate": report["acceptance_rate"], "speedup": report["speedup"],
        "tokens_per_s": report["tokens_per_s"], "baseline_tokens_per_s": report["baseline_tokens_per_s"],
        "prompt_lookup_tau": report["prompt_lookup_tau"], "target_forwards_per_token": report["target_forwards_per_token"],
    }
    alpha = report["acceptance_per_position"] or []
    for i, a in enumerate(alpha, 1):
        scalars[f"accept_rate_pos{i}"] = a
    for name in DISTRIBUTION_METRICS:
        for i, x in enumerate(report[f"{name}_per_position"] or [], 1):
            scalars[f"{name}_pos{i}"] = x
    with SummaryWriter(str(log_dir)) as writer:
        for name, value in scalars.items():
            if value is not None:
                writer.add_scalar(f"{prefix}/{name}", value, step)
        fig, ax = plt.subplots(figsize=(5, 3.2))
        pos = list(range(1, len(alpha) + 1))
        ax.bar(pos, alpha, color="tab:blue")
        ax.set(xlabel="draft position i", ylabel="alpha_i (rounds with a >= i)", ylim=(0, 1), xticks=pos,
               title=f"chain k={report['k']}, T={report['temperature']}, tau={_fmt(report['tau'])}")
        fig.tight_layout()
        writer.add_figure(f"{prefix}/acceptance_per_position", fig, step)
        plt.close(fig)
        auto = report.get("auto")
        if auto:
            points = [(tuple(int(x) for x in p["tree"].split("+")[0].split(",")), p["chain"], p)
                      for p in auto["predictions"]]
            fig = _topology_figure(points, "predicted",
                                   f"cost model: choice {auto['choice']}, predicted {auto['predicted_speedup']:.2f}x", plt)
            writer.add_figure(f"{prefix}/auto_tau_and_tokens_per_s", fig, step)
            plt.close(fig)
        if report.get("sweep"):
            points = []
            for r in report["sweep"]:
                tree = r["tree"] or {"depth": r["k"], "topk": 1, "num_nodes": r["k"]}
                chain = tree["topk"] == 1 and tree["num_nodes"] == tree["depth"]
                hybrid = f"+{tree['lookup_mode']}={tree['lookup']}" if tree.get("lookup") else None
                points.append(((tree["depth"], tree["topk"], tree["num_nodes"]), chain, dict(r, hybrid=hybrid)))
                for key in ("tau", "speedup"):
                    if r[key] is not None:  # no round (every prompt stopped at once), no baseline
                        writer.add_scalar(f"{prefix}/sweep/{r['topology'].replace(' ', '_')}/{key}", r[key], step)
            fig = _topology_figure(points, "measured", f"sweep: {report['num_prompts']} prompts", plt)
            writer.add_figure(f"{prefix}/sweep_tau_and_tokens_per_s", fig, step)
            plt.close(fig)


def _topology_figure(points, what: str, title: str, plt):
    """tau and tokens/s against chain k, and against N for each tree (depth, top-k).

    Args:
        points: ((depth, top-k, N), is_chain, {"tau": ..., "tokens_per_s": ..., "hybrid": suffix or None}) per
            topology; a hybrid (``+lookup=8``) gets its own line.
        what: "predicted" or "measured" (axis labels).
    """
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), squeeze=False)
    lines: dict[str, list] = defaultdict(list)
    for shape, chain, p in points:
        d, tk, n = shape
        name = ("chain" if chain else f"depth {d} top-k {tk}") + (p.get("hybrid") or "")
        lines[name].append((d if chain else n, p))
    for name, pts in sorted(lines.items()):
        pts.sort(key=lambda x: x[0])
        col = 0 if name.startswith("chain") else 1
        for row, key in enumerate(("tau", "tokens_per_s")):
            axes[row][col].plot([x for x, _ in pts], [p[key] for _, p in pts], marker="o", label=name)
    for col, xlabel in enumerate(("chain k", "tree N (verified nodes)")):
        for row, ylabel in enumerate((f"tau ({what})", f"tokens/s ({what})")):
            axes[row][col].set(xlabel=xlabel, ylabel=ylabel)
        axes[0][col].legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
