"""A head's validation metrics on the old row split and on the grouped split (issue 33 item 1).

The old split drew ``data.val_size`` rows by a seeded permutation with no deduplication, so a validation
conversation could share its first prompt with training rows ("continue", "Please continue", ...); the grouped
split (``draftkit.data.splits``, the datamodule's default now) drops context-free and duplicate prompts and puts
no prompt on both sides. This script validates one head on four sets: the old split, its leaked rows (prompt also
in training), its clean rows, and the grouped split, and prints ``val/tau_sim``, ``val/acc_k`` and ``val/loss``.

For a head trained on the old split, ``old_clean`` is its honest figure: ``grouped``'s rows were mostly among its
training rows. For a head trained on the grouped split, ``grouped`` is.

Run:  python benchmarks/validation_split.py --recipe recipes/smollm2-135m-eagle3-long.yaml \
          --head checkpoints/smollm2-135m-eagle3-head --output benchmarks/results/validation_split.json
      (online: the target runs on each validation batch; ``--head`` takes an export directory or a ``.ckpt``)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def old_row_split(ds, val_size: int, seed: int) -> tuple[list[int], list[int]]:
    """The datamodule's split before the grouped one: ``val_size`` rows of a seeded permutation of all rows.

    Returns:
        ``(train_rows, val_rows)``, ``val_rows`` ascending.
    """
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()
    return order[val_size:], sorted(order[:val_size])


def validation_sets(dm) -> dict[str, list[int]]:
    """Row indices of the tokenized data for each set: ``old``, ``old_leaked``, ``old_clean``, ``grouped``."""
    ds, _ = dm._load_or_build()
    keys = ds["prompt_key"]
    train, val = old_row_split(ds, dm.hparams.val_size, dm.hparams.seed)
    seen = {keys[i] for i in train}
    _, grouped, _ = dm._split(ds)
    return {
        "old": val,
        "old_leaked": [i for i in val if keys[i] in seen],
        "old_clean": [i for i in val if keys[i] not in seen],
        "grouped": grouped,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--head", required=True, help="export directory or .ckpt of the head to validate")
    ap.add_argument("--output", default=None, help="JSON file for the table")
    args = ap.parse_args(argv)

    import lightning.pytorch as pl

    from draftkit.cli import DraftkitCLI
    from draftkit.export.load import load_head

    cli = DraftkitCLI(args=["--recipe", args.recipe, "--data.hidden_states_cache", "null"], run=False)
    dm, model = cli.datamodule, cli.model
    dm.setup("fit")
    model.build(dm)
    head, meta = load_head(args.head, model.hparams.target)
    head.load_embedding(model.target.input_embeddings().float())  # heads are stored without the target's embedding
    model.head = head.float()
    sets = validation_sets(dm)
    ds, _ = dm._load_or_build()
    results = {"recipe": args.recipe, "head": args.head, "cpu": torch.backends.cpu.get_cpu_capability(),
               "target_dtype": str(model.resolve_target_dtype()), "sets": {}}
    for name, rows in sets.items():
        dm.val_set = ds.select(rows).select_columns(["input_ids", "loss_mask", "record"])
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, precision=cli.trainer.precision)
        metrics = trainer.validate(model, datamodule=dm, verbose=False)[0]
        row = {"conversations": len(rows), **{k: round(float(v), 4) for k, v in sorted(metrics.items())}}
        results["sets"][name] = row
        print(f"{name:>11}: {len(rows):3d} conversations, " + ", ".join(
            f"{k.removeprefix('val/')} {v}" for k, v in row.items() if k.startswith("val/")), flush=True)
    if args.output:
        from draftkit.jsonio import write_json_atomic

        write_json_atomic(Path(args.output), results)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
