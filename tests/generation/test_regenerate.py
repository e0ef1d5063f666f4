"""``draftkit generate``: batched decoding equals plain decoding, resume, counted failures, the reader."""

import gzip
import inspect
import json
import logging

import pytest
import torch

from draftkit.data.chat import read_conversations
from draftkit.generation.output_file import read_output
from draftkit.generation.regenerate import FORMAT, RegenerateConfig, generate_batch, regenerate, whole_characters
from draftkit.decoding.verify import generate_plain
from draftkit.sampling import DecodeConfig
from draftkit.target.session import TargetSession
from draftkit.target.tokens import encode_chat

EOS = 257  # <|im_end|> of the tiny tokenizer


def _plain(target, prompt, max_new, stops=(), temperature=0.0, generator=None):
    cfg = DecodeConfig(max_new, temperature, eos_token_ids=tuple(stops))
    return generate_plain(TargetSession(target), torch.tensor(prompt), cfg, generator).tokens


def _prompt(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_greedy_batch_equals_plain_decoding_token_for_token(tiny):
    """Left-padded batched greedy decoding with a KV cache (rows leaving the batch as they stop) gives, row by
    row, exactly the tokens of plain cached decoding of the same prompt alone."""
    target, _ = tiny
    prompts = [[256, 10, 72, 101, 108, 108, 111], [256, 33] + list(range(40, 70)), [256, 5, 6], list(range(100, 117))]
    free = [_plain(target, p, 20) for p in prompts]
    stops = [free[0][4], free[2][9]]  # make rows 0 and 2 stop early, the others run to the length limit
    expected = [_plain(target, p, 20, stops) for p in prompts]
    assert len(expected[0]) <= 5 and len(expected[2]) <= 10 and max(map(len, expected)) == 20
    got = generate_batch(target.model, prompts, RegenerateConfig(max_new_tokens=20), stops, pad_id=258)
    assert [tokens for tokens, _ in got] == expected
    assert [stop for _, stop in got] == ["eos" if e[-1] in stops else "length" for e in expected]


def test_sampled_batch_equals_plain_decoding_with_the_same_generator(tiny):
    target, _ = tiny
    prompts = [[256, 10, 72, 101], [256, 33, 44, 55, 66, 77, 88, 99, 5]]
    cfg = RegenerateConfig(max_new_tokens=12, temperature=1.0)
    got = generate_batch(target.model, prompts, cfg, [], 258, [torch.Generator().manual_seed(s) for s in (3, 4)])
    for (tokens, _), p, s in zip(got, prompts, (3, 4)):
        assert tokens == _plain(target, p, 12, temperature=1.0, generator=torch.Generator().manual_seed(s))


def _write_source(path, n_good=7):
    rows = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}" + " more" * i},
                                          {"from": "gpt", "value": f"answer {i}"}]}
        for i in range(n_good)
    ]
    rows.insert(2, ["not", "an", "object"])  # skipped by the reader: its turns are not objects
    rows.insert(4, {"id": "bad-role", "messages": [{"role": "wizard", "content": "x"}]})  # unknown role
    rows.append({"id": "long", "messages": [{"role": "user", "content": "y" * 300}, {"role": "assistant", "content": "z"}]})
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def test_regenerate_first_turns_counts_bad_records_and_reads_back(tmp_path, tiny, tiny_target_dir):
    target, tokenizer = tiny
    src = _write_source(tmp_path / "src.jsonl")
    out = tmp_path / "regen.jsonl"
    cfg = RegenerateConfig(max_new_tokens=6, max_prompt_tokens=200)
    report = regenerate(str(src), str(out), str(tiny_target_dir), cfg, dtype="float32", batch_size=3, shard_size=3)
    header = json.loads(out.read_text().splitlines()[0])["header"]
    assert header["counts"]["failed"] == {"prompt too long": 1}
    assert header["counts"]["skipped_by_reader"] == {"turn not an object": 1, "unknown role": 1}
    assert header["source_ids"] == [f"c{i}" for i in range(7)] and header["counts"]["records"] == 7
    assert header["decode"]["temperature"] == 0.0 and header["decode"]["max_new_tokens"] == 6
    assert header["decode"]["stop_token_ids"] == [EOS]
    assert header["target_fingerprint"]["dtype"] == "float32" and len(header["target_fingerprint"]["config"]) == 16
    assert report["counts"] == header["counts"]
    conversations, summary = read_conversations(str(out))
    assert summary.header == header and summary.records == header["source_ids"] and not summary.skipped
    for i, messages in enumerate(conversations):
        user = [{"role": "user", "content": f"question {i}" + " more" * i}]
        assert messages[:1] == user and len(messages) == 2
        tokens = _plain(target, _prompt(tokenizer, user), 6, [EOS])
        # cut at the length limit: up to the last whole character (a random model writes stray UTF-8 bytes)
        answer = tokenizer.decode(tokens[:-1] if tokens[-1] == EOS else whole_characters(tokenizer, tokens))
        assert messages[1] == {"role": "assistant", "content": answer}
    assert not (tmp_path / "regen.jsonl.parts").exists()
    before, calls = out.read_bytes(), []
    regenerate(str(src), str(out), str(tiny_target_dir), cfg, dtype="float32", batch_size=3, shard_size=3,
               _after_batch=lambda: calls.append(1))
    assert calls == [] and out.read_bytes() == before  # rerun of a finished command: nothing to decode
    with pytest.raises(FileExistsError, match="made with other settings .* pass --overwrite"):
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=5, max_prompt_tokens=200),
                   dtype="float32", batch_size=3, shard_size=3)


