"""The GPU check (issue 32 item 6): draftkit's CUDA paths on one GPU, timed, in one summary table.

Run by ``benchmarks/gpu_check.sh`` (which installs the wheels and runs the ``gpu`` tests first); on its own:

    python benchmarks/gpu_check.py --assets .dk --out OUT_DIR [--steps 40] [--batch_size 32]

Steps (each one a row of the table; a failing step prints its error and the others still run):

1. ``attention``: the TTT attention (``kernels.ttt_attention.ttt_attention``) and the FlexAttention candidate
   (``ttt_attention_flex``, compiled; T = 2,048 only) against the dense reference on CUDA at T = 2,048 and 4,096,
   3 steps, SmolLM2's head shape (9 heads over 3, d 64), bf16: max |diff| of the output and of dq, peak memory
   and forward+backward ms of each (the second call: the first compiles flex).
2. ``fit tiny``: ``recipes/tiny-debug.yaml`` on one GPU under DDP for ``--steps`` optimizer steps.
3. ``fit smollm2``: the default recipe's SmolLM2-135M (real weights when ``--smollm2`` names a Hugging Face
   directory; else random weights built from the carried config and tokenizer in ``ASSETS/smollm2``: the
   step's cost does not depend on the weights' values) on ``recipes/data/smollm2-135m-regen.jsonl.gz``,
   bf16-mixed head, bf16 target, ``--batch_size`` sequences per step, one GPU, DDP.
4. ``fit tiny sharded`` / ``fit smollm2 sharded``: steps 2 and 3 under ``trainer.strategy fsdp_target`` (the
   target sharded with FSDP2, one shard on one GPU; ``draftkit.target.sharding``), with, for tiny (fp32), the
   largest difference of the trained head from the DDP run's (expected ~0: the same seed, batches and weights).
5. ``evaluate``: ``python -m draftkit evaluate --device cuda`` of the shipped head on that target, 8 MT-bench
   first turns (``ASSETS/mt_bench_question.jsonl``), 64 new tokens, k = 5, speed in bf16 and ``greedy_equal``
   from the float32 pass.
6. ``evaluate split``: the same target placed across two devices by a ``device_map`` (half its decoder layers
   on the GPU, half on the CPU: the path ``evaluate --device_map`` takes for a target larger than one GPU),
   float32, 4 prompts: ``greedy_equal`` must be 4/4 and the head on the GPU.

Training rows report tokens/s (real tokens, padding excluded, timed from the third step to the last, CUDA
synchronised) and peak GPU memory (``torch.cuda.max_memory_allocated``). Goal for SmolLM2: >= 100k tokens/s on
an H200. Everything goes under ``--out`` (``gpu_check.json`` and the evaluate report).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # --smoke: "cpu", tiny sizes, to check the script itself before spending device time


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _reset_peak() -> int:
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


class _StepTimer:
    """A Lightning callback: wall time and real tokens of the optimizer steps after the first ``skip``."""

    def __init__(self, skip: int = 2) -> None:
        self.skip, self.tokens, self.t0, self.steps = skip, 0, None, 0

    def as_callback(self):
        import lightning.pytorch as pl

        timer = self

        class Callback(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                if trainer.global_step == timer.skip and timer.t0 is None:
                    _sync()
                    timer.t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                if timer.t0 is not None:
                    timer.tokens += int(batch["attention_mask"].sum())
                    timer.steps += 1

            def on_train_end(self, trainer, module):
                _sync()
                timer.seconds = time.perf_counter() - timer.t0 if timer.t0 else float("nan")

        return Callback()


def attention_row(lengths=(2048, 4096)) -> dict:
    """Step 1: the O(T) TTT attention (and, on CUDA, the FlexAttention candidate) against the dense reference (bf16)."""
    from draftkit.kernels.ttt_attention import ttt_attention, ttt_attention_eager, ttt_attention_flex

    out = {}
    b, heads, kv, d, steps = 1, 9, 3, 64, 3
    for t in lengths:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        q = torch.randn(b, heads, t, d, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
        cache = [tuple(torch.randn(b, kv, t, d, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
                       for _ in range(2)) for _ in range(steps)]
        mask = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
        results = {}
        kernels = [("dense", ttt_attention_eager), ("ttt_attention", ttt_attention)]
        if DEVICE == "cuda" and t == lengths[0]:  # no backward on the CPU; one length bounds its compile time
            kernels.append(("flex", ttt_attention_flex))
        for name, attend in kernels:
            for rep in range(2):  # the second call is timed (the first compiles flex)
                base = _reset_peak()
                t0 = time.perf_counter()
                o = attend(q, cache, mask, d**-0.5)
                o.float().sum().backward()
                _sync()
                ms = (time.perf_counter() - t0) * 1000
                results[name] = (o.detach().float(), ms, (_peak_bytes() - base) / 2**20, q.grad.float().clone())
                for x in [q] + [y for kv_ in cache for y in kv_]:
                    x.grad = None
        row = {}
        for name in results:
            if name != "dense":
                row[f"{name}_max_abs_diff"] = float((results["dense"][0] - results[name][0]).abs().max())
                row[f"{name}_dq_max_abs_diff"] = float((results["dense"][3] - results[name][3]).abs().max())
        out[f"T={t}"] = {**row, **{f"{n}_ms": round(r[1], 2) for n, r in results.items()},
                         **{f"{n}_peak_MiB": round(r[2], 1) for n, r in results.items()}}
    return out


def fit_row(recipe: str, overrides: list[str], steps: int, root: Path, strategy: str = "ddp",
            heads: dict | None = None) -> dict:
    """Steps 2-3 and 5: a fixed-step fit on one GPU under ``strategy`` (``ddp``, or ``fsdp_target``: the target
    sharded with FSDP2, one shard on one GPU); tokens/s and peak memory. ``heads[strategy]`` receives the trained
    head's tensors (float32, CPU) when ``heads`` is given."""
    from draftkit.cli import DraftkitCLI

    timer = _StepTimer()
    args = ["--recipe", recipe, "--trainer.accelerator", "gpu" if DEVICE == "cuda" else "cpu", "--trainer.devices", "1",
            "--trainer.strategy", strategy if DEVICE == "cuda" or strategy != "ddp" else "auto",
            "--trainer.max_steps", str(steps), "--trainer.max_time", "null", "--trainer.val_check_interval",
            str(steps), "--trainer.limit_val_batches", "2", "--trainer.default_root_dir", str(root),
            "--data.hidden_states_cache", "null", *overrides]
    cli = DraftkitCLI(args=args, run=False)
    cli.trainer.callbacks.append(timer.as_callback())
    _reset_peak()
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    if heads is not None:
        heads[strategy] = {k: v.detach().float().cpu() for k, v in cli.model.head.state_dict().items()
                           if v.is_floating_point()}
    return {
        "steps": int(cli.trainer.global_step), "wall_s": round(time.perf_counter() - t0, 1),
        "tokens_per_s": round(timer.tokens / timer.seconds) if timer.steps else None,
        "timed_steps": timer.steps, "tokens_per_step": round(timer.tokens / max(1, timer.steps)),
        "peak_GiB": round(_peak_bytes() / 2**30, 2),
        "val_tau_sim": float(cli.trainer.callback_metrics.get("val/tau_sim", float("nan"))),
    }


