"""The layer-analysis report behind ``draftkit select-layers`` and the ``LayerSelection`` callback
(layer-analysis.md §8).

:func:`run_layer_analysis` runs the target over assistant positions of the training data, computes per-layer
matrix entropy and the layer-by-layer CKA, scores every k-subset and writes a JSON report (ids are HF
``hidden_states`` indices), two PNG figures beside it and the same figures to TensorBoard.

Report keys: ``num_tokens`` (rows analysed after filtering), ``entropy_filter``, ``layer_ids``,
``layer_entropy_h1``, ``layer_entropy_h2`` (lists aligned with ``layer_ids``), ``cka`` (matrix aligned with
``layer_ids``), ``top_subsets`` (ids + scores, best first), ``chosen``, ``heuristic`` (ids + scores),
``heuristic_rank`` (rank of [2, N//2, N-3] among all C(N-1, k) subsets by closed-form H2(S)), plus the
filters, preprocessing, constraints, CKA blocks, ``entropy_sweep`` (the same statistics and choice at more
entropy quantiles, from the same pass), runtime (wall and process CPU seconds) and peak memory.

Shapes: P = N - 1 candidate layers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import resource
import time
from pathlib import Path

import torch

from draftkit.analysis.collect import LayerAnalysisConfig, LayerStatistics, collect_layer_statistics
from draftkit.analysis.plots import cka_heatmap, entropy_curve, log_figures, save_figure
from draftkit.analysis.subsets import Selection, select_subsets
from draftkit.jsonio import write_json_atomic

__all__ = ["build_report", "chat_batches", "peak_rss_mb", "run_layer_analysis", "write_report"]

log = logging.getLogger(__name__)

PREPROCESSING = "row-normalise (z / ||z||_2, fp32), then center; moments accumulated in fp64 (layer-analysis.md §3)"


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (``resource.getrusage``; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _r(x: float | None, nd: int = 6):
    return None if x is None else round(float(x), nd)


def _sweep_entry(level: LayerStatistics, config: LayerAnalysisConfig) -> dict:
    """Statistics and choice at one ``entropy_sweep`` quantile."""
    sel = select_subsets(
        level.layer_ids, level.h1, level.h2, level.cka, level.num_layers, k=config.k,
        exact_entropy=level.concat_entropies, rerank_top=config.rerank_top, one_per_block=config.one_per_block,
        require_late_layer=config.require_late_layer, min_layer_id=config.min_layer_id,
    )
    return {
        "quantile": level.entropy["quantile"], "threshold_nats": level.entropy["threshold_nats"],
        "kept_fraction": level.entropy["kept_fraction"], "num_tokens": level.num_rows,
        "layer_entropy_h1": [_r(v) for v in level.h1.tolist()],
        "layer_entropy_h2": [_r(v) for v in level.h2.tolist()],
        "cka": [[_r(v) for v in row] for row in level.cka.tolist()],
        "cka_rows": level.cka_rows,
        "top_subsets": [x.as_dict() for x in sel.top[:5]],
        "chosen": sel.chosen,
        "heuristic": None if sel.heuristic is None else sel.heuristic.as_dict(),
        "heuristic_rank": sel.heuristic_rank,
        "cka_blocks": sel.blocks,
    }


def build_report(stats: LayerStatistics, selection: Selection, config: LayerAnalysisConfig, meta: dict | None = None,
                 sweep: list[dict] | None = None) -> dict:
    """The JSON-ready report of one analysis.

    Args:
        stats: the collected statistics.
        selection: the subset choice.
        config: the analysis options.
        meta: extra provenance (target, data, dtype, device, ...).
        sweep: entries of the ``entropy_sweep`` levels.

    Returns:
        A dict with the keys listed in the module docstring.
    """
    h1 = [_r(v) for v in stats.h1.tolist()]
    h2 = [_r(v) for v in stats.h2.tolist()]
    cka = [[_r(v) for v in row] for row in stats.cka.tolist()]
    entropy_filter = dict(stats.entropy)
    entropy_filter["removed_low_entropy"] = stats.counts["low_entropy"]
    return {
        "num_tokens": stats.num_rows,
        "entropy_filter": entropy_filter,
        "layer_ids": stats.layer_ids,
        "layer_entropy_h1": h1,
        "layer_entropy_h2": h2,
        "effective_rank": [_r(math.exp(v), 3) for v in stats.h1.tolist()],
        "cka": cka,
        "top_subsets": [s.as_dict() for s in selection.top],
        "chosen": selection.chosen,
        "heuristic": None if selection.heuristic is None else selection.heuristic.as_dict(),
        "heuristic_rank": selection.heuristic_rank,
        "heuristic_rank_allowed": selection.heuristic_rank_allowed,
        "num_subsets": selection.num_subsets,
        "num_allowed_subsets": selection.num_allowed,
        "extra_sets": [s.as_dict() for s in selection.extra],
        "cka_blocks": selection.blocks,
        "cka_method": stats.cka_method,
        "cka_minibatches": stats.cka_batches,
        "cka_rows": stats.cka_rows if stats.cka_method == "minibatch" else None,
        "cka_batch_size": config.cka_batch_size if stats.cka_method == "minibatch" else None,
        "concat_entropy_route": stats.concat_route,
        "scores": {
            "screen": "closed-form H2(S) of the equally weighted concatenation (layer-analysis.md §5.1)",
            "rerank": "exact H1(S) (§5.2), top rerank_top by the screen; chosen = best H1(S)",
        },
        "preprocessing": PREPROCESSING,
        "filters": {
            "rows": config.rows,
            "skip_first": config.skip_first,
            "sink_factor": config.sink_factor,
            "sink_medians": None if stats.sink_medians is None else [_r(v, 4) for v in stats.sink_medians.tolist()],
            "counts": stats.counts,
        },
        "constraints": {
            "k": config.k, "min_layer_id": config.min_layer_id, "one_per_block": config.one_per_block,
            "require_late_layer": config.require_late_layer,
        },
        "num_layers": stats.num_layers,
        "hidden_size": stats.hidden_size,
        "seed": config.seed,
        "config": dataclasses.asdict(config),
        "meta": meta or {},
        "runtime": dict(stats.timings),
        "entropy_sweep": sweep or [],
    }


def write_report(report: dict, path: str | Path) -> None:
    """Write the report JSON atomically (``draftkit.jsonio.write_json_atomic``)."""
    write_json_atomic(path, report, indent=1)


def run_layer_analysis(
    model: torch.nn.Module,
    batches,
    config: LayerAnalysisConfig,
    exclude_token_ids: list[int] | tuple[int, ...] = (),
    output: str | Path | None = None,
    writer=None,
    meta: dict | None = None,
    extra_sets: list[list[int]] | None = None,
    device: str | torch.device | None = None,
) -> dict:
    """Collect, select and report: the shared body of the command and the ``LayerSelection`` callback.

    Args:
        model: Hugging Face Llama-style ``*ForCausalLM`` (the target).
        batches: iterable of ``input_ids`` / ``attention_mask`` / ``loss_mask`` (B, T) batches.
        config: analysis options.
        exclude_token_ids: token ids whose rows are dropped (BOS).
        output: report path; the figures go beside it as ``<stem>_cka.png`` and ``<stem>_entropy.png``.
            None writes nothing.
        writer: a TensorBoard ``SummaryWriter`` for the figures (tags ``analysis/cka``,
            ``analysis/entropy``), or None.
        meta: provenance stored in the report.
        extra_sets: more layer sets to score (e.g. a control set).
        device: where the target runs.

    Returns:
        The report dict (also written to ``output``).

    Raises:
        ValueError: see :func:`collect_layer_statistics` and :func:`select_subsets` (too few rows, k too
            large, NaN/inf states, a set that repeats a layer).
    """
    t0 = time.perf_counter()
    stats = collect_layer_statistics(model, batches, config, exclude_token_ids=exclude_token_ids, device=device)
    t1 = time.perf_counter()
    selection = select_subsets(
        stats.layer_ids, stats.h1, stats.h2, stats.cka, stats.num_layers, k=config.k,
        exact_entropy=stats.concat_entropies, rerank_top=config.rerank_top, one_per_block=config.one_per_block,
        require_late_layer=config.require_late_layer, min_layer_id=config.min_layer_id, extra_sets=extra_sets,
    )
    sweep = [level if isinstance(level, dict) else _sweep_entry(level, config) for level in stats.sweep]
    stats.timings["selection_s"] = round(time.perf_counter() - t1, 2)
    stats.timings["total_s"] = round(time.perf_counter() - t0, 2)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats.timings["process_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    stats.timings["peak_rss_mb"] = round(peak_rss_mb(), 1)
    report = build_report(stats, selection, config, meta, sweep)
    heur = None if selection.heuristic is None else selection.heuristic.ids
    curves = {
        f"H1, keep {x['kept_fraction']:.2f} (q={x['quantile']})": x["layer_entropy_h1"] for x in sweep if "error" not in x
    }
    figures = {
        "analysis/cka": cka_heatmap(stats.cka.numpy(), stats.layer_ids, selection.chosen, heur, selection.blocks,
                                    title=f"linear CKA ({stats.cka_method}), n={stats.num_rows}"),
        "analysis/entropy": entropy_curve(stats.layer_ids, stats.h1.numpy(), stats.h2.numpy(), stats.hidden_size,
                                          selection.chosen, heur, title=f"matrix entropy versus depth, n={stats.num_rows}",
                                          extra_h1=curves),
    }
    if writer is not None:
        log_figures(writer, figures)
        writer.flush()
    if output is not None:
        output = Path(output)
        save_figure(figures["analysis/cka"], output.with_name(f"{output.stem}_cka.png"))
        save_figure(figures["analysis/entropy"], output.with_name(f"{output.stem}_entropy.png"))
        write_report(report, output)
    log.info(
        "layer analysis: chosen %s; heuristic %s ranks %s of %d by H2(S); n=%d rows, %.0f s",
        selection.chosen, heur, selection.heuristic_rank, selection.num_subsets, stats.num_rows,
        stats.timings["total_s"],
    )
    return report


def chat_batches(data: str, tokenizer, chat_template: str | None = None, max_length: int = 2048,
                 batch_size: int = 1, max_conversations: int = 5000):
    """Stand-in loader for the command: the first conversations of a chat source, tokenized on demand.

    Uses the lead's readers (``draftkit.data.chat``) and collate, but tokenizes only what is consumed, where
    ``ChatDataModule`` first tokenizes and caches the whole source; swap in its loader when that cost is paid
    anyway (the ``LayerSelection`` callback does).

    Args:
        data: data reference (see ``ChatDataModule.path``).
        tokenizer: the target's fast tokenizer.
        chat_template: Jinja template, or None for the tokenizer's.
        max_length: tokens per sequence (longer ones are truncated).
        batch_size: sequences per batch.
        max_conversations: conversations read from the start of the source.

    Yields:
        dicts of ``input_ids``, ``attention_mask``, ``loss_mask``: (B, T) int64, right-padded.
    """
    from draftkit.artifacts import resolve_artifact
    from draftkit.data.chat import TemplateError, read_conversations, tokenize_conversation
    from draftkit.data.collate import collate
    from draftkit.target.tokens import pad_token_id

    conversations, summary = read_conversations(resolve_artifact(data, "data"), max_records=max_conversations)
    log.info("%s", summary)
    pad = pad_token_id(tokenizer)
    rows, skipped = [], 0
    for messages in conversations:
        try:
            row = tokenize_conversation(tokenizer, messages, chat_template, max_length)
        except TemplateError:
            skipped += 1
            continue
        if sum(row["loss_mask"]) == 0:
            continue
        rows.append(row)
        if len(rows) == batch_size:
            yield collate(rows, pad)
            rows = []
    if rows:
        yield collate(rows, pad)
    if skipped:
        log.warning("skipped %d conversations the chat template cannot mask", skipped)