def test_a_finished_file_extends_to_more_records(tmp_path, tiny_target_dir):
    """max_records 3 then all: the second run decodes only the new shards and writes the file a single run
    over all records writes; a file without a shard index is refused."""
    src = _write_source(tmp_path / "src.jsonl")
    kw = dict(cfg=RegenerateConfig(max_new_tokens=4, max_prompt_tokens=200), dtype="float32", batch_size=2, shard_size=3)
    whole = tmp_path / "whole.jsonl.gz"
    regenerate(str(src), str(whole), str(tiny_target_dir), **kw)
    grown, calls = tmp_path / "grown.jsonl.gz", []
    regenerate(str(src), str(grown), str(tiny_target_dir), max_records=3, **kw)
    assert json.loads(gzip.decompress(grown.read_bytes()).splitlines()[0])["header"]["counts"]["records"] == 3
    regenerate(str(src), str(grown), str(tiny_target_dir), _after_batch=lambda: calls.append(1), **kw)
    assert len(calls) == 3  # shards 1 (2 batches) and 2 (1 batch); shard 0 came from the file
    assert grown.read_bytes() == whole.read_bytes()
    with pytest.raises(FileExistsError, match=r"first 8 usable conversations; --max_records 4 \(4\) would drop some"):
        regenerate(str(src), str(grown), str(tiny_target_dir), max_records=4, **kw)
    assert grown.read_bytes() == whole.read_bytes()

    lines = gzip.decompress(whole.read_bytes()).decode().splitlines(keepends=True)
    header = json.loads(lines[0])
    no_index = json.dumps({"header": {k: v for k, v in header["header"].items() if k != "shards"}}) + "\n"
    bad_id = lines[2].replace(json.loads(lines[2])["id"], "other")
    damaged = {  # what a crash, a copy or an older draftkit leaves
        "no_index.jsonl": (no_index + "".join(lines[1:])).encode(),
        "cut_gzip.jsonl.gz": whole.read_bytes()[:-20],
        "not_gzip.jsonl.gz": "".join(lines).encode(),
        "not_utf8.jsonl": b"\xff\xfe" + "".join(lines).encode(),
        "lines_missing.jsonl": "".join(lines[:-2]).encode(),
        "line_not_json.jsonl": "".join(lines[:2] + ["{not json\n"] + lines[3:]).encode(),
        "line_of_another_record.jsonl": "".join(lines[:2] + [bad_id] + lines[3:]).encode(),
    }
    for name, data in damaged.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(FileExistsError, match="not a complete generate output with a shard index"):
            regenerate(str(src), str(path), str(tiny_target_dir), **kw)
        assert path.read_bytes() == data and not path.with_name(name + ".parts").exists(), name


