"""V_d == V exports carry no d2t/t2d (issue 34 M1): vLLM 0.33 ``llama_eagle3.py`` creates no
``draft_id_to_target_id`` then and refuses a file with ``d2t``; TensorRT-LLM creates ``d2t`` only when V_d != V."""

from __future__ import annotations

import json

import pytest
import torch
from export_helpers import make_head, write_checkpoint
from safetensors.torch import load_file

from draftkit.export import export_checkpoint, load_exported_head

ENGINES = ["vllm", "speculators", "sglang", "trtllm"]


@pytest.mark.parametrize("engine", ENGINES)
def test_full_vocab_export_has_no_map_and_round_trips(engine, tiny_target_dir, tmp_path):
    head, ids = make_head(tiny_target_dir, draft_vocab_size=320)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)  # carries the identity d2t/t2d
    out = export_checkpoint(ckpt, engine, tmp_path / engine, dtype="float32")
    tensors = load_file(str(out / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors and "lm_head.weight" in tensors
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 320
    loaded, _ = load_exported_head(out)
    assert loaded.d2t.tolist() == [0] * 320 and bool(loaded.t2d.all())
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(320, 64, generator=g)
    head.load_embedding(emb)
    loaded.load_embedding(emb)
    aux, tok = torch.randn(1, 4, 192, generator=g), torch.randint(0, 320, (1, 4), generator=g)
    with torch.no_grad():
        want, _ = head(tok, head.project(aux), torch.arange(4)[None])
        got, _ = loaded(tok, loaded.project(aux), torch.arange(4)[None])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    again = load_file(str(export_checkpoint(out, "vllm", tmp_path / "again") / "model.safetensors"))
    assert {k.replace("layers.0.", "midlayer.") for k in tensors} == set(again)  # a re-export keeps the map out


def test_full_vocab_checkpoint_with_arange_d2t_is_refused(tiny_target_dir, tmp_path):
    """The identity is d2t = zeros; an ``arange`` d2t (draft id i -> target 2i) is refused, nothing written."""
    head, ids = make_head(tiny_target_dir, draft_vocab_size=320)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids, drop=("d2t",),
                            state_extra={"head.d2t": torch.arange(320)})
    with pytest.raises(ValueError, match="V_d == V but head.d2t is not all zeros"):
        export_checkpoint(ckpt, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()
