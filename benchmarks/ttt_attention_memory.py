"""Peak memory and time of the TTT attention, forward + backward, one layer, on the CPU.

Each (kernel, T) runs in a fresh subprocess: the inputs (q per step, K_j/V_j per step) are made first, then one
unrolled TTT (steps 0..k through the attention only, as the head's decoder layer calls it) and one backward run;
the peak is the process's maximum resident set size (``resource.getrusage``) after the run minus the one before
it, so it counts what the attention allocates (scores, saved tensors, gradients), not the inputs or the import.

Shapes default to the SmolLM2-135M draft head (A = 9 heads, A_kv = 3, d = 64), B = 1, k = 3 TTT steps.

Kernels: ``eager`` (the dense reference, :func:`draftkit.kernels.ttt_attention.ttt_attention_eager`, a (B, A, T, T)
tensor per step: what CUDA ran before issue 32), ``flash_cpu`` and ``chunked`` (the two causal kernels of
:func:`draftkit.kernels.ttt_attention.ttt_attention`: the CPU flash kernel, and the device-agnostic query-chunked one
that CUDA runs).

Run:  python benchmarks/ttt_attention_memory.py [--t 512 1024 2048] [--kernels eager flash_cpu chunked] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, math, resource, sys, time
import torch
from draftkit.kernels import ttt_attention as m
kernel, t, steps, heads, kv_heads, d, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), getattr(torch, sys.argv[7])
torch.manual_seed(0)
b = 1
mask = torch.ones(b, t, dtype=torch.bool)
qs = [torch.randn(b, heads, t, d, dtype=dtype, requires_grad=True) for _ in range(steps + 1)]
cache_all = [tuple(torch.randn(b, kv_heads, t, d, dtype=dtype, requires_grad=True) for _ in range(2)) for _ in range(steps + 1)]
weights = [torch.randn(b, heads, t, d, dtype=dtype) for _ in range(steps + 1)]
def attend(q, cache):
    if kernel == "eager":
        return m.ttt_attention_eager(q, cache, mask, d ** -0.5)
    return m.ttt_attention(q, cache, mask, d ** -0.5, causal_kernel=kernel)
def run():
    loss = 0
    for k in range(steps + 1):
        loss = loss + (attend(qs[k], cache_all[: k + 1]) * weights[k]).sum()
    loss.backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
run()
first = time.perf_counter() - start
times = []
for _ in range(2):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mib": (peak - before) / 1024, "s": min(times + [first])}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, nargs="+", default=[512, 1024, 2048], help="sequence lengths (tokens)")
    parser.add_argument("--kernels", nargs="+", default=["eager", "flash_cpu", "chunked"])
    parser.add_argument("--steps", type=int, default=3, help="TTT steps k after step 0")
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("A", "A_KV", "D"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    import torch

    print(f"# CPU {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"dtype {args.dtype}, B=1, A={args.heads[0]}, A_kv={args.heads[1]}, d={args.heads[2]}, steps 0..{args.steps}")
    print("| kernel | T | peak MiB (fwd+bwd) | s (fwd+bwd) |")
    print("|---|---:|---:|---:|")
    for kernel in args.kernels:
        for t in args.t:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, kernel, str(t), str(args.steps), *map(str, args.heads), args.dtype],
                capture_output=True, text=True, check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {kernel} | {t} | {row['peak_mib']:.1f} | {row['s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
