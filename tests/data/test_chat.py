"""Readers, malformed records, the cut-off ShareGPT file, and the assistant loss mask."""

import json

import pytest
import torch

from draftkit.data.chat import TemplateError, read_conversations, tokenize_conversation
from draftkit.data.collate import collate
from draftkit.data.datamodule import ChatDataModule
from draftkit.data.sampler import ResumableLoader


def _write_sharegpt(path, records, cut=False):
    text = json.dumps(records, indent=2)
    if cut:
        text = text[: text.rindex('"value"') + 12]  # stop inside the last record
    path.write_text(text)


def test_sharegpt_cut_off_reads_complete_records_and_warns_once(tmp_path):
    recs = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(5)
    ]
    path = tmp_path / "sg.json"
    _write_sharegpt(path, recs, cut=True)
    with pytest.warns(UserWarning, match=r"cut off mid-record at byte \d+: read the 4 complete records") as rec:
        convs, summary = read_conversations(str(path))
    assert len([w for w in rec if "cut off" in str(w.message)]) == 1
    assert len(convs) == 4 and summary.kept == 4
    assert convs[0] == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]
    assert summary.cut_offset == len(path.read_text()[: path.read_text().index('{\n    "id": "4"')].encode())


def test_malformed_records_are_skipped_and_counted(tmp_path):
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    recs = [
        good,
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "gpt", "value": "leading model turn"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    path = tmp_path / "sg.json"
    _write_sharegpt(path, recs)
    convs, summary = read_conversations(str(path))
    assert len(convs) == 2
    assert convs[1][0]["role"] == "user"  # the leading assistant turn is dropped
    assert dict(summary.skipped) == {
        "empty conversation": 1, "no assistant turn": 1, "non-string content": 1, "unknown role": 1,
    }


def test_corrupt_json_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"conversations": []}, {"conversations": [}, {"conversations": []}]')
    with pytest.raises(ValueError, match=r"bad.json: record 1 is corrupt JSON "
                       r"\(Expecting value at line 1 column 44\); fix or remove that record"):
        read_conversations(str(path))


def test_a_corrupt_jsonl_line_is_skipped_naming_its_place_once(tmp_path):
    """The skip names the line and the column where the JSON broke, the place said once (json's "... starting at"
    message takes it directly)."""
    path = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    path.write_text(good + "\n" + '{"messages": [{"role": "user", "content": "cut\n' + good + "\n")
    convs, summary = read_conversations(str(path))
    assert len(convs) == 2
    assert summary.skips == [("line 2", "corrupt JSON line", "Unterminated string starting at column 43")]


def test_a_directory_of_chat_files_or_nothing_is_refused_and_a_saved_dataset_dict_reads(tmp_path, tiny_chat_jsonl):
    """A folder of chat JSONL files went to ``datasets``, which failed on two formats or read only a saved dataset
    below it; an empty folder gave datasets' own message. A ``save_to_disk`` DatasetDict (``dataset_dict.json``)
    reads as its split."""
    import shutil

    import datasets

    folder = tmp_path / "dir"
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"data.path {folder} is a directory that is empty; give one file"):
        read_conversations(str(folder))
    for name in ("a.jsonl", "b.jsonl.gz"):
        shutil.copy(tiny_chat_jsonl, folder / name)
    with pytest.raises(ValueError, match=rf"data.path {folder} is a directory that holds the chat files "
                       r"\['a.jsonl', 'b.jsonl.gz'\]; give one file \(join several JSONL files with cat"):
        read_conversations(str(folder))
    rows = [json.loads(line) for line in tiny_chat_jsonl.read_text().splitlines()]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved))
    convs, summary = read_conversations(str(saved))
    assert convs == read_conversations(str(tiny_chat_jsonl))[0] and summary.kept == len(rows)


def test_jsonl_chat_reader(tiny_chat_jsonl):
    convs, summary = read_conversations(str(tiny_chat_jsonl))
    assert summary.kept == 8 and convs[3][1] == {"role": "assistant", "content": "answer 3 ok"}


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        read_conversations(str(tmp_path / "nope.jsonl"))


