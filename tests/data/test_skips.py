"""Records the chat template rejects are skipped and named; a source that loses too many records stops set-up.

The ``case_*`` tests are the failing inputs of issue 30, kept verbatim in ``tests/data/cases/``; the others are
more inputs of the same kind.
"""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from draftkit.data.chat import TemplateError, tokenize_conversation
from draftkit.data.datamodule import ChatDataModule

REPO = Path(__file__).resolve().parents[2]
CASES = REPO / "tests" / "data" / "cases"
# the assistant span this reasoning template renders for the last turn differs from the one for earlier turns
QWEN3_TEMPLATE = yaml.safe_load((CASES / "x04-qwen3-recipe.yaml").read_text())["data"]["chat_template"]
ALTERNATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat(i, system=False):
    msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} ok"}]
    return {"id": f"r{i}", "messages": ([{"role": "system", "content": "Be brief."}] if system else []) + msgs}


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _case(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copy(CASES / name, tmp_path / name))


def test_case_x04_multi_turn_record_rejected_by_the_template_is_skipped(tmp_path, tiny_target_dir):
    """x04: one multi-turn record of 11 used to stop the whole set with a TemplateError naming no record; it
    is now skipped by its id and reason and the other 10 train (8 train + 2 val)."""
    path = _case(tmp_path, "x04-qwen3-mixed.jsonl")
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), chat_template=QWEN3_TEMPLATE, max_length=128,
                        val_size=2, batch_size=2)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (8, 2)
    assert dm.stats["template_error"] == 1 and dm.stats["records"] == 11
    assert dm.stats["skips"] == [{
        "record": "multi-turn-7", "reason": "chat template error",
        "detail": "no assistant span found for assistant turn 1: the chat template does not render conversations "
                  "prefix-stably (render(messages[:i], add_generation_prompt=True) must be a prefix of "
                  "render(messages[:i+1])); give data.chat_template a template that does",
    }]


def test_template_raise_exception_skips_that_record_only(tmp_path, tiny_target_dir, tiny_tokenizer):
    """A template that raises for some records (``raise_exception``, as many hub templates do for a system turn)
    skips those records with jinja's message; the rest train."""
    path = _write_jsonl(tmp_path / "sys.jsonl", [_chat(i, system=i == 3) for i in range(6)])
    with pytest.raises(TemplateError, match="the chat template raised TemplateError: System role not supported"):
        tokenize_conversation(tiny_tokenizer, _chat(3, system=True)["messages"], ALTERNATE)
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), chat_template=ALTERNATE, val_size=1)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 5
    assert dm.stats["skips"] == [{"record": "r3", "reason": "chat template error",
                                  "detail": "the chat template raised TemplateError: System role not supported"}]


def test_every_record_rejected_by_the_template_names_the_template(tmp_path, tiny_target_dir):
    path = _write_jsonl(tmp_path / "allsys.jsonl", [_chat(i, system=True) for i in range(4)])
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), chat_template=ALTERNATE, val_size=0)
    with pytest.raises(ValueError) as err:
        dm.prepare_data()
    assert str(err.value) == (
        f"no trainable tokens in {path}: every one of the 4 conversations read, 4 were rejected by the chat "
        "template (first, r0: the chat template raised TemplateError: System role not supported); check "
        "data.chat_template"
    )


def test_case_b16_preformatted_text_stops_at_set_up_naming_the_reason(tmp_path, tiny_target_dir):
    """b16: 18 of 20 records have only a ``text`` key; the run used to warn and train on 2. Now set-up stops
    naming the file, the fraction, the main reason and the option."""
    path = _case(tmp_path, "b16-preformatted.jsonl")
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), val_size=1)
    with pytest.raises(ValueError) as err:
        dm.prepare_data()
    assert str(err.value) == (
        f"{path}: 18 of 20 records skipped (90%), more than data.max_skip_fraction=0.2; main reason: no "
        "conversation key (18 records; line 1: no conversations/messages key (keys: text)); convert the data to "
        "chat (messages) or ShareGPT (conversations) records, fix data.chat_template, or raise "
        "data.max_skip_fraction to train on the rest"
    )
    ok = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), val_size=1, max_skip_fraction=1.0)
    ok.setup("fit")  # the user's explicit choice: train on what is left
    assert (len(ok.train_set), len(ok.val_set)) == (1, 1)


