"""benchmarks/mt_bench_turn2.py: MT-bench's second turns after the target's own greedy first answer, a prompt file
that the prompt reader keeps whole (history included)."""

import json

import pytest
import torch


def test_turn2_records_and_refusal(benchmark_module):
    mod = benchmark_module("mt_bench_turn2")
    questions = [{"question_id": 81, "turns": ["Q1", "Q2"]}, {"question_id": 82, "turns": ["R1", "R2"]}]
    assert mod.turn2_records(questions, {"82": "answer"}) == [{"question_id": 82, "messages": [
        {"role": "user", "content": "R1"}, {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "R2"}]}]
    with pytest.raises(ValueError, match="MT-bench question 7 has no two text turns"):
        mod.turn2_records([{"question_id": 7, "turns": ["only one"]}], {})


def test_the_first_answer_is_the_targets_greedy_answer(benchmark_module, tiny_target_dir, tiny_target,
                                                       tiny_tokenizer, tmp_path, capsys):
    from draftkit.data.prompts import load_prompts
    from draftkit.generation.regenerate import whole_characters
    from draftkit.target.tokens import encode_chat

    mod = benchmark_module("mt_bench_turn2")
    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": 81 + i, "turns": [f"Tell me about {w}.", f"And {w} again?"]}
            for i, w in enumerate(["cats", "rain", "tea"])]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "turn2.jsonl"
    assert mod.main(["--output", str(out), "--target", str(tiny_target_dir), "--engine", "torch", "--dtype", "float32",
                     "--max_new_tokens", "5", "--questions", str(questions)]) == 0  # float32 as the reference below
    # (auto is bf16 on a CPU with native bf16, whose greedy answers may part from float32's)
    printed = json.loads(capsys.readouterr().out)
    prompts = load_prompts(str(out))
    assert printed["prompts"] == len(prompts) == 3 - sum(printed["failed"].values())
    for p in prompts:
        row = next(r for r in rows if str(r["question_id"]) == p.id)
        assert [m["role"] for m in p.messages] == ["user", "assistant", "user"]
        assert (p.messages[0]["content"], p.messages[2]["content"]) == tuple(row["turns"])
        # the plain reference: Hugging Face greedy generate on the chat-templated first turn, float32
        ids = torch.tensor([encode_chat(tiny_tokenizer, p.messages[:1])])
        new = tiny_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                   pad_token_id=tiny_tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        if new and new[-1] == tiny_tokenizer.eos_token_id:
            new = new[:-1]
        else:  # cut at the length limit: up to its last whole character (a random model writes stray bytes)
            new = whole_characters(tiny_tokenizer, new)
        assert p.messages[1]["content"] == tiny_tokenizer.decode(new, skip_special_tokens=False)