def test_loss_mask_exact_on_chatml(tiny_tokenizer):
    msgs = [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"},
    ]
    out = tokenize_conversation(tiny_tokenizer, msgs)
    text = tiny_tokenizer.decode(out["input_ids"])
    masked = "".join(tiny_tokenizer.decode([i]) for i, m in zip(out["input_ids"], out["loss_mask"]) if m)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nab<|im_end|>\n"
    assert masked == "ok<|im_end|>ab<|im_end|>"
    # byte tokenizer: one token per byte; positions are exact
    ones = [i for i, m in enumerate(out["loss_mask"]) if m]
    start = len(tiny_tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    assert ones[:3] == [start, start + 1, start + 2]


def test_template_without_assistant_span_is_an_error(tiny_tokenizer):
    drops_assistant = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(TemplateError, match="no assistant span found"):
        tokenize_conversation(tiny_tokenizer, msgs, chat_template=drops_assistant)


def test_truncation(tiny_tokenizer):
    """Truncation cuts input_ids and loss_mask alike: both are the first 40 entries of the full encoding."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 100}]
    full = tokenize_conversation(tiny_tokenizer, msgs)
    out = tokenize_conversation(tiny_tokenizer, msgs, max_length=40)
    assert len(out["input_ids"]) == len(out["loss_mask"]) == 40 and out["truncated"] and not full["truncated"]
    assert out["input_ids"] == full["input_ids"][:40] and out["loss_mask"] == full["loss_mask"][:40]
    assert sum(out["loss_mask"]) == 40 - len(tiny_tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"])


def test_cache_key_covers_what_changes_tokenization(tiny_target_dir, tiny_chat_jsonl, monkeypatch):
    """The tokenized-data key changes with the tokenization code (or draftkit's version), the chat template
    and max_length, and only then."""
    import draftkit
    import draftkit.data.chat as chat
    import draftkit.data.datamodule as datamodule

    def key(**kwargs) -> str:
        return ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), **kwargs).fingerprint()

    base = key()
    assert key() == base
    assert key(max_length=64) != base
    assert key(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}") != base
    monkeypatch.setattr(datamodule, "tokenization_fingerprint", lambda: "0" * 16)  # the tokenization code changed
    assert key() != base
    monkeypatch.undo()
    assert key() == base
    code = chat.tokenization_fingerprint()
    chat.tokenization_fingerprint.cache_clear()
    monkeypatch.setattr(draftkit, "__version__", "0.0.0-other")
    assert chat.tokenization_fingerprint() != code
    chat.tokenization_fingerprint.cache_clear()
    monkeypatch.undo()
    assert chat.tokenization_fingerprint() == code


def test_tokenizer_without_chat_template(tmp_path, tiny_target_dir, tiny_chat_jsonl):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").unlink(missing_ok=True)
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tmp_path / "tok"))
    with pytest.raises(ValueError, match="has no chat template and data.chat_template is not set"):
        dm.setup("fit")


def test_collate_pads_right():
    batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_resumable_loader_continues_where_it_stopped():
    data = [{"input_ids": [i], "loss_mask": [1]} for i in range(10)]
    first = ResumableLoader(data, seed=3, shuffle=True, batch_size=2, collate_fn=collate)
    full = [b["input_ids"].flatten().tolist() for b in first]
    again = ResumableLoader(data, seed=3, shuffle=True, batch_size=2, collate_fn=collate)
    it = iter(again)
    seen = [next(it)["input_ids"].flatten().tolist() for _ in range(2)]
    state = again.state_dict()
    assert state == {"epoch": 0, "consumed": 2, "sequences": 4, "global_batch": 2, "world_size": 1, "bucket_window": 0}
    resumed = ResumableLoader(data, seed=3, shuffle=True, batch_size=2, collate_fn=collate)
    resumed.load_state_dict(state)
    rest = [b["input_ids"].flatten().tolist() for b in resumed]
    assert seen[:2] + rest == full
    assert sorted(sum(full, [])) == list(range(10))


def test_split_is_deterministic(tiny_target_dir, tiny_chat_jsonl):
    a = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), val_size=3, seed=1)
    b = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), val_size=3, seed=1)
    a.setup(), b.setup()
    assert a.val_set["input_ids"] == b.val_set["input_ids"] and len(a.val_set) == 3 and len(a.train_set) == 5
    counts = a.token_counts(320)
    assert int(counts.sum()) == sum(sum(m) for m in a.train_set["loss_mask"])
    assert isinstance(counts, torch.Tensor)


def test_max_records_still_reads_the_whole_file(tmp_path):
    recs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(5)]
    path = tmp_path / "sg.json"
    _write_sharegpt(path, recs, cut=True)
    with pytest.warns(UserWarning, match="read the 4 complete records"):
        convs, summary = read_conversations(str(path), max_records=2)
    assert [c[0]["content"] for c in convs] == ["q0", "q1"]
    assert (summary.kept, summary.usable) == (2, 4) and "first 2 of 4 usable" in str(summary)


def test_collate_supervise_all_marks_every_real_token():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [0]}]
    batch = collate(rows, 0, supervise="all")
    assert batch["loss_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] == batch["attention_mask"].tolist()
    assert collate(rows, 0)["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]
    with pytest.raises(ValueError, match="data.supervise must be one of assistant, all, got 'user'"):
        collate(rows, 0, supervise="user")


def test_supervise_all_trains_on_every_token_and_validates_on_the_assistant_ones(tiny_target_dir, tiny_chat_jsonl):
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), val_size=2, batch_size=2, supervise="all")
    dm.setup("fit")
    train = next(iter(dm.train_dataloader()))
    assert torch.equal(train["loss_mask"], train["attention_mask"])
    val = next(iter(dm.val_dataloader()))
    rows = [dm.val_set[i] for i in range(2)]
    assert torch.equal(val["loss_mask"], collate(rows, dm.pad_token_id)["loss_mask"])
    assert val["loss_mask"].sum() < val["attention_mask"].sum()
    with pytest.raises(ValueError, match="data.supervise must be one of assistant, all"):
        ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), supervise="everything")


def test_every_option_that_changes_the_rows_changes_its_key_and_no_other_does(tiny_target_dir, tiny_chat_jsonl,
                                                                              tmp_path):
    """The tokenized-data key (the cache folder) against each option one at a time: the options that change the
    tokenized rows change it; the split, sample and prompt-rule options change only the split fingerprint; the
    loader options change neither. A dropped tuple item in either hash fails here (issue 56)."""
    from draftkit.data.datamodule import SUPERVISE

    def both(path=str(tiny_chat_jsonl), **kwargs) -> tuple[str, str]:
        dm = ChatDataModule(path, tokenizer=str(tiny_target_dir), **kwargs)
        return dm._cache_key()[0], dm.fingerprint()

    key, split = both()
    other_supervise = next(s for s in SUPERVISE if s != "assistant")
    edited = tmp_path / "edited.jsonl"
    edited.write_text(tiny_chat_jsonl.read_text().replace("e", "E", 1))
    for changes_rows in ({"split": "validation"}, {"max_length": 64}, {"max_conversations": 3},
                         {"supervise": other_supervise}, {"path": str(edited)},
                         {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}):
        k, f = both(**changes_rows)
        assert k != key and f != split, changes_rows
    for changes_split in ({"val_size": 3}, {"seed": 1}, {"max_samples": 5}, {"dedup_prompts": False},
                         {"min_prompt_chars": 9}):
        k, f = both(**changes_split)
        assert k == key and f != split, changes_split
    for neither in ({"batch_size": 2}, {"num_workers": 1}, {"bucket_window": 4}, {"max_skip_fraction": 0.5}):
        assert both(**neither) == (key, split), neither


# OpenAI-style list content: text parts joined (data.chat.content_text), other parts refused naming the record.

PARTS = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]


def test_list_content_of_text_parts_renders_as_the_joined_string(tmp_path, tiny_tokenizer):
    """A chat record whose user and assistant contents are lists of text parts reads, renders and masks exactly as
    the record with the parts joined by a newline (vLLM's join for string templates)."""
    parts = {"id": "parts", "messages": [{"role": "user", "content": PARTS},
                                         {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]}
    joined = {"id": "joined", "messages": [{"role": "user", "content": "Name a colour.\nOne word."},
                                           {"role": "assistant", "content": "Red."}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(parts) + "\n" + json.dumps(joined) + "\n")
    (a, b), summary = read_conversations(str(path))
    assert summary.records == ["parts", "joined"] and a == b
    assert tiny_tokenizer.apply_chat_template(a, tokenize=False) == (
        "<|im_start|>user\nName a colour.\nOne word.<|im_end|>\n<|im_start|>assistant\nRed.<|im_end|>\n")
    assert tokenize_conversation(tiny_tokenizer, a) == tokenize_conversation(tiny_tokenizer, joined["messages"])


def test_non_text_parts_are_refused_naming_the_file_record_and_part_type(tmp_path):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    records = [
        {"id": "pic", "messages": [{"role": "user", "content": [PARTS[0], image]}, {"role": "assistant", "content": "Red."}]},
        {"id": "nul", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]},
                                   {"role": "assistant", "content": "x"}]},
        {"id": "ok", "messages": [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "Red."}]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    convs, summary = read_conversations(str(path))
    assert summary.records == ["ok"]
    assert summary.skips == [
        ("pic", "non-text content part",
         "turn 0 content part 1 is 'image_url': draftkit reads text only; drop the image_url parts or the record"),
        ("nul", "non-string content", 'turn 0 content part 0 is not a {"type": "text", "text": string} object '
                                      "(got object)"),
    ]
    assert str(summary).startswith(f"{path}: 1 conversations kept; skipped: 1 non-string content (nul: ")
    assert "1 non-text content part (pic: turn 0 content part 1 is 'image_url'" in str(summary)