def test_regenerating_a_regenerated_file_names_its_source(tmp_path, tiny_target_dir, caplog):
    """A recipe whose data is already regenerated (the default one) is not the place to grow the set from."""
    src = _write_source(tmp_path / "src.jsonl", n_good=2)
    cfg = RegenerateConfig(max_new_tokens=2, max_prompt_tokens=200)
    first = tmp_path / "regen.jsonl"
    regenerate(str(src), str(first), str(tiny_target_dir), cfg, dtype="float32")
    with caplog.at_level(logging.WARNING, logger="draftkit.generation.regenerate"):
        regenerate(str(first), str(tmp_path / "again.jsonl"), str(tiny_target_dir), cfg, dtype="float32")
    assert caplog.text.rstrip().endswith(f"To regenerate more of the original, pass --source {src}")
    assert "already regenerated" in caplog.text and "holds 2 of that source's conversations" in caplog.text


def test_resume_after_an_interrupted_shard_writes_the_same_file(tmp_path, tiny_target_dir):
    src = _write_source(tmp_path / "src.jsonl")
    cfg = RegenerateConfig(max_new_tokens=5, temperature=0.8, top_p=0.9, max_prompt_tokens=200, seed=7)
    kw = dict(cfg=cfg, dtype="float32", batch_size=2, shard_size=3)
    whole = tmp_path / "whole.jsonl.gz"
    regenerate(str(src), str(whole), str(tiny_target_dir), **kw)

    calls = []

    def crash():
        calls.append(1)
        if len(calls) == 4:  # shard 0 has 2 batches; the crash hits shard 1 after its first batch
            raise KeyboardInterrupt

    resumed = tmp_path / "resumed.jsonl.gz"
    with pytest.raises(KeyboardInterrupt):
        regenerate(str(src), str(resumed), str(tiny_target_dir), _after_batch=crash, **kw)
    index = json.loads((tmp_path / "resumed.jsonl.gz.parts" / "index.json").read_text())
    assert list(index["shards"]) == ["0"] and not resumed.exists()
    later = []
    regenerate(str(src), str(resumed), str(tiny_target_dir), _after_batch=lambda: later.append(1), **kw)
    assert len(later) == 3  # shards 1 and 2 only (2 + 1 batches), shard 0 was kept
    assert resumed.read_bytes() == whole.read_bytes()
    lines = gzip.decompress(whole.read_bytes()).decode().splitlines()
    assert len(lines) == 1 + 7 and json.loads(lines[0])["header"]["decode"]["seed"] == 7


def test_parts_made_with_other_settings_are_refused(tmp_path, tiny_target_dir):
    src = _write_source(tmp_path / "src.jsonl")
    out = tmp_path / "o.jsonl"

    calls = []

    def crash():
        calls.append(1)
        if len(calls) == 2:  # one batch per shard: shard 0 is written
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=3), dtype="float32",
                   shard_size=2, _after_batch=crash)
    with pytest.raises(FileExistsError, match=r"other settings \(\w+ vs \w+; decode.max_new_tokens differ\)"):
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=4), dtype="float32",
                   shard_size=2)


