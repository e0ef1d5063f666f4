"""User errors print one line and exit 2 for every verb, fit/validate included; DRAFTKIT_DEBUG=1 re-raises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import draftkit.cli
from draftkit.artifacts import looks_like_path, resolve_artifact
from draftkit.commands import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ref, local", [
    ("scratch/targets/does-not-exist", True), ("./m", True), ("../m", True), ("/abs/m", True), ("~/m", True),
    ("a\\b", True), ("data/x.jsonl", True), ("org/name", False), ("gpt2", False),
    ("Qwen/Qwen2.5-0.5B-Instruct", False), ("meta-llama/Llama-3.1-8B", False), ("hf://datasets/a/b/c", False),
])
def test_which_references_are_paths(ref, local):
    assert looks_like_path(ref) is local


def test_a_missing_target_directory_is_named_as_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^model.target: directory scratch/targets/does-not-exist does "
                                                r"not exist \(a relative path is read from the current directory, "):
        resolve_artifact("scratch/targets/does-not-exist", "model.target")
    assert resolve_artifact("org/name", "model.target") == "org/name"


class _Raises:
    def __init__(self, exc):
        self.exc = exc

    def __call__(self, *args, **kwargs):
        raise self.exc


@pytest.mark.parametrize("verb", ["fit", "validate"])
def test_a_value_error_in_lightning_set_up_is_one_line_and_exit_2(verb, monkeypatch, capsys):
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    monkeypatch.setattr(draftkit.cli, "DraftkitCLI", _Raises(ValueError("data.val_size: 0 records left to train")))
    assert main([verb, "--trainer.max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == f"draftkit {verb}: error: data.val_size: 0 records left to train\n"


def test_debug_env_re_raises_and_bugs_keep_their_traceback(monkeypatch):
    monkeypatch.setattr(draftkit.cli, "DraftkitCLI", _Raises(ValueError("bad option")))
    monkeypatch.setenv("DRAFTKIT_DEBUG", "1")
    with pytest.raises(ValueError, match="bad option"):
        main(["fit"])
    monkeypatch.setenv("DRAFTKIT_DEBUG", "0")
    assert main(["fit"]) == 2
    monkeypatch.setattr(draftkit.cli, "DraftkitCLI", _Raises(RuntimeError("a real bug")))
    with pytest.raises(RuntimeError, match="a real bug"):
        main(["fit"])


def test_fit_with_a_missing_target_path_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DRAFTKIT_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "draftkit", "fit", "--recipe", str(ROOT / "recipes" / "tiny-debug.yaml"),
         "--model.target", "scratch/targets/does-not-exist", "--trainer.max_steps", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"draftkit fit: error: model.target: directory scratch/targets/does-not-exist does not exist (a relative "
        f"path is read from the current directory, {tmp_path}); fix the path in the recipe or on the command line "
        "(a hub id is org/name, with one '/')"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_recipe_that_is_not_yaml_names_the_file_and_line(tmp_path, monkeypatch, capsys):
    """A tab-indented, unclosed or list-shaped recipe gave jsonargparse's 60-line usage and "found character that
    cannot start any token in "<unicode string>", line 2", naming no file; fit never started."""
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    monkeypatch.setattr(draftkit.cli, "DraftkitCLI", _Raises(AssertionError("the recipe was not checked first")))
    cases = {
        "tab.yaml": ("model:\n\tdraft_vocab_size: 64\n",
                     "not valid YAML at line 2, column 1 (found character '\\t' that cannot start any token)"),
        "open.yaml": ("model: [1, 2\n", "not valid YAML at line 2, column 1 (expected ',' or ']', but got "),
        "list.yaml": ("- model\n- data\n", "its top level is a YAML list, not the sections of a recipe"),
        "latin1.yaml": (b"model: {target: caf\xe9}\n", "not valid YAML ('utf-8' codec can't decode byte 0xe9"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        assert main(["fit", "--recipe", str(ROOT / "recipes" / "tiny-debug.yaml"), "-r", str(path)]) == 2
        assert capsys.readouterr().err.startswith(f"draftkit fit: error: -r {path}: {message}"), name
    assert main(["generate", f"--recipe={tmp_path / 'tab.yaml'}", "--output", str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"draftkit generate: error: --recipe {tmp_path / 'tab.yaml'}: not valid")


@pytest.mark.parametrize("argv, option", [
    (["evaluate", "--checkpoint", "absent.ckpt", "--output", "r.json", "--threads", "{n}"], "--threads"),
    (["bench", "decode", "--checkpoint", "absent.ckpt", "--threads", "{n}"], "--threads"),
    (["evaluate-dual-precision", "--prompts", "absent.jsonl", "--threads", "{n}"], "--threads"),
    (["select-layers", "--target", "absent", "--data", "absent.jsonl", "--output", "l.json", "--num_threads", "{n}"],
     "--num_threads"),
])
def test_a_thread_count_below_one_is_one_line_before_anything_loads(argv, option, tmp_path, monkeypatch, capsys):
    """``--threads 0`` (or -2) reached ``torch.set_num_threads``: a RuntimeError traceback ("set_num_threads expects
    a positive integer") after the target had loaded (evaluate), or was taken silently as torch's default (the
    other verbs); the checkpoint, prompt and target paths here do not exist, so a later check would name them."""
    import torch

    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    verb = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]
    for n in ("0", "-2"):
        assert main([a.replace("{n}", n) for a in argv]) == 2
        assert capsys.readouterr().err == (
            f"draftkit {verb}: error: {option} must be a whole number >= 1 (CPU threads; leave it out for torch's "
            f"default, {before} here), got {n}\n")
    assert torch.get_num_threads() == before


def test_set_threads_sets_torch_threads_and_none_keeps_them():
    import torch

    from draftkit.precision import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(None)
        assert torch.get_num_threads() == before
        set_threads(1)
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match=r"^--cpu_threads must be a whole number >= 1 .*got True$"):
            set_threads(True, "--cpu_threads")
    finally:
        torch.set_num_threads(before)


def test_evaluate_checks_max_new_tokens_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """``--max_new_tokens 0`` was refused only after the head and target had loaded and the kernels were probed;
    the checkpoint here does not exist, so a later check would name it instead."""
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["evaluate", "--checkpoint", "absent.ckpt", "--output", "r.json", "--max_new_tokens", "0"]) == 2
    assert capsys.readouterr().err == "draftkit evaluate: error: max_new_tokens must be >= 1, got 0\n"


