"""Learning curve: MT-bench acceptance length τ against training tokens, from the TensorBoard logs of ``fit`` runs.

A run logs ``val/accept_len`` (real speculative decoding on MT-bench first turns, bonus token counted) when its
recipe has ``draftkit.callbacks.acceptance.AcceptanceLengthMonitor`` (as ``recipes/smollm2-135m-eagle3-long.yaml``
does), ``val/tau_sim`` at every validation, and ``train/tokens_trained`` (real tokens so far, all ranks) at every
logged step. Each validation point is placed at the tokens trained by its step. Prints the table and writes one
PNG (and, with ``--tensorboard``, the figure into that TensorBoard directory).

Run:  python benchmarks/learning_curve.py LABEL=RUN_DIR [LABEL=RUN_DIR ...] --output benchmarks/results/learning_curve.png
      (RUN_DIR: a ``lightning_logs/version_N`` directory, or any directory above one event file; or
      ``FILE.json:KEY``, the curve KEY of an earlier output's JSON, to draw a run whose logs are gone)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METRICS = ("val/accept_len", "val/tau_sim")


def read_run(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a run: ``{tag: [(step, value), ...]}`` for ``train/tokens_trained`` and ``METRICS``.

    Raises:
        FileNotFoundError: if ``run_dir`` holds no TensorBoard event file.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(run_dir.rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no TensorBoard event file (events.out.tfevents.*) below it")
    out: dict[str, list[tuple[int, float]]] = {}
    for f in files:  # a resumed run may write several files
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in ("train/tokens_trained", *METRICS):
            if tag in acc.Tags().get("scalars", []):
                out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(dict(v).items()) for tag, v in out.items()}


def curve(scalars: dict[str, list[tuple[int, float]]], metric: str) -> list[tuple[int, float, float]]:
    """``[(step, tokens, value)]`` of ``metric``: tokens = the last ``train/tokens_trained`` logged at or before
    the step (0 before the first one)."""
    tokens = scalars.get("train/tokens_trained", [])
    rows = []
    for step, value in scalars.get(metric, []):
        before = [t for s, t in tokens if s <= step]
        rows.append((step, before[-1] if before else 0.0, value))
    return rows


def read_table(path: str) -> dict[str, list[tuple[int, float, float]]]:
    """``{metric: [(step, tokens, value)]}`` of a run: from its event files, or ``FILE.json:KEY`` of an earlier
    output (the curves are stored there, not the logs).

    Raises:
        FileNotFoundError: a run directory without event files, or a missing JSON file.
        KeyError: a JSON file without that KEY (naming the keys it has).
    """
    file, sep, key = path.rpartition(":")
    if sep and file.endswith(".json"):
        table = json.loads(Path(file).read_text())
        if key not in table:
            raise KeyError(f"{file} has no curve {key!r}; it has {', '.join(table)}")
        return {m: [tuple(r) for r in table[key].get(m, [])] for m in METRICS}
    scalars = read_run(Path(path))
    return {m: curve(scalars, m) for m in METRICS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR or LABEL=FILE.json:KEY")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/learning_curve.png"))
    p.add_argument("--tensorboard", type=Path, default=None, help="also log the figure to this TensorBoard dir")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"{spec!r}: give each run as LABEL=RUN_DIR or LABEL=FILE.json:KEY")
        table[label] = read_table(path)
    # one panel per metric some run logged (val/accept_len needs the AcceptanceLengthMonitor callback)
    shown = [m for m in METRICS if any(rows[m] for rows in table.values())]
    if not shown:
        p.error(f"no run logged any of {', '.join(METRICS)}: did it validate?")
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4), squeeze=False)
    for ax, m in zip(axes[0], shown):
        for label, rows in table.items():
            if rows[m]:
                ax.plot([t / 1e6 for _, t, _ in rows[m]], [v for _, _, v in rows[m]], marker="o", label=label)
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel({"val/accept_len": "MT-bench τ (speculative decoding)", "val/tau_sim": "val/tau_sim"}[m])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=120)
    if args.tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(args.tensorboard)) as w:
            w.add_figure("learning_curve", fig)
    for label, rows in table.items():
        for m, pts in rows.items():
            print(f"{label} {m}: " + ", ".join(f"step {s} ({t / 1e6:.3f} M tokens) {v:.3f}" for s, t, v in pts))
    args.output.with_suffix(".json").write_text(json.dumps(table, indent=1))
    print(f"wrote {args.output} and {args.output.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