def test_every_turn_answers_the_regenerated_conversation(tmp_path, tiny, tiny_target_dir):
    target, tokenizer = tiny
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "old 1"}, {"role": "user", "content": "and?"},
            {"role": "assistant", "content": "old 2"}, {"role": "user", "content": "dangling"}]
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"messages": conv}) + "\n")
    out = tmp_path / "o.jsonl"
    regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=4, turns="all"), dtype="float32")
    (messages,), _ = read_conversations(str(out))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    for turn in (2, 4):
        tokens = _plain(target, _prompt(tokenizer, messages[:turn]), 4, [EOS])
        assert messages[turn]["content"] == tokenizer.decode(tokens[:-1] if tokens[-1] == EOS else tokens)
    assert messages[3] == conv[3] and messages[2]["content"] != "old 1"


def test_a_later_turn_the_template_cannot_render_ends_the_conversation_before_it(tmp_path, tiny, tiny_target_dir):
    """--turns all: a template error at a later turn keeps the answers before it (the record was failed whole, its
    earlier answers lost); at the first turn the record fails, counted by reason."""
    target, tokenizer = tiny
    template = ("{% for m in messages %}{% if 'BAD' in m['content'] %}{{ raise_exception('no') }}{% endif %}"
                "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    later = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old 1"},
             {"role": "user", "content": "BAD turn"}, {"role": "assistant", "content": "old 2"}]
    first = [{"role": "user", "content": "BAD first"}, {"role": "assistant", "content": "old"}]
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"id": "later", "messages": later}) + "\n" + json.dumps({"id": "first", "messages": first}) + "\n")
    out = tmp_path / "o.jsonl"
    header = regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=4, turns="all"),
                        dtype="float32", chat_template=template)
    assert header["counts"]["records"] == 1
    assert header["counts"]["failed"] == {"template error (TemplateError)": 1}
    (messages,), summary = read_conversations(str(out))
    assert summary.records == ["later"] and [m["role"] for m in messages] == ["user", "assistant"]
    tokens = _plain(target, encode_chat(tokenizer, messages[:1], template), 4, [EOS])
    assert messages[1]["content"] == tokenizer.decode(tokens[:-1] if tokens[-1] == EOS else tokens)


@pytest.mark.parametrize("kw,match", [
    (dict(turns="some"), "--turns"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_p=0.0), "top_p"),
    (dict(max_prompt_tokens=0), "max_prompt_tokens"),
])
def test_bad_settings_name_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        RegenerateConfig(**kw)


def test_generate_verb_writes_the_file_the_library_writes(tmp_path, tiny_target_dir):
    from draftkit.commands import main

    src = _write_source(tmp_path / "src.jsonl", n_good=3)
    lib, cli = tmp_path / "lib.jsonl", tmp_path / "cli.jsonl"
    regenerate(str(src), str(lib), str(tiny_target_dir), RegenerateConfig(max_new_tokens=3, max_prompt_tokens=200),
               dtype="float32")
    cli.write_text("stale")
    assert main(["generate", "--source", str(src), "--target", str(tiny_target_dir), "--output", str(cli),
                 "--max_new_tokens", "3", "--max_prompt_tokens", "200", "--dtype", "float32", "--overwrite"]) in (0, None)
    assert cli.read_bytes() == lib.read_bytes()


def test_read_output_splits_records_at_newlines_only(tmp_path):
    """An answer may hold U+2028 or U+0085 raw (JSON written with ensure_ascii=False): still one record."""
    header = {"header": {"format": FORMAT, "settings": "0" * 16, "shards": {"0": {"records": 2, "ids": ["a", "b"]}}}}
    records = [{"id": "a", "messages": [{"role": "assistant", "content": "x\u2028y\x85z"}]}, {"id": "b"}]
    path = tmp_path / "out.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [header, *records]).encode()))
    got_header, shards = read_output(path)
    assert got_header == header["header"] and [json.loads(line) for line in shards["0"]] == records