def test_a_bad_value_in_an_optional_config_option_is_its_own_error(tmp_path, monkeypatch, capsys):
    """``select-layers --analysis.k 0`` printed jsonargparse's Union report: the subtypes, the config's error, "Expected
    a <class 'NoneType'>" and the whole namespace (8 lines) for a one-line mistake."""
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    base = ["select-layers", "--target", "absent", "--data", "absent.jsonl", "--output", "l.json"]
    assert main(base + ["--analysis.k", "0"]) == 2
    assert capsys.readouterr().err == "draftkit select-layers: error: k must be >= 1, got 0\n"
    assert main(base + ["--analysis.min_tokens", "-5"]) == 2
    assert capsys.readouterr().err == (
        "draftkit select-layers: error: skip_first must be >= 0 and min_tokens >= 1\n")


def test_dual_precision_takes_one_method_or_a_comma_list(tmp_path, monkeypatch, capsys):
    """``evaluate-dual-precision --methods verified`` stopped in the parser (a list option: only ``[verified]`` was
    read); one method and a comma-separated list now reach the method check."""
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    for given, unknown in (("bogus", "['bogus']"), ("verified,bogus", "['bogus']"), ("[bogus]", "['bogus']")):
        assert main(["evaluate-dual-precision", "--prompts", "absent.jsonl", "--methods", given]) == 2
        assert capsys.readouterr().err.startswith(f"draftkit evaluate-dual-precision: error: unknown methods {unknown}")


