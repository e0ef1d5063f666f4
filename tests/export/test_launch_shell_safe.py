"""Every engine's printed and stored launch command is shell-safe (issue 55): an export directory or target name
with a space or a quote splits back into the same arguments."""

from __future__ import annotations

import json
import shlex

import pytest

from draftkit.commands import main


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "speculators"])
def test_launch_command_survives_a_shell(tiny_checkpoint, tmp_path, engine, capsys):
    path, _ = tiny_checkpoint
    out = tmp_path / "it's my export"
    assert main(["export", str(path), str(out), "--to", engine, "--dtype", "float32",
                 "--target_name", "org/tiny llama"]) == 0
    launch = json.loads((out / "draftkit_export.json").read_text())["launch"]
    assert f"launch: {launch}" in capsys.readouterr().out
    args = shlex.split(launch)
    if engine == "vllm":
        assert args[:3] == ["vllm", "serve", "org/tiny llama"] and args[3] == "--speculative-config"
        assert json.loads(args[4])["model"] == str(out) and len(args) == 5
    elif engine == "sglang":
        assert args[args.index("--model-path") + 1] == "org/tiny llama"
        assert args[args.index("--speculative-draft-model-path") + 1] == str(out)
    elif engine == "trtllm":
        assert args == ["trtllm-serve", "org/tiny llama", "--extra_llm_api_options", f"{out}/trtllm_spec.yaml"]
    else:  # speculators names the target inside the directory
        assert args == ["vllm", "serve", str(out)]