def test_a_source_with_text_part_lists_regenerates_as_the_joined_strings(tmp_path, tiny_target_dir):
    """OpenAI-style list content in a regeneration source (``data.chat.content_text``): the records equal those of
    the source with the parts joined; a record with an image part is counted as the reader's skip."""
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    listed, joined = tmp_path / "listed.jsonl", tmp_path / "joined.jsonl"
    listed.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": parts},
                                                          {"role": "assistant", "content": "old"}]}) + "\n"
                      + json.dumps({"id": "pic", "messages": [{"role": "user", "content": [image]},
                                                              {"role": "assistant", "content": "old"}]}) + "\n")
    joined.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Name a colour.\nOne word."},
                                                          {"role": "assistant", "content": "old"}]}) + "\n")
    cfg = RegenerateConfig(max_new_tokens=4)
    out = {}
    for src in (listed, joined):
        out[src] = tmp_path / f"{src.stem}-regen.jsonl"
        report = regenerate(str(src), str(out[src]), str(tiny_target_dir), cfg, dtype="float32")
    assert report["counts"]["skipped_by_reader"] == {}
    assert json.loads(out[listed].read_text().splitlines()[0])["header"]["counts"]["skipped_by_reader"] == {
        "non-text content part": 1}
    (a,), _ = read_conversations(str(out[listed]))
    (b,), _ = read_conversations(str(out[joined]))
    assert a == b and a[0] == {"role": "user", "content": "Name a colour.\nOne word."} and a[1]["content"] != "old"


def test_parallel_with_the_torch_engine_is_refused_naming_batch_size(tmp_path, tiny_target_dir, capsys):
    """``--parallel`` sets llama-server's slots; the torch engine used to ignore it silently. Any value but the
    default is refused naming the option to use, before anything loads or is written."""
    from draftkit.commands import main

    src, out = _write_source(tmp_path / "src.jsonl"), tmp_path / "o.jsonl"
    with pytest.raises(ValueError) as err:
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=2), parallel=4,
                   batch_size=3)
    assert str(err.value) == ("--parallel 4 sets llama-server's slots, which the torch engine does not use: it decodes "
                              "--batch_size prompts together (now 3); pass --batch_size 4 instead, or --engine "
                              "llama-server")
    assert main(["generate", "--source", str(src), "--target", str(tiny_target_dir), "--output", str(out),
                 "--parallel", "32"]) == 2
    assert capsys.readouterr().err.strip() == (
        "draftkit generate: error: --parallel 32 sets llama-server's slots, which the torch engine does not use: it "
        "decodes --batch_size prompts together (now 8); pass --batch_size 32 instead, or --engine llama-server")
    assert not out.exists() and not (tmp_path / "o.jsonl.parts").exists()


def test_batch_size_with_llama_server_is_refused_naming_parallel(tmp_path, tiny_target_dir):
    """The mirror case: ``--batch_size`` is the torch engine's; llama-server decodes ``--parallel`` conversations
    together, so any other value than the default is refused naming the option to use, before anything is written."""
    from draftkit.commands import generate as verb
    from draftkit.generation.regenerate import BATCH_SIZE, PARALLEL

    src, out = _write_source(tmp_path / "src.jsonl"), tmp_path / "o.jsonl"
    with pytest.raises(ValueError) as err:
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=2), batch_size=64,
                   engine="llama-server", parallel=4)
    assert str(err.value) == ("--batch_size 64 sets the torch engine's batch, which --engine llama-server does not "
                              "use: it decodes --parallel conversations together (now 4); pass --parallel 64 "
                              "instead, or --engine torch")
    assert not out.exists() and not (tmp_path / "o.jsonl.parts").exists()
    defaults = inspect.signature(verb).parameters  # the verb's defaults are the library's
    assert (defaults["batch_size"].default, defaults["parallel"].default) == (BATCH_SIZE, PARALLEL)


