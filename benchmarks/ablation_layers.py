"""Issue-4 ablation: aux layers chosen by analysis vs the fixed [2, N//2, N-3] rule, and the training
token-entropy filter on vs off, each arm trained on the same budget with several seeds and evaluated with
real speculative decoding (``draftkit evaluate``) on MT-bench.

Arms (recipes stacked on ``recipes/smollm2-135m-eagle3.yaml`` + ``recipes/ablation/budget.yaml``):

- ``fixed``:          aux layers [2, 15, 27] (the default), no filter;
- ``chosen``:         ``recipes/ablation/chosen-layers.yaml`` ([5, 26, 29] from ``select-layers``), no filter;
- ``chosen-filter``:  chosen layers + ``recipes/ablation/entropy-filter.yaml`` (drop the lowest-entropy half);
- ``chosen-blocks``:  ``recipes/ablation/chosen-blocks-layers.yaml``, chosen with one layer per CKA block.

Seed s sets both ``seed_everything`` (head init) and ``data.seed`` (split, order, draft vocab counts). Each run
lives in ``OUT/<arm>-s<seed>/`` (the recipe's relative paths resolve there) and is skipped when its
``eval.json`` exists, so the script resumes. It prints a table and writes ``OUT/summary.json``:
per run the aux layers, ``val/tau_sim`` (teacher-forced, K=7) and MT-bench τ (counts the bonus token) and α_1;
per arm the mean over seeds; and chosen − fixed and filter − no filter, paired by seed.

Run:  python benchmarks/ablation_layers.py [--out benchmarks/out/ablation] [--seeds 0 1] [--parallel 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BASE = [REPO / "recipes/smollm2-135m-eagle3.yaml", REPO / "recipes/ablation/budget.yaml"]
ARMS = {
    "fixed": [],
    "chosen": [REPO / "recipes/ablation/chosen-layers.yaml"],
    "chosen-filter": [REPO / "recipes/ablation/chosen-layers.yaml", REPO / "recipes/ablation/entropy-filter.yaml"],
    "chosen-blocks": [REPO / "recipes/ablation/chosen-blocks-layers.yaml"],
}
CKPT = "checkpoints/smollm2-135m-eagle3/last.ckpt"


def _run(cmd: list[str], cwd: Path, log: Path, threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed with exit code {rc}; see {log}")


def run_one(arm: str, seed: int, out: Path, args) -> dict:
    """Train and evaluate one (arm, seed); returns its row of the summary."""
    run_dir = out / f"{arm}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log, report = run_dir / "run.log", run_dir / "eval.json"
    start = time.time()
    if not report.exists():
        if not (run_dir / CKPT).exists():
            recipes = [a for r in BASE + ARMS[arm] for a in ("--recipe", str(r))]
            _run([sys.executable, "-m", "draftkit", "fit", *recipes, "--seed_everything", str(seed),
                  "--data.seed", str(seed)], run_dir, log, args.threads)
        _run([sys.executable, "-m", "draftkit", "evaluate", "--checkpoint", CKPT, "--prompts", "mt-bench",
              "--num_prompts", str(args.num_prompts), "--max_new_tokens", str(args.max_new_tokens), "--k", str(args.k),
              "--dtype", "bfloat16", "--baseline", "false", "--prompt_lookup", "false",
              "--threads", str(args.threads), "--output", "eval.json"], run_dir, log, args.threads)
    ckpt = torch.load(run_dir / CKPT, map_location="cpu", weights_only=False)
    val = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")][0]["best_model_score"]
    ev = json.loads(report.read_text())
    row = {
        "arm": arm, "seed": seed, "aux_layer_ids": ckpt["draftkit"]["aux_layer_ids"],
        "entropy_filter": _as_dict(ckpt["hyper_parameters"]["entropy_filter"]), "steps": ckpt["global_step"],
        "val_tau_sim": float(val), "tau": ev["tau"], "alpha": ev["acceptance_per_position"],
        "acceptance_rate": ev["acceptance_rate"], "num_prompts": ev["num_prompts"], "new_tokens": ev["new_tokens"],
    }
    print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}: tau {row['tau']:.4f}, val/tau_sim {row['val_tau_sim']:.4f}"
          f" ({time.time() - start:.0f} s)", flush=True)
    return row


def _as_dict(x) -> dict:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else dict(x)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def summarize(rows: list[dict]) -> dict:
    """Per-arm means over seeds and seed-paired differences (chosen - fixed, chosen-filter - chosen,
    chosen-blocks - fixed)."""
    by = {(r["arm"], r["seed"]): r for r in rows}
    arms = {}
    for arm in ARMS:
        rs = [r for r in rows if r["arm"] == arm]
        if rs:
            arms[arm] = {
                "seeds": [r["seed"] for r in rs], "tau_mean": _mean([r["tau"] for r in rs]),
                "tau": [r["tau"] for r in rs], "val_tau_sim_mean": _mean([r["val_tau_sim"] for r in rs]),
                "alpha1_mean": _mean([r["alpha"][0] for r in rs]),
            }
    diffs = {}
    for name, (a, b) in {"chosen_minus_fixed": ("chosen", "fixed"),
                         "filter_minus_nofilter": ("chosen-filter", "chosen"),
                         "blocks_minus_fixed": ("chosen-blocks", "fixed")}.items():
        seeds = sorted({s for (arm, s) in by if arm == a} & {s for (arm, s) in by if arm == b})
        if seeds:
            d = [by[(a, s)]["tau"] - by[(b, s)]["tau"] for s in seeds]
            dv = [by[(a, s)]["val_tau_sim"] - by[(b, s)]["val_tau_sim"] for s in seeds]
            diffs[name] = {"seeds": seeds, "tau": d, "tau_mean": _mean(d), "val_tau_sim": dv, "val_tau_sim_mean": _mean(dv)}
    return {"arms": arms, "paired_differences": diffs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/out/ablation")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--parallel", type=int, default=1, help="runs at once (each with --threads torch threads)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num_prompts", type=int, default=80, help="MT-bench first turns")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=5, help="draft tokens per round")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # one lane per seed, so runs sharing a seed (and its data split) never overlap
    lanes = [[(arm, s) for arm in args.arms] for s in args.seeds]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        done = pool.map(lambda lane: [run_one(arm, s, args.out, args) for arm, s in lane], lanes)
        rows = [r for lane in done for r in lane]
    summary = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "runs": rows, **summarize(rows)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{'arm':15s} {'seed':>4s} {'aux layers':14s} {'filter':8s} {'val/tau_sim':>11s} {'tau':>7s} {'alpha_1':>7s}")
    for r in rows:
        print(f"{r['arm']:15s} {r['seed']:4d} {str(r['aux_layer_ids']):14s} {r['entropy_filter']['mode']:8s} "
              f"{r['val_tau_sim']:11.4f} {r['tau']:7.4f} {r['alpha'][0]:7.4f}")
    for name, d in summary["paired_differences"].items():
        print(f"{name}: tau {d['tau_mean']:+.4f} (per seed {[round(x, 4) for x in d['tau']]}), "
              f"val/tau_sim {d['val_tau_sim_mean']:+.4f}")
    print(f"summary: {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
