"""Figures of the layer analysis: the CKA heatmap and entropy versus depth (matplotlib, no pyplot state).

Shapes: P candidate layers.
"""

from __future__ import annotations

from pathlib import Path

from draftkit.jsonio import atomic_path

__all__ = ["cka_heatmap", "entropy_curve", "log_figures", "save_figure"]


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def cka_heatmap(cka, layer_ids: list[int], chosen: list[int] | None = None, heuristic: list[int] | None = None,
                blocks: list[list[int]] | None = None, title: str = "linear CKA between layers"):
    """Heatmap of the (P, P) CKA matrix; chosen ids marked with circles, heuristic ids with crosses.

    Args:
        cka: (P, P) array-like.
        layer_ids: the P ids labelling rows and columns.
        chosen: ids to mark on the diagonal.
        heuristic: ids to mark on the diagonal.
        blocks: CKA depth blocks (lists of ids), drawn as squares.
        title: axes title.

    Returns:
        A matplotlib ``Figure``.
    """
    import math

    import numpy as np
    from matplotlib.patches import Rectangle

    c = np.asarray(cka, dtype=float)
    fig = _figure(7.0, 6.0)
    ax = fig.add_subplot()
    vmin = max(0.0, math.floor(float(c.min()) * 20) / 20)  # 0.05 steps: keep the structure of high-CKA matrices visible
    im = ax.imshow(c, vmin=vmin, vmax=1.0, cmap="viridis", origin="upper")
    fig.colorbar(im, ax=ax, label="CKA")
    step = max(1, len(layer_ids) // 15)
    ticks = list(range(0, len(layer_ids), step))
    ax.set_xticks(ticks, [str(layer_ids[i]) for i in ticks])
    ax.set_yticks(ticks, [str(layer_ids[i]) for i in ticks])
    ax.set_xlabel("layer id (HF hidden_states index)")
    ax.set_ylabel("layer id")
    pos = {lid: i for i, lid in enumerate(layer_ids)}
    for block in blocks or []:
        a, b = pos[block[0]], pos[block[-1]]
        ax.add_patch(Rectangle((a - 0.5, a - 0.5), b - a + 1, b - a + 1, fill=False, edgecolor="white", lw=1.5))
    if heuristic:
        xs = [pos[i] for i in heuristic if i in pos]
        ax.scatter(xs, xs, marker="x", s=70, c="red", label=f"heuristic {heuristic}")
    if chosen:
        xs = [pos[i] for i in chosen if i in pos]
        ax.scatter(xs, xs, marker="o", s=90, facecolors="none", edgecolors="orange", linewidths=2,
                   label=f"chosen {chosen}")
    if chosen or heuristic:
        ax.legend(loc="lower left", fontsize=8)
    ax.set_title(title)
    return fig


def entropy_curve(layer_ids: list[int], h1, h2, dim: int | None = None, chosen: list[int] | None = None,
                  heuristic: list[int] | None = None, title: str = "matrix entropy versus depth",
                  extra_h1: dict | None = None):
    """H1 and H2 (nats) per layer id, with the chosen (solid) and heuristic (dashed) ids marked.

    Args:
        layer_ids: P ids.
        h1: (P,) array-like.
        h2: (P,) array-like.
        dim: d; draws log d, the maximum entropy, when given.
        chosen: ids to mark.
        heuristic: ids to mark.
        title: axes title.
        extra_h1: more H1 curves, label -> (P,) values (e.g. at other entropy-filter levels), drawn thin.

    Returns:
        A matplotlib ``Figure``.
    """
    import math

    fig = _figure(7.0, 4.0)
    ax = fig.add_subplot()
    ax.plot(layer_ids, list(map(float, h1)), marker="o", ms=3, label="H1 (von Neumann)")
    ax.plot(layer_ids, list(map(float, h2)), marker="s", ms=3, label="H2 (collision)")
    for label, values in (extra_h1 or {}).items():
        ax.plot(layer_ids, list(map(float, values)), lw=0.9, ls="-.", label=label)
    if dim:
        ax.axhline(math.log(dim), color="grey", lw=0.8, ls=":", label=f"log d = {math.log(dim):.2f}")
    for i in chosen or []:
        ax.axvline(i, color="orange", lw=1.2)
    for i in heuristic or []:
        ax.axvline(i, color="red", lw=1.0, ls="--")
    ax.set_xlabel("layer id (HF hidden_states index; orange = chosen, red dashed = heuristic)")
    ax.set_ylabel("entropy (nats)")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return fig


def save_figure(fig, path: str | Path) -> None:
    """Write a PNG atomically (``draftkit.jsonio.atomic_path``: temporary file, fsync, ``os.replace``)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def log_figures(writer, figures: dict, step: int = 0) -> None:
    """``writer.add_figure(tag, fig, step)`` for each tag (a TensorBoard ``SummaryWriter``)."""
    for tag, fig in figures.items():
        writer.add_figure(tag, fig, global_step=step, close=False)