def test_ctrl_c_in_the_verb_exits_130_with_the_kept_shards_message_only(tmp_path, tiny_target_dir, monkeypatch,
                                                                         capsys, caplog):
    """A Ctrl-C in ``draftkit generate`` (a KeyboardInterrupt after shard 0, through the library's test hook) ends
    with its one warning (shards kept, the same command resumes) and exit code 130, as a stopped fit: no
    traceback and no error line."""
    import functools

    import draftkit.generation.regenerate as library
    from draftkit.commands import main

    calls = []

    def crash():
        calls.append(1)
        if len(calls) == 2:  # one batch per shard of 3 (batch_size 3): shard 0 written, shard 1 cut
            raise KeyboardInterrupt

    monkeypatch.setattr(library, "regenerate", functools.partial(library.regenerate, _after_batch=crash))
    src, out = _write_source(tmp_path / "src.jsonl"), tmp_path / "o.jsonl"
    args = ["generate", "--source", str(src), "--target", str(tiny_target_dir), "--output", str(out), "--dtype",
            "float32", "--max_new_tokens", "2", "--max_prompt_tokens", "200", "--batch_size", "3", "--shard_size", "3"]
    with caplog.at_level(logging.WARNING):
        try:
            code = main(args)
        except KeyboardInterrupt:  # raised on, pytest would stop the whole session
            pytest.fail("the Ctrl-C left draftkit generate with a traceback")
    assert code == 130
    parts = tmp_path / "o.jsonl.parts"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"generate: stopped (Ctrl-C) with 1 of 3 shards written to {parts}; the same command resumes from them"]
    err = capsys.readouterr().err  # the target's loading bar only
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "error" not in err
    assert list(json.loads((parts / "index.json").read_text())["shards"]) == ["0"] and not out.exists()


def test_sigterm_in_the_verb_exits_143_with_the_kept_shards_message(tmp_path, tiny_target_dir, monkeypatch, caplog):
    """A SIGTERM (a job scheduler's stop) is handled as a Ctrl-C: shard 0 kept, the claim on the output released,
    one warning naming SIGTERM, exit 143; afterwards SIGTERM's handler is the one before the run."""
    import functools
    import os
    import signal

    import draftkit.generation.regenerate as library
    from draftkit.commands import main

    calls = []

    def terminate():
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(library, "regenerate", functools.partial(library.regenerate, _after_batch=terminate))
    src, out = _write_source(tmp_path / "src.jsonl"), tmp_path / "o.jsonl"
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING):
        code = main(["generate", "--source", str(src), "--target", str(tiny_target_dir), "--output", str(out),
                     "--dtype", "float32", "--max_new_tokens", "2", "--max_prompt_tokens", "200", "--batch_size", "3",
                     "--shard_size", "3"])
    assert code == 143 and signal.getsignal(signal.SIGTERM) is before
    parts = tmp_path / "o.jsonl.parts"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"generate: stopped (SIGTERM) with 1 of 3 shards written to {parts}; the same command resumes from them"]
    assert list(json.loads((parts / "index.json").read_text())["shards"]) == ["0"] and not out.exists()
    from draftkit.generation.output_file import Parts

    Parts(out).release()  # the claim was released: a held flock would refuse this one (FileExistsError)


def test_a_run_that_answers_no_conversation_writes_nothing_and_says_why(tmp_path, tiny_target_dir):
    """Every prompt over --max_prompt_tokens (or the context less --max_new_tokens): the run wrote a file of 0
    records and exited 0; the next fit on it failed far from the cause. Now nothing is written, the parts are
    removed (a rerun with other settings starts clean) and the error names the reasons and the options."""
    src = _write_source(tmp_path / "src.jsonl", n_good=3)
    out = tmp_path / "none.jsonl"
    with pytest.raises(ValueError) as err:
        regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=3, max_prompt_tokens=1),
                   dtype="float32", shard_size=2)
    assert str(err.value) == (
        f"generate: no conversation was answered (4 prompt too long), so nothing was written to {out}: the prompts "
        "are longer than --max_prompt_tokens, or than the target's context window less --max_new_tokens; raise "
        "--max_prompt_tokens or lower --max_new_tokens")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.jsonl"]
    regenerate(str(src), str(out), str(tiny_target_dir), RegenerateConfig(max_new_tokens=3, max_prompt_tokens=200),
               dtype="float32", shard_size=2)
    assert read_output(out)[0]["counts"]["records"] == 3  # the 300-character record is over 200 tokens


