"""A head evaluated or exported against a target of another architecture is refused naming both (issue 55): the
check used to compare only vocab size, hidden size, aux width and tokenizer, which a tiny Llama and a tiny
Qwen3-MoE share; the export's sidecar then named the other family as the head's target."""

from __future__ import annotations

import json

import torch

from draftkit.commands import main
from draftkit.testing import build_tiny_target


def test_another_architecture_is_refused_and_the_sidecar_keeps_the_training_target(tiny_checkpoint, tmp_path, capsys):
    path, _ = tiny_checkpoint
    other = build_tiny_target(tmp_path / "tiny-qwen3-moe", family="qwen3_moe")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    trained = torch.load(path, weights_only=False)["draftkit"]["target"]
    expected = (f"{path} was trained on target {trained!r}, but --target {str(other)!r} has another architecture "
                "(model_type 'llama' vs 'qwen3_moe', training target vs --target)")
    for stored in (False, True):  # read from the training target's config; then as a new checkpoint stores it
        if stored:
            c = torch.load(path, weights_only=False)
            c["draftkit"]["target_architecture"] = {"model_type": "llama", "num_hidden_layers": 8}
            torch.save(c, path)
        assert main(["evaluate", "--checkpoint", str(path), "--target", str(other), "--prompts", str(prompts),
                     "--output", str(tmp_path / "r.json"), "--k", "2", "--max_new_tokens", "4"]) == 2
        assert expected in capsys.readouterr().err
        assert main(["export", str(path), str(tmp_path / "x"), "--to", "vllm", "--target", str(other)]) == 2
        assert expected in capsys.readouterr().err
        assert not (tmp_path / "r.json").exists() and not (tmp_path / "x").exists()
    # the same architecture (the training target itself named again) exports, and the sidecar keeps it
    assert main(["export", str(path), str(tmp_path / "x"), "--to", "vllm", "--target", trained]) == 0
    sidecar = json.loads((tmp_path / "x" / "draftkit_export.json").read_text())
    assert sidecar["trained_target"] == trained
    assert sidecar["target_architecture"]["model_type"] == "llama"
    # an export is checked the same way when re-read against another target
    assert main(["export", str(tmp_path / "x"), str(tmp_path / "y"), "--to", "sglang", "--target", str(other)]) == 2
    assert "has another architecture (model_type 'llama' vs 'qwen3_moe'" in capsys.readouterr().err
    # evaluating an export against it is refused the same way (it ran, writing a report), and nothing is written
    assert main(["evaluate", "--checkpoint", str(tmp_path / "x"), "--target", str(other), "--prompts", str(prompts),
                 "--output", str(tmp_path / "r.json"), "--k", "2", "--max_new_tokens", "4"]) == 2
    assert (f"{tmp_path / 'x'} was trained on target {trained!r}, but --target {str(other)!r} has another "
            "architecture (model_type 'llama' vs 'qwen3_moe'") in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_run_started_from_an_export_for_another_architecture_is_refused_naming_it(tiny_checkpoint, tmp_path):
    """``model.init_head`` of an export with a target of another family: the architecture refusal (it was a
    head-shape refusal naming rms_norm_eps and a model option that does not exist)."""
    import pytest

    from draftkit.models.init_head import read_init_head

    path, _ = tiny_checkpoint
    other = build_tiny_target(tmp_path / "tiny-qwen3-moe", family="qwen3_moe")
    assert main(["export", str(path), str(tmp_path / "x"), "--to", "vllm"]) == 0
    with pytest.raises(ValueError, match=r"^model.init_head: .* has another architecture \(model_type 'llama' vs "
                       r"'qwen3_moe'"):
        read_init_head(str(tmp_path / "x"), str(other), [2, 4, 5], 64)
