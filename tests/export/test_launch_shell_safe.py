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
    assert any(str(out) in a for a in args)
    if engine != "speculators":  # speculators names the target inside the directory
        assert "org/tiny llama" in args
