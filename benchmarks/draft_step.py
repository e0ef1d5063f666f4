"""What the draft round costs on a CPU, eager against ``torch.compile`` of the head's forward and against the head's
linear weights packed for oneDNN (``draftkit.kernels.linears.pack_linears``; issue 35 item 4).

A round is ``Eagle3Drafter.propose`` for k = 2..5: the pending step-0 rows (2 per round here, a typical accepted
count) through ``fc`` and the layer, then k - 1 one-row steps, over a draft KV cache of 300 rows (a 300-token
prompt's). Each variant is its own copy of the shipped head (``compile``: ``torch.compile(head.forward,
dynamic=True)``; ``compile-freeze``: the same with Inductor's ``freezing``, which prepacks weights on a CPU); the
variants alternate repeat by repeat in one process. Run ``compile`` and ``compile-freeze`` in separate processes:
they share one function and so Dynamo's cache of it.

Run:  python benchmarks/draft_step.py --dtype float32 --variants eager,packed,compile [--threads 1] [--repeats 16]
Prints, per variant, the warm-up seconds (compilation included) and min/median process-CPU ms per round for each
k with the min as a ratio to eager's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

VARIANTS = ("eager", "packed", "compile", "compile-freeze")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="checkpoints/smollm2-135m-eagle3-head")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--variants", default="eager,packed,compile", help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--context", type=int, default=300, help="prompt tokens (the draft cache's rows)")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if "eager" not in variants or not set(variants) <= set(VARIANTS):
        p.error(f"--variants: eager and any of {', '.join(VARIANTS)}")
    import torch._dynamo

    from draftkit.decoding.drafters import Eagle3Drafter
    from draftkit.export.head_target import load_head_and_target
    from draftkit.sampling import DecodeConfig
    from draftkit.kernels.linears import pack_linears
    from draftkit.target.session import TargetSession

    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # pending-row counts and strides each compile once
    loaded = load_head_and_target(args.checkpoint, None, args.dtype, "cpu")
    head, frozen = loaded[0], loaded[1]
    head.eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    vocab = frozen.config.vocab_size
    prompt = torch.randint(0, vocab, (args.context,), generator=g)
    logits, aux = TargetSession(frozen).forward(prompt, logits_to_keep=1)
    tokens = torch.cat([prompt, logits[-1].argmax().view(1)])  # (L+1,)
    later = torch.cat([tokens, torch.randint(0, vocab, (2,), generator=g)])  # 2 more accepted tokens
    pending = aux[-2:].clone()  # their aux rows
    cfg, ks = DecodeConfig(16), (2, 3, 4, 5)
    drafters, warmup = {}, {}
    with torch.no_grad():
        for v in variants:
            h = head if v == "eager" else copy.deepcopy(head)
            if v == "packed":
                pack_linears(h, "onednn")
            elif v.startswith("compile"):
                h.forward = torch.compile(h.forward, dynamic=True, options={"freezing": v == "compile-freeze"})
            d = Eagle3Drafter(h)
            d.reset(prompt, aux)
            t0 = time.perf_counter()
            d.propose(tokens, 2, cfg, None)  # the prompt's rows enter the draft cache
            for k in ks:
                d.cache.crop(args.context)
                d.pending = pending
                d.propose(later, k, cfg, None)
            warmup[v], drafters[v] = time.perf_counter() - t0, d
        best = {v: {} for v in variants}
        for k in ks:
            times = {v: [] for v in variants}
            for _ in range(args.repeats):
                for v, d in drafters.items():
                    d.cache.crop(args.context)
                    d.pending = pending
                    t0 = time.process_time()
                    d.propose(later, k, cfg, None)
                    times[v].append(time.process_time() - t0)
            for v in variants:
                kept = times[v][2:]
                best[v][k] = (1000 * min(kept), 1000 * statistics.median(kept))
    print(f"{args.checkpoint}: {args.dtype}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} thread(s), draft cache {args.context} rows, 2 pending rows per round")
    for v in variants:
        print(f"  {v:15s} warm-up {warmup[v]:5.1f} s; ms min/median per round " + ", ".join(
            f"k={k}: {a:.1f}/{b:.1f} ({a / best['eager'][k][0]:.2f}x)" for k, (a, b) in best[v].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