@pytest.mark.parametrize("ref", ["[a.jsonl, b.jsonl]", "a.jsonl,b.jsonl"])
def test_a_list_of_data_files_is_named_as_a_list(ref, tmp_path, monkeypatch):
    """``--data.path '[a.jsonl, b.jsonl]'`` ended in the hub's "Repo id must use alphanumeric chars" error."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        resolve_artifact(ref, "data.path")
    assert str(err.value) == (f"data.path: {ref} is a list; data.path takes one file, directory or hub id; to train "
                              "on several chat files, join them into one (JSON Lines files concatenate: cat a.jsonl "
                              "b.jsonl > both.jsonl)")
    with pytest.raises(ValueError, match=r"^model.target: \[a, b\] is a list; model.target takes one file, directory "
                                         r"or hub id$"):
        resolve_artifact("[a, b]", "model.target")
    (tmp_path / "odd,name.jsonl").write_text("")
    assert resolve_artifact("odd,name.jsonl", "data.path") == "odd,name.jsonl"  # an existing file is never a list


def test_a_data_file_that_generate_is_still_writing_is_named_so(tmp_path, monkeypatch):
    """``data.path regen.jsonl.gz`` while ``draftkit generate`` has only written shards: "does not exist; fix the
    path" sent the user looking for a typo."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "regen.jsonl.gz.parts").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        resolve_artifact("regen.jsonl.gz", "data.path")
    assert str(err.value) == ("data.path: regen.jsonl.gz does not exist yet: regen.jsonl.gz.parts holds the shards of "
                              "an unfinished `draftkit generate` run; rerun that generate command to finish and join "
                              "them")


@pytest.mark.parametrize("steps, message", [
    ("0", "trainer.max_steps 0 trains no step: give the optimizer steps to train (>= 1), or -1"),
    ("-5", "max_steps"),  # Lightning's own refusal (a MisconfigurationException), as one line
])
def test_a_max_steps_that_trains_nothing_is_one_line_and_writes_nothing(steps, message, tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--recipe", str(ROOT / "recipes" / "tiny-debug.yaml"), "--trainer.max_steps", steps]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftkit fit: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()


def test_a_resume_whose_max_steps_ends_at_the_checkpoint_is_refused(tmp_path):
    import torch

    from draftkit.fit_run import check_max_steps

    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 12}, ckpt)
    for steps in (4, 12):
        with pytest.raises(ValueError, match=rf"--ckpt_path {ckpt} is at step 12 and trainer.max_steps {steps} ends "
                           r"there: nothing would train; give trainer.max_steps above 12 to train on"):
            check_max_steps(steps, str(ckpt))
    for steps in (13, -1, None):
        check_max_steps(steps, str(ckpt))
    check_max_steps(4, None)


def test_select_layers_reads_the_recipe_spelling_of_its_options_and_other_verbs_name_an_override(capsys,
                                                                                                   monkeypatch):
    """``select-layers --data.path F`` (fit's spelling) failed with jsonargparse's Union error; it is ``--data F``.
    A recipe override a verb does not take is one line naming it."""
    from draftkit.commands import _normalize

    assert _normalize(["select-layers", "--recipe", "r.yaml", "--data.path", "x.jsonl", "--model.target=t",
                       "--data.max_length", "64", "--output", "o.json"]) == [
        "select-layers", "--recipe+", "r.yaml", "--data", "x.jsonl", "--target=t", "--max_length", "64",
        "--output", "o.json"]
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    assert main(["evaluate", "--checkpoint", "c", "--model.target", "t"]) == 2
    assert capsys.readouterr().err == ("draftkit evaluate: error: evaluate takes no recipe override --model.target: "
                                       "see `python -m draftkit evaluate --help` for its options\n")


def test_select_layers_on_data_cut_before_every_answer_names_the_max_length(tiny_target_dir, tmp_path, monkeypatch,
                                                                              capsys):
    import json

    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "a long question " * 40},
                                                     {"role": "assistant", "content": "short answer"}]}) + "\n"
                            for _ in range(4)))
    assert main(["select-layers", "--target", str(tiny_target_dir), "--data", str(data), "--max_length", "32",
                 "--output", str(tmp_path / "layers.json")]) == 2
    err = capsys.readouterr().err
    assert "no row to analyse" in err and "raise --max_length (data.max_length)" in err
    assert not (tmp_path / "layers.json").exists()