def test_skip_fraction_boundary_and_tokenization_skips_count(tmp_path, tiny_target_dir):
    """1 of 5 records skipped (20%) is allowed at the default 0.2; 2 of 8 (25%) is not, and records the template
    rejects count as skipped like unreadable ones."""
    five = _write_jsonl(tmp_path / "five.jsonl", [_chat(i) for i in range(4)] + ["{not json"])
    dm = ChatDataModule(str(five), tokenizer=str(tiny_target_dir), val_size=1)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 4
    eight = _write_jsonl(tmp_path / "eight.jsonl", [_chat(i, system=i in (2, 5)) for i in range(8)])
    dm = ChatDataModule(str(eight), tokenizer=str(tiny_target_dir), chat_template=ALTERNATE, val_size=1)
    with pytest.raises(ValueError, match=r"eight.jsonl: 2 of 8 records skipped \(25%\), more than "
                                         r"data.max_skip_fraction=0.2; main reason: chat template error \(2 records; "
                                         r"r2: the chat template raised TemplateError: System role not supported\)"):
        dm.prepare_data()


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_max_skip_fraction_out_of_range(bad):
    with pytest.raises(ValueError, match=rf"data.max_skip_fraction must be within 0..1, got {bad}"):
        ChatDataModule("x.jsonl", max_skip_fraction=bad)


def test_case_b16_fit_stops_before_the_run_writes_anything(tmp_path, monkeypatch):
    """Through ``fit``: the threshold stops the run in prepare_data, before a run directory exists."""
    from draftkit.cli import DraftkitCLI

    path = _case(tmp_path, "b16-preformatted.jsonl")
    monkeypatch.chdir(REPO)
    root = tmp_path / "run"
    with pytest.raises(ValueError, match=r"18 of 20 records skipped \(90%\)"):
        DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--data.path", str(path),
                          "--trainer.default_root_dir", str(root)])
    assert not (root / "lightning_logs").exists()


def test_records_lost_to_truncation_name_data_max_length_with_the_lengths_they_need(tmp_path, tiny_target_dir,
                                                                                    tiny_tokenizer):
    """When most records lose every assistant token to truncation, the stop names data.max_length and the lengths
    that keep them (it used to say "convert the data to chat or ShareGPT records, fix data.chat_template")."""
    rows = [_chat(i) for i in range(2)] + [
        {"id": f"long{i}", "messages": [{"role": "user", "content": "why " * (20 + 5 * i)},
                                        {"role": "assistant", "content": "because"}]} for i in range(3)]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    needs = [next(t + 1 for t, m in enumerate(tokenize_conversation(tiny_tokenizer, r["messages"])["loss_mask"])
                  if m and t >= 1) for r in rows[2:]]
    assert 64 < needs[0] < needs[1] < needs[2]
    dm = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=64, val_size=1)
    with pytest.raises(ValueError) as err:
        dm.prepare_data()
    assert str(err.value) == (
        f"{path}: 3 of 5 records skipped (60%), more than data.max_skip_fraction=0.2; main reason: assistant tokens "
        f"lost to truncation (3 records; long0: no assistant token within data.max_length=64 (needs {needs[0]})); "
        f"raise data.max_length (now 64; these records keep an assistant token from {needs[0]} tokens, all of them "
        f"from {needs[2]}), or raise data.max_skip_fraction to train on the rest"
    )
    ok = ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=needs[2], val_size=1)
    ok.setup("fit")
    assert len(ok.train_set) + len(ok.val_set) == 5


def test_tool_call_data_is_told_to_drop_the_tool_turns(tmp_path, tiny_target_dir, monkeypatch):
    """OpenAI tool-calling records (a ``tool`` turn; an assistant turn with ``content: null`` and ``tool_calls``)
    stop set-up with what to do about them, not the advice to convert data that already is chat records."""
    import json

    from draftkit.data.datamodule import ChatDataModule

    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]}
    shapes = {"tool": [{"role": "user", "content": "weather in Paris today?"}, {**call, "content": "Checking."},
                       {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}],
              "null": [{"role": "user", "content": "weather in Paris today?"}, call]}
    for name, expected in (("tool", r"skipped 12 unknown role \(r0: turn 2 role 'tool', .*\); give every turn the "
                            r"role user, assistant or system \(tool and function-call turns are not trained: drop"),
                           ("null", r"skipped 12 non-string content \(r0: turn 1 content is null, .*\); give every "
                            r"turn its text \(an assistant turn that only calls a tool has none: drop those turns")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": f"r{i}", "messages": shapes[name]}) + "\n" for i in range(12)))
        with pytest.raises(ValueError, match=expected):
            ChatDataModule(str(path), tokenizer=str(tiny_target_dir), max_length=128, val_size=2).setup()
