"""Issue 16: replay gate quality of dual precision by quantizer granularity and slicing (dual-precision.md §5-6).

For each target and group size (per-channel, 128, 64, 32): all-high greedy trajectories of P evaluation
prompts (MT-bench first turns, the CLI's seed-0 split, the 20 calibration prompts left out), then for each
slicing (mid-point, round) teacher-forced 4-bit and 8-bit forwards over them: flip rate, AUC of entropy and
-margin with prompt-bootstrap intervals, catch at 5/10/15/20/30 % with the random baseline and oracle, bytes
(rho, and a/A, A per cost model), and the i.i.d. prediction of verified speculation's bytes ratio from the
replay agreement 1 - flip rate (a lower bound on live acceptance: live drafts run over 8-bit K/V).

``--scheme asymmetric`` (min/max codes in [0, --code_range], a zero point per group; R = 240 nests the
4-bit levels) and ``--quantize_lm_head`` select the quantizer; entries are keyed
``target/{sym|asym<R>}[+head]/group/slicing``. ``--by_source`` adds, per entry, the GGML type of every
quantized linear in the target's GGUF (Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, ...), weight statistics per type
(fraction of weights whose 4-bit level differs from the 8-bit code, ||W_lo - W_hi||^2 / ||W_hi||^2, and the
8-bit error against the dequantized source) and a replay with only that type's linears at 4 bits (the rest
at 8): which source tensors produce the flips, and the 4-bit margin p_(1) - p_(2) at those flips.

``--kernels`` (auto, onednn, stock; default auto, as ``evaluate-dual-precision``) picks the linear kernels of the
float ``nn.Linear`` left after quantization (the 16-bit LM head; nothing with ``--quantize_lm_head``), packed once
per slicing's copy by ``draftkit.kernels.linears.pack_linears``; each entry's ``kernels`` says which ran, why, and
the packed copy's bytes. float32 logits agree with stock to 1e-5.

Resumable: each finished (target, quantizer, group, slicing) entry is written to --output at once and skipped
on rerun (the kernels are not part of the key: a resumed run may use other kernels).

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/dual_precision_granularity.py --target smollm2 \
        --num_prompts 12 --max_new_tokens 64 --output benchmarks/out/dp_granularity_smollm2.json
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/dual_precision_granularity.py --target smollm2 \
        --scheme asymmetric --groups 32 --slicings truncate,midpoint,round --by_source \
        --num_prompts 8 --max_new_tokens 64 --output benchmarks/out/dp_asym_smollm2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import time
from pathlib import Path

import torch

from draftkit.artifacts import GEMMA3_270M_REF, resolve_artifact
from draftkit.dual_precision import (
    ReplaySteps,
    gate_scores,
    greedy_decode,
    replay_metrics,
    replay_steps,
    teacher_forced_logits,
)
from draftkit.commands.evaluate_dual_precision import SMOLLM2_REF
from draftkit.data.prompts import encode_prompt, load_prompts, split_prompts
from draftkit.sampling import DecodeConfig
from draftkit.jsonio import write_json_atomic
from draftkit.quant import (
    COST_MODELS,
    QuantConfig,
    expected_verified_ratio,
    gated_bytes_per_token,
    nested_linears,
    set_precision,
)
from draftkit.kernels.linears import KERNELS, pack_linears
from draftkit.target.session import TargetSession

TARGETS = {"smollm2": (SMOLLM2_REF, True), "gemma3": (GEMMA3_270M_REF, False)}  # (reference, chat template)
log = logging.getLogger("dp_granularity")

# GGUF tensor stem -> Hugging Face module suffix (llama.cpp's convert_hf_to_gguf names, Llama and Gemma 3)
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def source_types(gguf_path: str) -> dict[str, str]:
    """GGML type of every linear weight of a GGUF, by Hugging Face module name.

    Args:
        gguf_path: a .gguf file.

    Returns:
        {"model.layers.{i}.self_attn.q_proj": "Q4_1", ..., "lm_head": type of ``output.weight``, or of
        ``token_embd.weight`` when the head is tied (no ``output.weight``)}.
    """
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(gguf_path).tensors}
    out = {}
    for name, kind in types.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if m and m.group(2) in GGUF_TO_HF:
            out[f"model.layers.{m.group(1)}.{GGUF_TO_HF[m.group(2)]}"] = kind
    out["lm_head"] = types.get("output.weight", types["token_embd.weight"])
    return out


def by_source(lm: TargetSession, float_model, prompts, trajs, high_argmax, types) -> dict:
    """Weight statistics and flips per GGML source type (see the module docstring).

    Args:
        lm: the session of the quantized target (``TargetSession.with_precision_switch``).
        float_model: the unquantized target (same module names), for the 8-bit error against the source.
        prompts: P prompts as token ids; trajs: their all-high trajectories.
        high_argmax: P tensors (n,), the teacher-forced 8-bit argmax of each trajectory.
        types: :func:`source_types` of the target's GGUF.

    Returns:
        {GGML type (``lm_head:<type>`` for the LM head): {"linears", "weights", "frac_low_differs",
        "rel_err_low_vs_high", "rel_err_high_vs_source", "flips", "flip_rate", "flip_margin_median",
        "flip_margin_below_0.1", "step_margin_median"}}.
    """
    nested = set(nested_linears(lm.target.model))
    named = {n: m for n, m in lm.target.model.named_modules() if m in nested}
    groups: dict[str, list[str]] = {}
    for name in named:  # the LM head is its own group (its GGML type may also be a decoder linear's)
        kind = types.get(name, "?")
        groups.setdefault(f"lm_head:{kind}" if name == "lm_head" else kind, []).append(name)
    out = {}
    for kind, names in sorted(groups.items()):
        stats = {"linears": len(names), "weights": 0, "differs": 0, "lo_hi": 0.0, "hi": 0.0, "hi_src": 0.0,
                 "src": 0.0}
        for name in names:
            layer, source = named[name], float_model.get_submodule(name).weight.detach().double()
            lo_codes, hi_codes = layer.codes("low"), layer.codes("high")  # (O, I)
            stats["weights"] += hi_codes.numel()
            stats["differs"] += int((lo_codes != hi_codes).sum())
            with torch.no_grad():
                layer.precision = "high"
                w_hi = layer.weight.double()
                layer.precision = "low"
                w_lo = layer.weight.double()
                layer.precision = "high"
            stats["lo_hi"] += float(((w_lo - w_hi) ** 2).sum())
            stats["hi"] += float((w_hi**2).sum())
            stats["hi_src"] += float(((w_hi - source) ** 2).sum())
            stats["src"] += float((source**2).sum())
        subset = [named[n] for n in names]
        all_layers = lm.precision_layers
        set_precision(all_layers, "high")
        lm.precision_layers = subset  # forward(precision="low") now switches only this type's linears
        flips, margins_at_flips, margins = 0, [], []
        try:
            for prompt, tokens, hi in zip(prompts, trajs, high_argmax):
                low = teacher_forced_logits(lm, prompt, tokens, "low")  # (n, V)
                flip = low.argmax(dim=-1) != hi  # (n,)
                margin = -gate_scores(low)["margin"]  # (n,) p_(1) - p_(2) of p_lo
                flips += int(flip.sum())
                margins_at_flips.append(margin[flip])
                margins.append(margin)
        finally:
            lm.precision_layers = all_layers
            set_precision(all_layers, "high")
        at_flips, steps = torch.cat(margins_at_flips), torch.cat(margins)
        out[kind] = {
            "linears": stats["linears"], "weights": stats["weights"],
            "frac_low_differs": stats["differs"] / stats["weights"],
            "rel_err_low_vs_high": stats["lo_hi"] / stats["hi"],
            "rel_err_high_vs_source": stats["hi_src"] / stats["src"],
            "flips": flips, "flip_rate": flips / steps.numel(),
            "flip_margin_median": float(at_flips.median()) if flips else None,
            "flip_margin_below_0.1": float((at_flips < 0.1).double().mean()) if flips else None,
            "step_margin_median": float(steps.median()),
        }
        log.info("  source %s: %d linears, low differs on %.4f of weights, rel err lo/hi %.2e, flips %d (%.4f)",
                 kind, stats["linears"], out[kind]["frac_low_differs"], out[kind]["rel_err_low_vs_high"], flips,
                 out[kind]["flip_rate"])
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the replay study (options: the module docstring and ``--help``); argv None reads ``sys.argv``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=sorted(TARGETS), default="smollm2")
    p.add_argument("--num_prompts", type=int, default=12)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--groups", type=str, default="none,128,64,32", help="'none' = per-channel")
    p.add_argument("--slicings", type=str, default="midpoint,round")
    p.add_argument("--scheme", choices=("symmetric", "asymmetric"), default="symmetric")
    p.add_argument("--code_range", type=int, default=240, help="R, the largest asymmetric code")
    p.add_argument("--quantize_lm_head", action="store_true")
    p.add_argument("--by_source", action="store_true", help="weight statistics and flips per GGML source type")
    p.add_argument("--bootstrap_samples", type=int, default=300)
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="linear kernels of the float layers left after quantization (draftkit.kernels)")
    p.add_argument("--output", type=str, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from draftkit.target.frozen import load_target
    from draftkit.target.tokens import stop_token_ids

    ref, chat = TARGETS[args.target]
    out_path = Path(args.output)
    report = json.loads(out_path.read_text()) if out_path.exists() else {}
    report.setdefault("entries", {})
    report["setup"] = {
        "target": ref, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg()[0], "cpus": os.cpu_count(), "kernels": args.kernels,
    }
    tag = "sym" if args.scheme == "symmetric" else f"asym{args.code_range}"
    tag += "+head" if args.quantize_lm_head else ""
    types = source_types(resolve_artifact(ref)) if args.by_source else None
    model, tok = load_target(ref, "float32")
    _, evaluation, _ = split_prompts(load_prompts("mt-bench"), 20, None, 0)
    prompts = [encode_prompt(r, tok, "chat" if chat else "plain") for r in evaluation[: args.num_prompts]]
    decoding = DecodeConfig(args.max_new_tokens, eos_token_ids=tuple(stop_token_ids(tok, model.generation_config)))
    for group in args.groups.split(","):
        group_size = None if group == "none" else int(group)
        keys = {s: f"{args.target}/{tag}/{group}/{s}" for s in args.slicings.split(",")}
        if all(k in report["entries"] for k in keys.values()):
            continue
        quant = {"scheme": args.scheme, "code_range": args.code_range, "quantize_lm_head": args.quantize_lm_head}
        lms = {s: TargetSession.with_precision_switch(copy.deepcopy(model),
                                                  QuantConfig(slicing=s, group_size=group_size, **quant))
               for s in keys}
        packed = {s: pack_linears(lm.target.model, args.kernels) for s, lm in lms.items()}  # after quantizing
        first = next(iter(lms.values()))
        t0 = time.perf_counter()
        trajs = []
        for i, prompt in enumerate(prompts):
            trajs.append(greedy_decode(first, prompt, decoding, "high", keep_logits=False).tokens)
            log.info("%s group %s: all-high prompt %d/%d (%d tokens)", args.target, group, i + 1, len(prompts),
                     len(trajs[-1]))
        t_decode = time.perf_counter() - t0
        for slicing, lm in lms.items():
            if keys[slicing] in report["entries"]:
                continue
            t1 = time.perf_counter()
            steps: list[ReplaySteps] = []
            high_argmax = []
            for prompt, tokens in zip(prompts, trajs):
                st, high = replay_steps(lm, prompt, tokens)
                steps.append(st)
                high_argmax.append(high.argmax(dim=-1))  # (n,)
            m = replay_metrics(steps, bootstrap_samples=args.bootstrap_samples)
            wb = lm.precision_bytes
            alpha = 1.0 - m["flip_rate"]
            entry = {
                "group_size": group_size, "slicing": slicing, **quant,
                **{k: m[k] for k in ("num_prompts", "num_steps", "num_flips", "flip_rate", "auc_entropy",
                                     "auc_entropy_ci", "auc_margin", "auc_margin_ci", "pr_auc_entropy",
                                     "pr_auc_margin", "catch_at_budget", "catch_at_budget_ci")},
                "weight_bytes": wb.to_dict(),
                "gate_ratio_at_0.15": {c: gated_bytes_per_token(wb, 0.15, c) / wb.high for c in COST_MODELS},
                "verified_ratio_iid": {str(k): expected_verified_ratio(wb.rho, alpha, k) for k in (1, 2, 3, 4)},
                "timing_s": {"all_high_decode": t_decode, "replay": time.perf_counter() - t1},
                "load_average": os.getloadavg()[0],
                "kernels": packed[slicing].as_dict(),
            }
            if types is not None:
                t2 = time.perf_counter()
                entry["by_source"] = by_source(lm, model, prompts, trajs, high_argmax, types)
                entry["timing_s"]["by_source"] = time.perf_counter() - t2
            report["entries"][keys[slicing]] = entry
            write_json_atomic(out_path, report)
            c = entry["catch_at_budget"]
            log.info("%s: flip %.3f AUC H %.3f -m %.3f catch@15 margin %.3f entropy %.3f rho %.3f verified(k=2) %.3f",
                     keys[slicing], entry["flip_rate"], entry["auc_entropy"], entry["auc_margin"],
                     c["margin"]["0.15"], c["entropy"]["0.15"], wb.rho, entry["verified_ratio_iid"]["2"])
        for handle in packed.values():
            handle.release()
        del lms, first, packed
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
