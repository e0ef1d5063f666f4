"""EAGLE-3.1 heads (issue 34 item 1) round-trip through every exporter, and each engine's config reader (ported
as expectations from vLLM 0.33 / SGLang 0.5.23 ``llama_eagle3.py``, speculators 0.9.0 ``models/eagle3/config.py``
via vLLM's ``speculators/algos.py``, TensorRT-LLM ``modeling_speculative.py``) finds each flag where it looks."""

from __future__ import annotations

import json

import pytest
import torch
from export_helpers import make_flagged_head, write_checkpoint
from safetensors.torch import load_file

from draftkit.export import export_checkpoint, load_exported_head

ENGINES = ["vllm", "speculators", "sglang", "trtllm"]
FLAGS = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
         {"norm_before_fc": True, "norm_output": True}]


def _reader(engine, config):
    """Where each engine reads each flag (its own lookup rule, as expectations)."""
    nested = config.get("eagle_config") or {}
    if engine == "trtllm":  # Eagle3DraftModel: norm_before_fc only nested; fc_norm, norm_output top level
        return {"norm_before_fc": bool(nested.get("norm_before_fc", False)),
                "fc_norm": bool(config.get("fc_norm", False)), "norm_output": bool(config.get("norm_output", False))}
    # vLLM and SGLang: eagle_config.get("norm_before_fc", top level); speculators/algos.py: top level
    return {"norm_before_fc": bool(nested.get("norm_before_fc", config.get("norm_before_fc", False))),
            "fc_norm": bool(config.get("fc_norm", False)), "norm_output": bool(config.get("norm_output", False))}


def _serve(head, aux, ids):
    from draftkit.heads.eagle3_llama import KVCache

    cache, out, feat = KVCache(), [], head.project(aux)
    for step in range(4):
        lo, hi = (0, 5) if step == 0 else (4 + step, 5 + step)
        logits, h = head(ids[:, lo + 1:hi + 1], feat, torch.arange(lo, hi)[None], cache=cache)
        out.append(logits)
        feat = h[:, -1:]
    return torch.cat(out, 1)


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f))
@pytest.mark.parametrize("engine", ENGINES)
def test_flagged_head_round_trips_and_the_engine_reads_its_flags(engine, flags, tiny_target_dir, tmp_path):
    head, ids = make_flagged_head(tiny_target_dir, flags)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    out = export_checkpoint(ckpt, engine, tmp_path / engine, dtype="float32")  # self-check incl. reference forward
    config = json.loads((out / "config.json").read_text())
    want = {f: bool(flags.get(f, False)) for f in ("norm_before_fc", "fc_norm", "norm_output")}
    assert _reader(engine, config) == want
    tensors = load_file(str(out / "model.safetensors"))
    assert ("input_norm.weight" in tensors) == want["norm_before_fc"]
    assert {k for k in tensors if k.startswith("fc_norm.")} == (
        {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} if want["fc_norm"] else set())
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(320, 64, generator=g)
    aux, tok = torch.randn(1, 5, 192, generator=g), torch.randint(0, 320, (1, 9), generator=g)
    loaded, _ = load_exported_head(out, embedding=emb)
    head.load_embedding(emb)
    with torch.no_grad():
        torch.testing.assert_close(_serve(loaded, aux, tok), _serve(head, aux, tok), atol=1e-5, rtol=0)
    again, _ = load_exported_head(export_checkpoint(out, "vllm", tmp_path / "again", dtype="float32"))
    assert all(getattr(again.config, f) == v for f, v in want.items())


def test_norm_before_residual_is_still_refused_by_sglang_and_trtllm(tiny_target_dir, tmp_path):
    head, ids = make_flagged_head(tiny_target_dir, {"norm_before_residual": True, "fc_norm": True})
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    for engine in ("sglang", "trtllm"):
        with pytest.raises(ValueError, match="norm_before_residual=true"):
            export_checkpoint(ckpt, engine, tmp_path / engine)
    assert json.loads((export_checkpoint(ckpt, "vllm", tmp_path / "v") / "config.json").read_text())["fc_norm"]