@pytest.mark.parametrize("kw,message", [
    (dict(max_records=0), "--max_records must be >= 1 (or left out: every usable conversation), got 0"),
    (dict(cfg=RegenerateConfig(max_new_tokens=512)),
     "--max_new_tokens 512 leaves no room for a prompt in the context window of {target} (512 tokens; a prompt gets "
     "the rest): lower --max_new_tokens"),
])
def test_settings_that_can_answer_nothing_are_refused_before_decoding(tmp_path, tiny_target_dir, kw, message):
    """--max_records 0 said "no usable conversation in SRC" of a source with 7; --max_new_tokens at the context
    window failed every record as "prompt too long"."""
    src = _write_source(tmp_path / "src.jsonl", n_good=3)
    with pytest.raises(ValueError) as err:
        regenerate(str(src), str(tmp_path / "o.jsonl"), str(tiny_target_dir), dtype="float32", **kw)
    assert str(err.value) == message.format(target=tiny_target_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.jsonl"]


def test_the_source_is_never_the_output(tmp_path, tiny_target_dir):
    """--output equal to --source with --overwrite replaced a 9-record source by the regenerated first 2."""
    src = _write_source(tmp_path / "src.jsonl", n_good=3)
    before = src.read_bytes()
    with pytest.raises(ValueError, match=r"^--output .*src\.jsonl is the --source file: write the regenerated records "
                                         r"to another file \(--overwrite would replace the source with them\)$"):
        regenerate(str(src), str(tmp_path / "." / "src.jsonl"), str(tiny_target_dir), overwrite=True, max_records=2)
    assert src.read_bytes() == before


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_an_answer_cut_inside_a_character_ends_at_the_last_whole_one(tiny_tokenizer, kept):
    """The length limit cutting a 4-byte character after 1-3 of its byte tokens: the record keeps the text before
    it, whose re-encoding is exactly the target's kept tokens (not U+FFFD's three other bytes); an answer ending on
    a whole character, or stopped by its stop id, keeps every token."""
    from draftkit.generation.regenerate import _take_answer, _Work, whole_characters

    head = tiny_tokenizer.encode("ok é", add_special_tokens=False)
    emoji = tiny_tokenizer.encode("\U0001F600", add_special_tokens=False)
    assert len(emoji) == 4  # byte-level: one token per UTF-8 byte
    cut = head + emoji[:kept]
    assert tiny_tokenizer.decode(cut).endswith("\ufffd")
    assert whole_characters(tiny_tokenizer, cut) == head
    assert whole_characters(tiny_tokenizer, head + emoji) == head + emoji
    source = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    w = _Work(position=0, source_id="r0", source=source, done=source[:1], next_turn=1, stop=[])
    _take_answer(w, cut, "length", tiny_tokenizer, RegenerateConfig(max_new_tokens=len(cut)))
    assert w.done[-1] == {"role": "assistant", "content": "ok é"} and w.new_tokens == len(cut)
    assert tiny_tokenizer.encode(w.done[-1]["content"], add_special_tokens=False) == head
    w2 = _Work(position=1, source_id="r1", source=source, done=source[:1], next_turn=1, stop=[])
    _take_answer(w2, cut + [EOS], "eos", tiny_tokenizer, RegenerateConfig(max_new_tokens=64))
    assert w2.done[-1]["content"].endswith("\ufffd")  # the target's own stop: its text is kept as it wrote it
