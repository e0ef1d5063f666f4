"""The one prompt reader: formats, records, BOM, errors naming file and record, calibration split."""

import json

import pytest

from draftkit.data.prompts import Prompt, load_prompts, split_prompts


def test_load_prompts_formats(tmp_path, prompts_file):
    prompts = load_prompts(str(prompts_file))
    assert prompts[0] == Prompt("7", [{"role": "user", "content": "Tell me a story."}])
    assert prompts[2].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert len(load_prompts(str(prompts_file), num_prompts=2)) == 2
    array = tmp_path / "p.json"
    array.write_text(json.dumps(["one", {"conversations": [{"from": "human", "value": "two"}]}]))
    assert [p.messages[0]["content"] for p in load_prompts(str(array))] == ["one", "two"]


def test_a_request_keeps_its_history_and_a_whole_conversation_gives_its_first_question(tmp_path):
    """A messages list ending with a user turn is a multi-turn request (as an engine receives it, e.g. MT-bench's
    second turn after the target's own first answer): kept whole. Before, its history was dropped silently and the
    first question evaluated instead. A list ending with an assistant turn is a whole conversation: its first
    question (system turn kept, opening assistant turns skipped)."""
    u1, a1, u2, a2 = ({"role": r, "content": c} for r, c in
                      (("user", "Name a colour."), ("assistant", "Blue."), ("user", "Another?"), ("assistant", "Red.")))
    system = {"role": "system", "content": "Be brief."}
    records = [
        {"id": "request", "messages": [system, u1, a1, u2]},
        {"id": "conversation", "messages": [system, u1, a1, u2, a2]},
        {"id": "opens-with-model", "messages": [a1, u1, a2, u2]},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "Name a colour."},
                                             {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "Another?"}]},
        {"id": "two-users", "messages": [u1, u2, a2]},
    ]
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = {p.id: p.messages for p in load_prompts(str(path))}
    assert got == {
        "request": [system, u1, a1, u2],
        "conversation": [system, u1],
        "opens-with-model": [u1, a2, u2],
        "sharegpt": [u1, a1, u2],
        "two-users": [u1, u2],
    }
    assert load_prompts(str(path))[0].text == "Another?"


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"foo": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl record 2"):
        load_prompts(str(bad))
    for blank in ('{"messages": [{"role": "user", "content": ""}]}', '{"turns": ["  "]}',
                  '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, '
                  '{"role": "user", "content": " \\n"}]}'):
        bad.write_text('{"prompt": "fine"}\n' + blank + "\n")
        with pytest.raises(ValueError, match=r"bad.jsonl record 2 has no prompt text"):
            load_prompts(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_prompts(str(empty))
    with pytest.raises(FileNotFoundError):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_text_files_answers_and_bom(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first line\n\n  second line  \n")
    assert [(p.id, p.text) for p in load_prompts(str(txt))] == [("1", "first line"), ("3", "second line")]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "question": "q?", "answer": "#### 42"}\n{"text": "t"}\n')
    prompts = load_prompts(str(bom))
    assert prompts[0] == Prompt("a", [{"role": "user", "content": "q?"}], answer="#### 42")
    assert prompts[1].answer is None and prompts[1].id == "2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "cut\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON "
                       r"\(Unterminated string starting at column 12\)"):
        load_prompts(str(bad))


