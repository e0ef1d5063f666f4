"""Every record trains or is named with a reason: encodings real files carry, skip lists, runs without signal.

The ``case_*`` tests are the failing inputs of issue 14 (user cases), verbatim inline; the others are more inputs
of the same kind.
"""

import json
import zlib
from pathlib import Path

import pytest
import yaml

from draftkit.data.chat import describe_skips, read_conversations
from draftkit.data.datamodule import ChatDataModule

CASE_LONE_SURROGATE = (
    '[{"id": "ok1", "conversations": [{"from": "human", "value": "What is 1 plus 1?"}, '
    '{"from": "gpt", "value": "1 plus 1 is 2."}]},\n'
    ' {"id": "lone-surrogate", "conversations": [{"from": "human", "value": "A lone surrogate \\ud800 here"}, '
    '{"from": "gpt", "value": "Noted."}]},\n'
    ' {"id": "ok2", "conversations": [{"from": "human", "value": "What is 2 plus 2?"}, '
    '{"from": "gpt", "value": "2 plus 2 is 4."}]}]\n'
)
CASE_BOM = (
    '\ufeff{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}\n'
    '{"messages": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]}\n'
)
CASE_SKIPS = [
    {"id": "ok1", "conversations": [{"from": "human", "value": "Name a color."}, {"from": "gpt", "value": "Blue."}]},
    {"id": "bad-null", "conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "ok"}]},
    {"id": "bad-empty", "conversations": []},
    {"id": "ok2", "conversations": [{"from": "human", "value": "Name a fruit."}, {"from": "gpt", "value": "Apple."}]},
]


def _chat(i, q="q", a="a"):
    return {"messages": [{"role": "user", "content": f"{q}{i}"}, {"role": "assistant", "content": f"{a}{i}"}]}


def test_case_lone_surrogate_is_skipped_with_its_id_and_the_others_train(tmp_path, tiny_target_dir):
    path = tmp_path / "lone-surrogate.json"
    path.write_text(CASE_LONE_SURROGATE)
    convs, summary = read_conversations(str(path))
    assert summary.records == ["ok1", "ok2"] and len(convs) == 2
    assert summary.skips == [(
        "lone-surrogate", "unencodable text",
        "turn 0 has U+D800 at character 17 (a lone surrogate or an invalid UTF-8 byte); fix the text or the "
        "file's encoding",
    )]
    # 1 of 3 records skipped is above the default data.max_skip_fraction (0.2)
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=0, max_skip_fraction=0.5)
    dm.setup("fit")  # used to crash in pyarrow with UnicodeEncodeError
    assert len(dm.train_set) == 2
    assert [s["record"] for s in dm.stats["skips"]] == ["lone-surrogate"]


def test_invalid_utf8_bytes_crlf_and_bom_lines_in_jsonl(tmp_path):
    """Another encoding fault: a Latin-1 byte in a UTF-8 file; CRLF line ends and a BOM on a concatenated line."""
    lines = [json.dumps(_chat(0)).encode(), json.dumps(_chat(1, q="caf\u00e9 ")).encode().replace(b"\\u00e9", b"\xe9"),
             "\ufeff".encode() + json.dumps({"id": "x2", **_chat(2)}).encode(), b"{not json"]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(lines) + b"\r\n")
    convs, summary = read_conversations(str(path))
    assert summary.records == ["line 1", "x2"]
    assert convs[1][0]["content"] == "q2"
    assert [(r, why) for r, why, _ in summary.skips] == [("line 2", "unencodable text"), ("line 4", "corrupt JSON line")]
    assert "U+DCE9 at character 3" in summary.skips[0][2]


