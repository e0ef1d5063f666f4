"""Host syncs in one training step (issue 32 item 4): ops that make a GPU wait for the host, counted on the CPU.

A ``TorchDispatchMode`` counts the aten ops that copy a device value to the host or size a tensor by its data:
``_local_scalar_dense`` (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``), ``nonzero`` (boolean indexing,
``.nonzero()``), ``masked_select`` and ``unique``; on CUDA each one is a sync. It runs ``training_step`` (with
Lightning's logging) and the backward of the tiny recipe's first batches in a real ``fit``.

Run:  python benchmarks/host_syncs.py [--recipe recipes/tiny-debug.yaml] [--steps 3]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from draftkit.testing import HostReadCounter


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/tiny-debug.yaml")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    import lightning.pytorch as pl

    from draftkit.cli import DraftkitCLI

    per_step: list[collections.Counter] = []

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.mode = HostReadCounter()
            self.mode.__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.mode.__exit__(None, None, None)
            per_step.append(self.mode.counts)

    root = Path("/tmp/draftkit-host-syncs")
    cli = DraftkitCLI(args=["--recipe", args.recipe, "--trainer.max_steps", str(args.steps), "--trainer.max_time", "null",
                            "--trainer.default_root_dir", str(root), "--trainer.limit_val_batches", "0",
                            "--data.hidden_states_cache", "null"], run=False)
    cli.trainer.callbacks.append(Count())
    cli.trainer.fit(cli.model, cli.datamodule)
    steady = per_step[-1]
    print(f"host syncs per training step (step {len(per_step)}, forward + backward + optimizer + logging): "
          f"{sum(steady.values())} = " + ", ".join(f"{n} {k}" for k, n in sorted(steady.items())))
    return {"per_step": [dict(c) for c in per_step]}


if __name__ == "__main__":
    main()