def test_prompt_files_in_other_encodings_gzip_or_a_directory(tmp_path):
    """A Latin-1 byte, a UTF-16 file, a .jsonl.gz and a directory gave a bare UnicodeDecodeError naming no file (or
    "does not exist" for a directory that exists)."""
    import gzip

    lines = '{"id": "a", "prompt": "caf\u00e9?"}\n{"prompt": "two"}\n'
    (tmp_path / "p.jsonl").write_text(lines, encoding="utf-8")
    want = [(p.id, p.text) for p in load_prompts(str(tmp_path / "p.jsonl"))]
    assert want == [("a", "caf\u00e9?"), ("2", "two")]
    (tmp_path / "p16.jsonl").write_text(lines, encoding="utf-16")
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "p.json.gz").write_bytes(gzip.compress(json.dumps([{"id": "a", "prompt": "caf\u00e9?"}, "two"]).encode()))
    for name in ("p16.jsonl", "p.jsonl.gz", "p.json.gz"):
        assert [(p.id, p.text) for p in load_prompts(str(tmp_path / name))] == want, name
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"--prompts: .*latin\.jsonl line 2 is not UTF-8 text \(U\+DCE9"):
        load_prompts(str(tmp_path / "latin.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"is a directory"):
        load_prompts(str(tmp_path))


def test_split_is_disjoint_and_counts_overlap(tmp_path):
    source = [Prompt(str(i), [{"role": "user", "content": f"q{i}"}]) for i in range(6)]
    calib, evaluation, overlap = split_prompts(source, 2, 3, seed=0)
    assert len(calib) == 2 and len(evaluation) == 3 and overlap == 0
    assert not {p.id for p in calib} & {p.id for p in evaluation}
    assert split_prompts(source, 2, 3, seed=0) == (calib, evaluation, 0)  # seeded
    _, evaluation, overlap = split_prompts(source, [source[1], source[4]], None)
    assert len(evaluation) == 6 and overlap == 2
    with pytest.raises(ValueError, match="only 4 prompts remain"):
        split_prompts(source, 2, 5)


def test_encode_prompt_chat_plain_auto_and_ids(tiny_tokenizer):
    from draftkit.data.prompts import encode_prompt, resolve_template
    from draftkit.target.tokens import encode_chat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = Prompt("p", messages)
    assert encode_prompt(prompt, tiny_tokenizer) == encode_chat(tiny_tokenizer, messages)
    assert encode_prompt(prompt, tiny_tokenizer, "auto") == encode_chat(tiny_tokenizer, messages)  # it has a template
    two = Prompt("q", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "c"}])
    # plain: the history's answer is part of the text a base model reads (it was left out before: "a\n\nc")
    assert encode_prompt(two, tiny_tokenizer, "plain") == tiny_tokenizer("a\n\nb\n\nc")["input_ids"]
    assert encode_prompt(Prompt("i", ids=[5, 6, 7]), None, "plain") == [5, 6, 7]
    with pytest.raises(ValueError, match="prompt p: text prompts need a tokenizer"):
        encode_prompt(prompt, None)
    with pytest.raises(ValueError, match="--template must be one of auto, chat, plain"):
        encode_prompt(prompt, tiny_tokenizer, "raw")
    template, tiny_tokenizer.chat_template = tiny_tokenizer.chat_template, None
    try:
        assert resolve_template("auto", tiny_tokenizer) == "plain"
        assert encode_prompt(prompt, tiny_tokenizer, "auto") == tiny_tokenizer("hi")["input_ids"]
        with pytest.raises(ValueError, match="the tokenizer of base-model has no chat template"):
            resolve_template("chat", tiny_tokenizer, "base-model")
    finally:
        tiny_tokenizer.chat_template = template


def test_prompt_messages_with_text_parts_and_the_refusal_of_other_parts(tmp_path):
    """OpenAI-style list content in a prompt file reads as the parts joined (``data.chat.content_text``, the
    training reader's function); an audio part is refused naming the option, file, record, turn and part type."""
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": parts}]}) + "\n"
                    + json.dumps({"id": "b", "messages": [{"role": "user", "content": "Name a colour.\nOne word."}]}))
    a, b = load_prompts(str(path))
    assert a.messages == b.messages == [{"role": "user", "content": "Name a colour.\nOne word."}]
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [parts[0], audio]}]}))
    with pytest.raises(ValueError) as err:
        load_prompts(str(path))
    assert str(err.value) == (f"--prompts: {path} record 2: turn 1 content part 1 is 'input_audio': draftkit reads "
                              "text only; drop the input_audio parts or the record")


def test_a_generate_output_reads_as_prompts_without_its_header(tmp_path):
    """``evaluate --prompts regen.jsonl.gz`` (held-out conversations of a ``draftkit generate`` output) stopped at
    "record 1 has no prompt text": the header line. It is skipped as the training reader skips it; each record's
    prompt is its messages up to the first assistant turn."""
    import gzip

    records = [{"header": {"format": "draftkit-regenerated-chat/1", "counts": {"records": 2}}}] + [
        {"id": f"c{i}", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"},
                                     {"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": "more"},
                                     {"role": "assistant", "content": "b"}], "stop": ["eos", "eos"]} for i in range(2)]
    path = tmp_path / "regen.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    prompts = load_prompts(str(path))
    assert [(p.id, p.messages) for p in prompts] == [
        (f"c{i}", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}]) for i in range(2)]
    # a header anywhere else is no prompt: still refused, naming the record
    (tmp_path / "mid.jsonl").write_text(json.dumps(records[1]) + "\n" + json.dumps(records[0]) + "\n")
    with pytest.raises(ValueError, match=r"mid\.jsonl record 2 has no prompt text"):
        load_prompts(str(tmp_path / "mid.jsonl"))