def smollm2_target(assets: Path, given: str | None, dest: Path) -> str:
    """The SmolLM2 directory to train on: ``given``, or random weights from the carried config and tokenizer."""
    if given:
        return given
    from transformers import AutoConfig, AutoModelForCausalLM

    src = assets / "smollm2"
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src}/config.json missing: run benchmarks/gpu_prepare.sh here first, or pass --smollm2")
    if not (dest / "model.safetensors").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
        model.save_pretrained(dest)
        for f in src.iterdir():
            if f.name != "config.json":
                shutil.copy(f, dest / f.name)
    return str(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--assets", default=".dk", help="folder gpu_prepare.sh filled (smollm2/, mt_bench_question.jsonl)")
    ap.add_argument("--smollm2", default=None, help="a Hugging Face directory of SmolLM2-135M-Instruct (real weights)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="run every step on the CPU at tiny sizes (checks the script)")
    args = ap.parse_args(argv)
    global DEVICE
    if args.smoke:
        DEVICE, args.steps, args.batch_size = "cpu", 3, 2
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (--smoke runs the steps on the CPU)", file=sys.stderr)
        return 2
    os.chdir(REPO)
    out, assets, work = Path(args.out), Path(args.assets), Path("/tmp/draftkit-gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else f"cpu {torch.backends.cpu.get_cpu_capability()}"
    rows: dict[str, dict] = {"device": {"name": name, "torch": torch.__version__}}

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            rows[name] = fn()
        except Exception as exc:  # one failing step must not hide the others' figures
            traceback.print_exc()
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows[name]["step_s"] = round(time.perf_counter() - t0, 1)
        print(f"gpu_check {name}: {json.dumps(rows[name])}", flush=True)

    step("attention", lambda: attention_row((64,) if args.smoke else (2048, 4096)))
    tiny_heads: dict = {}
    step("fit tiny", lambda: fit_row("recipes/tiny-debug.yaml", [], args.steps, work / "tiny", heads=tiny_heads))

    def tiny_sharded():
        row = fit_row("recipes/tiny-debug.yaml", [], args.steps, work / "tiny-sharded", "fsdp_target", tiny_heads)
        a, b = tiny_heads["fsdp_target"], tiny_heads.get("ddp")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a) if b else None
        return {**row, "head_max_diff_vs_ddp": diff}

    step("fit tiny sharded", tiny_sharded)
    target = {}

    def smollm2():
        target["dir"] = smollm2_target(assets, args.smollm2, work / "smollm2-random")
        return {"weights": "real" if args.smollm2 else "random (from config)", **fit_row(
            "recipes/smollm2-135m-eagle3.yaml",
            ["--model.target", target["dir"], "--model.target_dtype", "bfloat16", "--trainer.precision", "bf16-mixed",
             "--data.batch_size", str(args.batch_size), "--data.num_proc", "8"], args.steps, work / "smollm2")}

    step("fit smollm2", smollm2)

    def smollm2_sharded():
        target["dir"] = target.get("dir") or smollm2_target(assets, args.smollm2, work / "smollm2-random")
        return fit_row(
            "recipes/smollm2-135m-eagle3.yaml",
            ["--model.target", target["dir"], "--model.target_dtype", "bfloat16", "--trainer.precision", "bf16-mixed",
             "--data.batch_size", str(args.batch_size), "--data.num_proc", "8"], max(5, args.steps // 2),
            work / "smollm2-sharded", "fsdp_target")

    step("fit smollm2 sharded", smollm2_sharded)

    def evaluate():
        from draftkit.commands.evaluate import evaluate as run

        report = run(checkpoint="checkpoints/smollm2-135m-eagle3-head", output=str(out / "evaluate_cuda.json"),
                     prompts=str(assets / "mt_bench_question.jsonl"), num_prompts=1 if args.smoke else 8,
                     max_new_tokens=8 if args.smoke else 64, k=5,
                     target=target.get("dir") or smollm2_target(assets, args.smollm2, work / "smollm2-random"),
                     device=DEVICE, dtype="bfloat16")
        return {"dtype": report["setup"]["target_dtype"], "tau": round(report["tau"], 3),
                "speedup": round(report["speedup"], 3), "tokens_per_s": round(report["tokens_per_s"], 1),
                "greedy_equal_float32": f"{report['lossless']['greedy_equal']}/{report['num_prompts']}"}

    step("evaluate", evaluate)

    def evaluate_split():
        """The target split across two devices (``evaluate --device_map``'s path, on one GPU: the first half of
        the decoder layers on it, the rest on the CPU), float32: speculative decoding must equal plain decoding
        token for token there (greedy_equal), as on one device."""
        from draftkit.data.prompts import load_prompts
        from draftkit.decoding.harness import evaluate_head
        from draftkit.export.head_target import load_head_and_target

        ref = target.get("dir") or smollm2_target(assets, args.smollm2, work / "smollm2-random")
        n = 30
        where = {"model.embed_tokens": 0 if DEVICE == "cuda" else "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu",
                 "lm_head": 0 if DEVICE == "cuda" else "cpu"}
        where.update({f"model.layers.{i}": (0 if DEVICE == "cuda" and i < n // 2 else "cpu") for i in range(n)})
        head, frozen, tokenizer, meta, _ = load_head_and_target("checkpoints/smollm2-135m-eagle3-head", ref,
                                                                "float32", DEVICE, device_map=where)
        report = evaluate_head(head, frozen, tokenizer, load_prompts(str(assets / "mt_bench_question.jsonl"),
                                                                       1 if args.smoke else 4),
                               k=5, max_new_tokens=8 if args.smoke else 48, prompt_lookup=False,
                               chat_template=meta.get("chat_template"), check=False)
        return {"placement": sorted({str(d) for d in getattr(frozen.model, "hf_device_map", {}).values()}),
                "head_device": str(next(head.parameters()).device), "tau": round(report["tau"], 3),
                "greedy_equal": f"{report['greedy_equal']}/{report['num_prompts']}"}

    step("evaluate split", evaluate_split)
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| step | figures |\n|---|---|")
    for name, row in rows.items():
        print(f"| {name} | " + ", ".join(f"{k} {v}" for k, v in row.items()) + " |")
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
