"""The one checkpoint reader: what evaluate and export both accept or refuse; aux ids stored once, never guessed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))

from export_helpers import make_head, save_tiny_target, write_checkpoint  # noqa: E402

from draftkit.export.load import load_head  # noqa: E402
from draftkit.export import export_checkpoint  # noqa: E402
from draftkit.heads.checkpoint import (  # noqa: E402
    check_resumed_aux_ids, checkpoint_metadata, checkpoint_tensors, head_from_checkpoint, read_checkpoint,
    read_training_state,
)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


def _rewrite_meta(path, edit):
    ckpt = torch.load(path, weights_only=False)
    edit(ckpt["draftkit"])
    torch.save(ckpt, path)


def test_head_from_checkpoint_equals_the_saved_head(target_dir, tmp_path):
    head, ids = make_head(target_dir, aux_layer_ids=[1, 3, 6])
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, target_dir, ids)
    loaded, meta = head_from_checkpoint(ckpt)
    assert meta["aux_layer_ids"] == [1, 3, 6] == loaded.config.aux_layer_ids
    assert meta["target"] == str(target_dir)
    saved = {k: v for k, v in head.state_dict().items() if not k.startswith(("embed_tokens.", "rotary_emb."))}
    got = loaded.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    assert read_checkpoint(ckpt).aux_layer_ids == [1, 3, 6]


def test_checkpoint_without_aux_ids_is_refused_by_evaluate_and_export(target_dir, tmp_path):
    head, ids = make_head(target_dir, aux_layer_ids=[1, 3, 6])
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, target_dir, ids)
    _rewrite_meta(ckpt, lambda m: m["head_config"].update(aux_layer_ids=[]))
    with pytest.raises(ValueError, match=r"records no aux layer ids.*cannot be guessed"):
        export_checkpoint(ckpt, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="records no aux layer ids"):
        load_head(ckpt)


def test_older_checkpoint_with_ids_beside_head_config_still_reads(target_dir, tmp_path):
    head, ids = make_head(target_dir, aux_layer_ids=[1, 3, 6])
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, target_dir, ids)

    def legacy(meta):
        meta["aux_layer_ids"] = meta["head_config"].pop("aux_layer_ids")

    _rewrite_meta(ckpt, legacy)
    assert read_checkpoint(ckpt).aux_layer_ids == [1, 3, 6]
    assert load_head(ckpt)[1]["aux_layer_ids"] == [1, 3, 6]


def test_evaluate_refuses_what_export_refuses(target_dir, tmp_path):
    head, ids = make_head(target_dir)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, target_dir, ids, drop=("d2t",))
    for read in (lambda: load_head(ckpt), lambda: export_checkpoint(ckpt, "vllm", tmp_path / "out")):
        with pytest.raises(ValueError, match=r"no draft-vocab map \(head.d2t\)"):
            read()
    other = save_tiny_target(tmp_path / "wide", hidden_size=96)
    good = write_checkpoint(tmp_path / "g.ckpt", *make_head(target_dir)[:1], target_dir, ids)
    for read in (lambda: load_head(good, other), lambda: export_checkpoint(good, "vllm", tmp_path / "o", target=other)):
        with pytest.raises(ValueError, match="hidden_size 96"):
            read()


def test_a_full_vocab_head_refuses_any_nonzero_d2t_entry(target_dir, tmp_path):
    """V_d == V: d2t must be all zeros; one nonzero entry among zeros is refused, not only an all-nonzero map
    such as arange (issue 56)."""
    from transformers import AutoConfig

    v = AutoConfig.from_pretrained(target_dir).vocab_size
    head, ids = make_head(target_dir, draft_vocab_size=v)
    assert not head.d2t.any()
    ok = write_checkpoint(tmp_path / "ok.ckpt", head, target_dir, ids)
    assert read_checkpoint(ok).aux_layer_ids == ids
    d2t = torch.zeros(v, dtype=head.d2t.dtype)
    d2t[-1] = -1  # the last draft id maps to target id V - 2: one entry off the identity
    head.d2t.copy_(d2t)
    bad = write_checkpoint(tmp_path / "bad.ckpt", head, target_dir, ids)
    with pytest.raises(ValueError, match="V_d == V but head.d2t is not all zeros"):
        read_checkpoint(bad)


def test_a_d2t_reaching_the_vocab_size_is_refused_and_one_below_is_read(target_dir, tmp_path):
    """A checkpoint without t2d rebuilds it from d2t: the last draft id mapped to V - 1 is read, to V refused
    with the reader's error (not an IndexError; issue 56)."""
    from transformers import AutoConfig

    v = AutoConfig.from_pretrained(target_dir).vocab_size
    head, ids = make_head(target_dir)
    n = head.d2t.numel()
    for last, ok in ((v - 1, True), (v, False)):
        d2t = head.d2t.clone()
        d2t[-1] = last - (n - 1)
        ckpt = write_checkpoint(tmp_path / f"{last}.ckpt", head, target_dir, ids, drop=("t2d",),
                                state_extra={"head.d2t": d2t})
        if ok:
            assert bool(head_from_checkpoint(ckpt)[0].t2d[v - 1])
        else:
            with pytest.raises(ValueError, match=rf"head.d2t maps outside the target vocab \[0, {v}\)"):
                read_checkpoint(ckpt)


