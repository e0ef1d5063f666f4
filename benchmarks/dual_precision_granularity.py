"""Issue 16: replay gate quality of dual precision by quantizer granularity and slicing (dual-precision.md §5-6).

For each target and group size (per-channel, 128, 64, 32): all-high greedy trajectories of P evaluation
prompts (MT-bench first turns, the CLI's seed-0 split, the 20 calibration prompts left out), then for each
slicing (mid-point, round) teacher-forced 4-bit and 8-bit forwards over them: flip rate, AUC of entropy and
-margin with prompt-bootstrap intervals, catch at 5/10/15/20/30 % with the random baseline and oracle, bytes
(rho, and a/A, A per cost model), and the i.i.d. prediction of verified speculation's bytes ratio from the
replay agreement 1 - flip rate (a lower bound on live acceptance: live drafts run over 8-bit K/V).

Resumable: each finished (target, group, slicing) entry is written to --output at once and skipped on rerun.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/dual_precision_granularity.py --target smollm2 \
        --num_prompts 12 --max_new_tokens 64 --output benchmarks/out/dp_granularity_smollm2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path

import torch

from draftkit.artifacts import GEMMA3_270M_REF
from draftkit.dual_precision import DualPrecisionLM, greedy_decode, replay_metrics, replay_steps
from draftkit.commands.evaluate_dual_precision import SMOLLM2_REF
from draftkit.data.prompts import load_prompts, split_prompts
from draftkit.decoding.speculative import DecodeConfig
from draftkit.jsonio import write_json_atomic
from draftkit.quant import COST_MODELS, QuantConfig, expected_verified_ratio, gated_bytes_per_token

TARGETS = {"smollm2": (SMOLLM2_REF, True), "gemma3": (GEMMA3_270M_REF, False)}  # (reference, chat template)
log = logging.getLogger("dp_granularity")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=sorted(TARGETS), default="smollm2")
    p.add_argument("--num_prompts", type=int, default=12)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--groups", type=str, default="none,128,64,32", help="'none' = per-channel")
    p.add_argument("--slicings", type=str, default="midpoint,round")
    p.add_argument("--bootstrap_samples", type=int, default=300)
    p.add_argument("--output", type=str, required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from draftkit.target.frozen import load_target
    from draftkit.target.tokens import encode_chat, stop_token_ids

    ref, chat = TARGETS[args.target]
    out_path = Path(args.output)
    report = json.loads(out_path.read_text()) if out_path.exists() else {}
    report.setdefault("entries", {})
    report["setup"] = {
        "target": ref, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
    }
    model, tok = load_target(ref, "float32")
    _, evaluation, _ = split_prompts(load_prompts("mt-bench"), 20, None, 0)
    prompts = []
    for r in evaluation[: args.num_prompts]:
        if chat:
            prompts.append(encode_chat(tok, r.messages))
        else:
            prompts.append(tok(r.text)["input_ids"])  # plain text after <bos>
    decoding = DecodeConfig(args.max_new_tokens, eos_token_ids=tuple(stop_token_ids(tok, model.generation_config)))
    for group in args.groups.split(","):
        group_size = None if group == "none" else int(group)
        keys = {s: f"{args.target}/{group}/{s}" for s in args.slicings.split(",")}
        if all(k in report["entries"] for k in keys.values()):
            continue
        lms = {s: DualPrecisionLM(copy.deepcopy(model), QuantConfig(slicing=s, group_size=group_size))
               for s in keys}
        first = next(iter(lms.values()))
        t0 = time.perf_counter()
        trajs = []
        for i, prompt in enumerate(prompts):
            trajs.append(greedy_decode(first, prompt, decoding, "high", keep_logits=False).tokens)
            log.info("%s group %s: all-high prompt %d/%d (%d tokens)", args.target, group, i + 1, len(prompts),
                     len(trajs[-1]))
        t_decode = time.perf_counter() - t0
        for slicing, lm in lms.items():
            t1 = time.perf_counter()
            steps = [replay_steps(lm, prompt, tokens)[0] for prompt, tokens in zip(prompts, trajs)]
            m = replay_metrics(steps, bootstrap_samples=args.bootstrap_samples)
            wb = lm.bytes
            alpha = 1.0 - m["flip_rate"]
            entry = {
                "group_size": group_size, "slicing": slicing,
                **{k: m[k] for k in ("num_prompts", "num_steps", "num_flips", "flip_rate", "auc_entropy",
                                     "auc_entropy_ci", "auc_margin", "auc_margin_ci", "pr_auc_entropy",
                                     "pr_auc_margin", "catch_at_budget", "catch_at_budget_ci")},
                "weight_bytes": wb.to_dict(),
                "gate_ratio_at_0.15": {c: gated_bytes_per_token(wb, 0.15, c) / wb.high for c in COST_MODELS},
                "verified_ratio_iid": {str(k): expected_verified_ratio(wb.rho, alpha, k) for k in (1, 2, 3, 4)},
                "timing_s": {"all_high_decode": t_decode, "replay": time.perf_counter() - t1},
            }
            report["entries"][keys[slicing]] = entry
            write_json_atomic(out_path, report)
            c = entry["catch_at_budget"]
            log.info("%s: flip %.3f AUC H %.3f -m %.3f catch@15 margin %.3f entropy %.3f rho %.3f verified(k=2) %.3f",
                     keys[slicing], entry["flip_rate"], entry["auc_entropy"], entry["auc_margin"],
                     c["margin"]["0.15"], c["entropy"]["0.15"], wb.rho, entry["verified_ratio_iid"]["2"])
        del lms, first
    print(table(report))


def table(report: dict) -> str:
    """Markdown table of every entry: flip rate, AUCs with 95 % intervals, catch at the budgets, bytes."""
    head = ("| config | steps | flip | AUC H [CI] | AUC -m [CI] | catch margin 5/10/15/20/30 % | catch entropy "
            "5/10/15/20/30 % | oracle 15 % | rho | verified iid k=1/2/3 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    budgets = ("0.05", "0.10", "0.15", "0.20", "0.30")

    def ci(v):
        return "-" if v is None else f"[{v[0]:.2f}, {v[1]:.2f}]"

    def curve(by_budget):
        return "/".join(f"{by_budget[b]:.2f}" for b in budgets)

    for key, e in report["entries"].items():
        c = e["catch_at_budget"]
        oracle = c.get("oracle", {}).get("0.15", float("nan"))
        ver = e["verified_ratio_iid"]
        lines.append(
            f"| {key} | {e['num_steps']} | {e['flip_rate']:.3f} | {e['auc_entropy']:.3f} {ci(e['auc_entropy_ci'])} "
            f"| {e['auc_margin']:.3f} {ci(e['auc_margin_ci'])} | {curve(c['margin'])} "
            f"| {curve(c['entropy'])} | {oracle:.2f} | {e['weight_bytes']['rho']:.3f} "
            f"| {ver['1']:.3f}/{ver['2']:.3f}/{ver['3']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