def test_case_bom_jsonl_keeps_both_records(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_text(CASE_BOM, encoding="utf-8")
    convs, summary = read_conversations(str(path))
    assert (summary.kept, dict(summary.skipped)) == (2, {})
    assert convs[0] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def test_bom_and_crlf_json_array(tmp_path):
    """Another encoding fault: a ShareGPT array written by a Windows tool (BOM, CRLF)."""
    path = tmp_path / "win.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([_chat(0), _chat(1)], indent=1).replace("\n", "\r\n").encode())
    convs, summary = read_conversations(str(path))
    assert (summary.kept, summary.records, summary.skips) == (2, ["record 0", "record 1"], [])


def test_utf16_jsonl_with_its_byte_order_mark_reads_as_utf8(tmp_path):
    """A file PowerShell's ``>`` wrote (UTF-16 with a byte-order mark) read every line as corrupt JSON."""
    lines = "\r\n".join(json.dumps(_chat(i, q="caf\u00e9 ")) for i in range(3)) + "\r\n"
    for encoding in ("utf-16", "utf-16-be", "utf-32"):
        path = tmp_path / f"{encoding}.jsonl"
        data = lines.encode(encoding)
        path.write_bytes(data if encoding != "utf-16-be" else b"\xfe\xff" + data)
        convs, summary = read_conversations(str(path))
        assert (summary.kept, summary.skips) == (3, []), encoding
        assert convs[2][0]["content"] == "caf\u00e9 2"


def test_gzip_cut_off_reads_the_lines_before_the_cut_with_one_warning(tmp_path):
    """A .jsonl.gz cut off mid-stream (a partial copy) raised a bare EOFError naming no file."""
    import gzip

    whole = gzip.compress("".join(json.dumps(_chat(i, q="x" * 200)) + "\n" for i in range(40)).encode(), mtime=0)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.warns(UserWarning, match=r"cut\.jsonl\.gz is cut off: its gzip stream ends early") as rec:
        convs, summary = read_conversations(str(path))
    assert len([w for w in rec if "cut off" in str(w.message)]) == 1
    text = zlib.decompressobj(wbits=31).decompress(path.read_bytes())  # what the cut stream holds
    complete = text.count(b"\n")
    assert complete >= 1 and summary.kept == complete
    assert [c[0]["content"] for c in convs] == [f"{'x' * 200}{i}" for i in range(complete)]
    assert [(r, why) for r, why, _ in summary.skips] == [(f"line {complete + 1}", "corrupt JSON line")]


def test_wrong_container_for_the_file_name_is_named_with_the_fix(tmp_path):
    """JSON Lines in a .json, an array in a .jsonl, plain text named .gz, an empty .json: one line each naming the
    file and what to do (they raised a parser message or were read as one malformed record)."""
    records = [_chat(0), _chat(1)]
    cases = {
        "lines.json": ("\n".join(map(json.dumps, records)), r"lines\.json starts with an object.*name the file \.jsonl"),
        "array.jsonl": (json.dumps(records), r"array\.jsonl line 1 holds a JSON array of 2 records.*\.json"),
        "plain.jsonl.gz": (json.dumps(records[0]), r"plain\.jsonl\.gz is not readable gzip data.*drop the \.gz"),
        "empty.json": ("", r"empty\.json is empty"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            read_conversations(str(tmp_path / name))


def test_json_gz_and_upper_case_names_read_as_local_files(tmp_path):
    """A gzipped ShareGPT array went to the Hugging Face Hub as a dataset id (retries, then ConnectionError)."""
    import gzip

    (tmp_path / "a.json").write_text(json.dumps([_chat(0), _chat(1)]))
    (tmp_path / "a.json.gz").write_bytes(gzip.compress((tmp_path / "a.json").read_bytes()))
    plain, gz = read_conversations(str(tmp_path / "a.json")), read_conversations(str(tmp_path / "a.json.gz"))
    assert gz[0] == plain[0] and gz[1].records == plain[1].records == ["record 0", "record 1"]
    (tmp_path / "UPPER.JSONL").write_text("\n".join(json.dumps(_chat(i)) for i in range(2)))  # went to the Hub too
    upper = read_conversations(str(tmp_path / "UPPER.JSONL"))
    assert upper[0] == plain[0] and upper[1].records == ["line 1", "line 2"]


def test_case_skips_name_their_records_and_reasons(tmp_path):
    path = tmp_path / "skips-without-ids.json"
    path.write_text(json.dumps(CASE_SKIPS))
    _, summary = read_conversations(str(path))
    assert summary.skips == [
        ("bad-null", "non-string content", "turn 0 content is null"),
        ("bad-empty", "empty conversation", "no turns"),
    ]
    assert str(summary) == (
        f"{path}: 2 conversations kept; skipped: 1 empty conversation (bad-empty: no turns), "
        "1 non-string content (bad-null: turn 0 content is null)"
    )


def test_reason_labels_say_what_happened(tmp_path):
    """Records without ids are named by position; a missing key, an unknown role, a missing content are each
    their own reason, and only the first 3 records of a reason are listed in the summary."""
    recs = [
        {"convos": []},
        {"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"value": "hi"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "q"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},
        {"conversations": "hi"},
        *[{"id": f"e{i}", "conversations": []} for i in range(5)],
    ]
    path = tmp_path / "reasons.json"
    path.write_text(json.dumps(recs))
    _, summary = read_conversations(str(path))
    assert [(r, why) for r, why, _ in summary.skips[:7]] == [
        ("record 0", "no conversation key"), ("record 1", "unknown role"), ("record 2", "missing content"),
        ("record 3", "missing role"), ("record 4", "no assistant turn"), ("record 5", "empty assistant turn"),
        ("record 6", "conversation not a list"),
    ]
    assert summary.skips[0][2] == "no conversations/messages key (keys: convos)"
    assert summary.skips[1][2] == "turn 0 role 'alien'"
    assert "5 empty conversation (e0: no turns, e1: no turns, e2: no turns, ... 2 more)" in describe_skips(summary.skips)


def test_skip_list_is_written_beside_the_run_logs(tmp_path, tiny_target_dir):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    path = tmp_path / "d.json"
    path.write_text(json.dumps([*[_chat(i, q="question ") for i in range(4)], {"id": "bad", "conversations": []}]))
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=64, val_size=1)
    dm.trainer = pl.Trainer(logger=CSVLogger(tmp_path / "logs", name="csv"), default_root_dir=tmp_path)
    dm.setup("fit")
    written = json.loads((tmp_path / "logs" / "csv" / "version_0" / "skipped_records.json").read_text())
    assert written == [{"record": "bad", "reason": "empty conversation", "detail": "no turns"}]


# -- runs without signal (item 2, data side) ------------------------------------------------------------------


def test_case_all_truncated_stops_before_anything_is_written(tmp_path, monkeypatch):
    """Every assistant span lies past data.max_length=128: the fit stops in prepare_data, naming the cause and
    the option, and leaves no TensorBoard file, checkpoint or config behind."""
    from draftkit.cli import DraftkitCLI

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    data = tmp_path / "all-truncated.json"
    data.write_text(json.dumps([
        {"id": f"t{i}", "conversations": [{"from": "human", "value": "x" * 400}, {"from": "gpt", "value": "ok"}]}
        for i in range(4)
    ]))
    run = tmp_path / "run"
    override = tmp_path / "o.yaml"
    override.write_text(yaml.safe_dump({
        "trainer": {"default_root_dir": str(run), "logger": {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(run), "name": "tb"}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(run / "ckpt")}}]},
        "data": {"path": str(data), "val_size": 0},
    }))
    with pytest.raises(ValueError) as err:
        DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(override)])
    assert str(err.value) == (
        f"no trainable tokens in {data}: every one of the 4 conversations read, 4 lost their assistant tokens "
        "to truncation at data.max_length=128; raise data.max_length (the shortest needs 420 tokens)"
    )
    assert not run.exists()