@pytest.mark.parametrize("stored", [[1, 3], [1, 2, 3, 6]])
def test_aux_ids_other_than_the_fused_count_are_refused_both_ways(target_dir, tmp_path, stored):
    """fc fuses 3 aux states: 2 stored ids and 4 stored ids are both refused (issue 56)."""
    head, _ = make_head(target_dir, aux_layer_ids=[1, 3, 6])
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, target_dir, stored)
    with pytest.raises(ValueError, match=rf"{len(stored)} aux layer ids .* but fc reads 3 aux states"):
        read_checkpoint(ckpt)


def test_the_metadata_written_is_the_metadata_read_back(target_dir):
    """checkpoint_metadata (what Eagle3Module.on_save_checkpoint stores) and its readers: the training state
    round-trips (lr_anchor a list on disk, a tuple back), an older checkpoint's max_steps stands in for
    planned_total, and a resume on other aux layers is refused."""
    from transformers import AutoConfig

    from draftkit.heads.eagle3_llama import Eagle3Config

    config = AutoConfig.from_pretrained(target_dir)
    head_config = Eagle3Config.from_target_config(config, [2, 4, 5], 64)
    training = {"tokens_trained": 1234, "trained_length": 0, "lr_horizon": 90, "lr_anchor": (10, 40, 0.25),
                "planned_total": 100}
    meta = checkpoint_metadata(head_config, "tiny", config, "float32", None, "fp", {"steps": 3, "decay": 0.8}, training)
    assert meta["head_config"]["aux_layer_ids"] == [2, 4, 5] and meta["head_config"]["draft_vocab_size"] == 64
    assert (meta["target"], meta["target_dtype"], meta["tokenizer_fingerprint"]) == ("tiny", "float32", "fp")
    assert meta["target_architecture"]["num_hidden_layers"] == config.num_hidden_layers
    assert meta["trained_length"] is None and meta["lr_anchor"] == [10, 40, 0.25]
    assert read_training_state(meta) == training
    older = {k: v for k, v in meta.items() if k not in ("planned_total", "lr_anchor", "tokens_trained")}
    assert read_training_state(older, max_steps=7) == {**training, "tokens_trained": 0, "lr_anchor": None,
                                                       "planned_total": 7}
    assert read_training_state(older, max_steps=-1)["planned_total"] is None
    check_resumed_aux_ids(meta, [2, 4, 5])
    check_resumed_aux_ids({"head_config": {}}, [1, 2, 3])  # none recorded: nothing to compare
    with pytest.raises(ValueError, match=r"checkpoint aux layers \[2, 4, 5\] differ from this run's \[1, 2, 3\]"):
        check_resumed_aux_ids(meta, [1, 2, 3])


def test_checkpoint_tensors_keep_the_head_and_the_metrics_only():
    t = torch.zeros(1)
    state = {"head.fc.weight": t, "head.embed_tokens.weight": t, "head.rotary_emb.inv_freq": t,
             "target.model.layers.0.weight": t, "val_acc.0.mean_value": t, "train_x": t, "kept_fraction.weight": t}
    assert sorted(checkpoint_tensors(state)) == ["head.fc.weight", "kept_fraction.weight", "train_x",
                                                 "val_acc.0.mean_value"]
