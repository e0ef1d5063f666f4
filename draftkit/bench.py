"""``python -m draftkit bench train --recipe R``: training throughput of a recipe on this machine.

Prints training tokens/s (all tokens of the batch, padding excluded) and the ratio of one full training
step (target forward + K TTT steps + backward + optimizer step) to the target's forward alone on the same
batch, both timed in the same run after warm-up.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch

__all__ = ["main", "bench_train"]


def bench_train(recipes: list[str], steps: int = 5, warmup: int = 1, overrides: list[str] | None = None) -> dict:
    """Time ``steps`` training steps and target forwards on the recipe's first batches.

    Returns:
        dict with ``tokens_per_step``, ``target_forward_s``, ``train_step_s``, ``ratio``,
        ``train_tokens_per_s``, ``target_tokens_per_s``, ``precision``, ``threads``.
    """
    from draftkit.cli import DraftkitCLI

    args = [x for r in recipes for x in ("--recipe", r)] + list(overrides or [])
    cli = DraftkitCLI(args=args, run=False)
    model, dm, trainer = cli.model, cli.datamodule, cli.trainer
    dm.setup("fit")
    model.build(dm)
    model.train()
    precision = str(trainer.precision)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if "bf16" in precision else nullcontext()
    opt = torch.optim.AdamW([p for p in model.head.parameters() if p.requires_grad], lr=1e-5)
    it = iter(dm.train_dataloader())
    batches = [next(it) for _ in range(warmup + steps)]
    fwd, step = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        with autocast:
            model.target(batch["input_ids"], attention_mask=batch["attention_mask"])
        t1 = time.perf_counter()
        with autocast:
            loss, _ = model.ttt_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.head.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            step.append(t2 - t1)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[warmup:]) / steps
    result = {
        "tokens_per_step": tokens,
        "target_forward_s": sum(fwd) / steps,
        "train_step_s": sum(step) / steps,
        "precision": precision,
        "threads": torch.get_num_threads(),
    }
    result["ratio"] = result["train_step_s"] / result["target_forward_s"]
    result["train_tokens_per_s"] = tokens / result["train_step_s"]
    result["target_tokens_per_s"] = tokens / result["target_forward_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftkit bench", description=__doc__)
    parser.add_argument("what", choices=["train"])
    parser.add_argument("-r", "--recipe", action="append", required=True, help="recipe YAML (repeatable)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps")
    args, overrides = parser.parse_known_args(argv)
    r = bench_train(args.recipe, args.steps, args.warmup, overrides)
    print(
        f"draftkit bench train ({r['precision']}, {r['threads']} threads, {r['tokens_per_step']:.0f} tokens/step)\n"
        f"  target forward alone : {r['target_forward_s']:.3f} s/step  ({r['target_tokens_per_s']:.0f} tokens/s)\n"
        f"  full training step   : {r['train_step_s']:.3f} s/step  ({r['train_tokens_per_s']:.0f} tokens/s)\n"
        f"  ratio step / forward : {r['ratio']:.2f}"
    )
    return 0
