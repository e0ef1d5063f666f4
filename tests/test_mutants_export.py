"""The speculators exporter (``draftkit.export.speculators.build_files``) names the verifier's own architecture
(issue 36: a surviving mutant)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftkit.export import speculators
from draftkit.heads.eagle3_llama import Eagle3Config


def _source(architectures):
    cfg = Eagle3Config(hidden_size=64, target_hidden_size=64, num_aux_layers=3, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                       draft_vocab_size=96, rms_norm_eps=1e-05, max_position_embeddings=512,
                       rope={"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}})
    target_config = SimpleNamespace() if architectures is None else SimpleNamespace(architectures=architectures)
    return SimpleNamespace(config=cfg, aux_layer_ids=[1, 3, 6], num_layers=8, target_config=target_config,
                           serving_name="/models/tiny")


@pytest.mark.parametrize(("architectures", "expected"), [
    (["Qwen2ForCausalLM"], ["Qwen2ForCausalLM"]),  # the target's own, not the Llama fallback
    (None, ["LlamaForCausalLM"]),  # a config without the field
    ([], ["LlamaForCausalLM"]),
])
def test_verifier_architectures_are_the_targets(architectures, expected):
    files = speculators.build_files(_source(architectures), "/out", "float32", 3, {})
    verifier = files["config"]["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "/models/tiny", "architectures": expected}
    assert files["speculation"] == {"speculative_tokens": 3}


def test_one_draft_token_is_a_valid_k():
    """``draftkit.export.exporter``: k = 1 is the smallest k (the boundary of ``k < 1``), 0 is refused."""
    from draftkit.export.exporter import _draft_tokens

    assert (_draft_tokens(1, None), _draft_tokens(None, None)) == (1, 3)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        _draft_tokens(0, None)


def test_verify_export_returns_the_largest_logit_difference(tmp_path):
    """The self-check of a float32 export reports its largest difference: above 0 (the reference forward's
    rounding), below the 1e-4 tolerance (not a start value)."""
    from draftkit.export.exporter import export_checkpoint, verify_export
    from draftkit.heads.checkpoint import read_checkpoint
    from tests.export.export_helpers import make_head, save_tiny_target, write_checkpoint

    target = save_tiny_target(tmp_path / "tiny")
    head, ids = make_head(target)
    ckpt = write_checkpoint(tmp_path / "head.ckpt", head, target, ids)
    out = export_checkpoint(ckpt, "vllm", tmp_path / "out", dtype="float32", num_speculative_tokens=1)
    worst = verify_export(out, read_checkpoint(ckpt))
    assert 0.0 < worst < 1e-4  # the reference forward differs from the head by rounding, not by 0 exactly


def test_chain_only_engine_warns_that_it_serves_the_trees_depth(tmp_path, caplog):
    """``draftkit.export.exporter``: vLLM given a tree logs the engine's note (it drafts a chain of the depth)."""
    import logging

    from draftkit.export import Speculation
    from draftkit.export.exporter import export_checkpoint
    from draftkit.export.speculation import chain_only_note
    from tests.export.export_helpers import make_head, save_tiny_target, write_checkpoint

    target = save_tiny_target(tmp_path / "tiny")
    head, ids = make_head(target)
    ckpt = write_checkpoint(tmp_path / "head.ckpt", head, target, ids)
    speculation = Speculation.parse("3,2,6")
    with caplog.at_level(logging.WARNING, logger="draftkit.export.exporter"):
        export_checkpoint(ckpt, "vllm", tmp_path / "out", dtype="float32", speculation=speculation)
    note = chain_only_note(speculation.tree)
    assert note and [r.getMessage() for r in caplog.records if r.name == "draftkit.export.exporter"
                     and r.levelno == logging.WARNING] == [f"vllm: {note}"]