def test_mixed_no_signal_causes_and_names(tmp_path, tiny_target_dir):
    """Another no-signal input: one conversation truncated away, one whose only assistant turn the template
    renders first (position 0 has no previous token to predict it from)."""
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "d.json"
    path.write_text(json.dumps([
        {"id": "long", "conversations": [{"from": "human", "value": "x" * 100}, {"from": "gpt", "value": "ok"}]},
        {"id": "one-token", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "k"}]},
    ]))
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), chat_template=bare, max_length=50, val_size=0)
    with pytest.raises(ValueError, match=(
        r"no trainable tokens in .*d.json: of the 2 conversations read, 1 lost their assistant tokens to truncation "
        r"at data.max_length=50; raise data.max_length \(the shortest needs 101 tokens\); 1 have no assistant token "
        r"after position 0")):
        dm.prepare_data()
    _, stats = dm._load_or_build()
    assert [(s["record"], s["reason"]) for s in stats["skips"]] == [
        ("long", "assistant tokens lost to truncation"), ("one-token", "no trainable assistant token"),
    ]


def test_supervise_all_trains_conversations_whose_answers_lie_past_max_length(tmp_path, tiny_target_dir):
    """Under data.supervise: all every position >= 1 trains, so a conversation whose only answer starts past
    data.max_length trains on its prompt (under assistant it is dropped as lost to truncation); validation takes
    only conversations with an assistant token, and a too-large data.val_size is refused naming both."""
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"id": f"long{i}", "conversations": [{"from": "human", "value": f"{i} " + "x" * 100},
                                                  {"from": "gpt", "value": "ok"}]} for i in range(3)]
    rows += [{"id": f"short{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                                   {"from": "gpt", "value": f"answer {i}."}]} for i in range(4)]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    kw = dict(tokenizer=str(tiny_target_dir), chat_template=bare, max_length=50, val_size=2, min_prompt_chars=0,
              max_skip_fraction=1.0)
    assistant = ChatDataModule(str(path), **kw)
    assistant.setup("fit")
    assert (len(assistant.train_set), len(assistant.val_set)) == (2, 2)
    assert assistant.stats["lost_to_truncation"] == 3 and assistant.stats["prompt_only"] == 0
    every = ChatDataModule(str(path), supervise="all", **kw)
    every.setup("fit")
    assert every.stats["no_supervised_token"] == 0 and every.stats["prompt_only"] == 3
    assert sorted(every.train_set["record"]) == ["long0", "long1", "long2"] + sorted(assistant.train_set["record"])
    assert sorted(every.val_set["record"]) == sorted(assistant.val_set["record"])
    assert all(len(ids) == 50 for r, ids in zip(every.train_set["record"], every.train_set["input_ids"])
               if r.startswith("long"))
    assert not any(s["reason"] == "assistant tokens lost to truncation" for s in every.stats["skips"])
    more = tmp_path / "more.json"
    more.write_text(json.dumps(rows + [{**r, "id": r["id"] + "b", "conversations": [
        {"from": "human", "value": "b" + r["conversations"][0]["value"]}, r["conversations"][1]]} for r in rows[:3]]))
    too_many = ChatDataModule(str(more), supervise="all", **{**kw, "val_size": 5})  # 10 rows, 4 with an answer
    with pytest.raises(ValueError, match=r"data.val_size=5 wants more validation sequences than .*more.json has "
                                         r"with an assistant token within data.max_length=50 \(4\)"):
        too_many.setup("fit")


def test_val_size_larger_than_the_training_split_is_an_error(tiny_target_dir, tiny_chat_jsonl):
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), val_size=5)
    with pytest.raises(ValueError, match=r"data.val_size=5 holds out more sequences than it leaves for training: "
                                         r".*chat.jsonl has 8 trainable sequences; set data.val_size to at most 4"):
        dm.setup("fit")
    ok = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), val_size=4)
    ok.setup("fit")
    assert (len(ok.train_set), len(ok.val_set)) == (4, 4)


def test_generate_outputs_joined_with_cat_read_as_one_file(tmp_path):
    """Two ``draftkit generate`` outputs joined with ``cat`` (the way the data.path list refusal suggests): the
    second header line was read as a record and skipped as "no conversation key (keys: header)", counting toward
    data.max_skip_fraction. It is no record; the first header stays the file's."""

    def output(name, ids):
        rows = [{"header": {"format": "draftkit-regenerated-chat/1", "name": name}}] + [
            {"id": i, "messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
            for i in ids]
        return "".join(json.dumps(r) + "\n" for r in rows)

    both = tmp_path / "both.jsonl"
    both.write_text(output("first", ["a0", "a1"]) + output("second", ["b0"]))
    conversations, summary = read_conversations(str(both))
    assert summary.records == ["a0", "a1", "b0"] and len(conversations) == 3
    assert summary.skips == [] and summary.header["name"] == "first"
