"""``draftkit export --to llamacpp`` without llama.cpp: the one GGUF holds what llama.cpp b11434 reads (keys, tensor
names, ggml shapes and types, absolute d2t, interleaved-RoPE q/k rows, the target's tokenizer), reads back to the
checkpoint's head, and heads llama.cpp cannot serve are refused with the reason (nothing written)."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from export_helpers import make_flagged_head, make_head, write_checkpoint
from safetensors.torch import load_file

from draftkit.export import export_checkpoint, load_exported_head
from draftkit.export.common import rope_legacy_fields
from draftkit.export.llamacpp import GGUF_FILE, round_weights

T = gguf.GGMLQuantizationType
MATRICES = {"fc.weight": "fc.weight", "blk.0.attn_q.weight": "midlayer.self_attn.q_proj.weight",
            "blk.0.attn_k.weight": "midlayer.self_attn.k_proj.weight",
            "blk.0.attn_v.weight": "midlayer.self_attn.v_proj.weight",
            "blk.0.attn_output.weight": "midlayer.self_attn.o_proj.weight",
            "blk.0.ffn_gate.weight": "midlayer.mlp.gate_proj.weight",
            "blk.0.ffn_up.weight": "midlayer.mlp.up_proj.weight",
            "blk.0.ffn_down.weight": "midlayer.mlp.down_proj.weight", "output.weight": "lm_head.weight"}
NORMS = {"blk.0.attn_norm.weight": "midlayer.input_layernorm.weight",
         "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight",
         "blk.0.ffn_norm.weight": "midlayer.post_attention_layernorm.weight", "output_norm.weight": "norm.weight"}


def _tokenizer_gguf(path, n=320):
    """A tokenizer-only GGUF of n tokens, as a target GGUF carries one."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"tok{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The tiny target's (V = 320) tokenizer GGUF."""
    return _tokenizer_gguf(tmp_path_factory.mktemp("tgt") / "tiny.gguf")


def _read(out):
    reader = gguf.GGUFReader(str(out / GGUF_FILE))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def _export(tmp_path, tiny_target_dir, tiny_gguf, flags=None, dtype="bfloat16", **head_args):
    if flags:
        head, ids = make_flagged_head(tiny_target_dir, flags, **head_args)
    else:
        head, ids = make_head(tiny_target_dir, **head_args)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    out = export_checkpoint(ckpt, "llamacpp", tmp_path / "lc", dtype=dtype, target_gguf=tiny_gguf,
                            num_speculative_tokens=2)
    return head, ids, out


def test_gguf_holds_what_llamacpp_reads(tiny_target_dir, tiny_gguf, tmp_path):
    head, ids, out = _export(tmp_path, tiny_target_dir, tiny_gguf, aux_layer_ids=[1, 3, 6])
    assert sorted(p.name for p in out.iterdir()) == ["draftkit_export.json", GGUF_FILE]
    fields, tensors = _read(out)
    expected_fields = {
        "general.architecture": "eagle3", "eagle3.block_count": 1, "eagle3.embedding_length": 64,
        "eagle3.feed_forward_length": 128, "eagle3.attention.head_count": 4, "eagle3.attention.head_count_kv": 2,
        "eagle3.attention.key_length": 16, "eagle3.attention.value_length": 16, "eagle3.rope.dimension_count": 16,
        "eagle3.rope.freq_base": 50000.0, "eagle3.vocab_size": 320, "eagle3.target_layers": [1, 3, 6],
        "eagle3.target_hidden_size": 64, "eagle3.norm_before_residual": False, "eagle3.norm_before_fc": False,
        "general.file_type": gguf.LlamaFileType.MOSTLY_BF16, "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.bos_token_id": 1, "tokenizer.chat_template": "{{ messages }}",
    }
    assert {k: fields[k] for k in expected_fields} == expected_fields
    assert fields["eagle3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert fields["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(320)]
    assert set(tensors) == {*MATRICES, *NORMS, "d2t"}  # no token_embd (H == H_t), no t2d
    state = head.export_state_dict()
    for name, ours in {**MATRICES, **NORMS}.items():
        assert tuple(tensors[name].shape.tolist()) == tuple(reversed(state[ours].shape)), name  # ggml ne
        assert tensors[name].tensor_type == (T.BF16 if name in MATRICES else T.F32), name
    assert tensors["d2t"].tensor_type == T.I64
    d2t = torch.from_numpy(tensors["d2t"].data.copy())
    assert torch.equal(d2t, state["d2t"] + torch.arange(96))  # absolute target ids
    assert torch.equal(state["t2d"].nonzero().flatten(), d2t)
    # q rows in ggml's interleaved-RoPE order: head 1's row 2i is the checkpoint's row 16 + i, row 2i+1 its 16 + 8 + i
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy()).view(torch.bfloat16).reshape(64, 128)
    ref = state["midlayer.self_attn.q_proj.weight"].to(torch.bfloat16)
    assert torch.equal(q[16 + 2 * 3], ref[16 + 3]) and torch.equal(q[16 + 2 * 3 + 1], ref[16 + 8 + 3])
    sidecar = json.loads((out / "draftkit_export.json").read_text())
    assert sidecar["engine"] == "llamacpp" and sidecar["engine_aux_layer_ids"] == [1, 3, 6]
    assert sidecar["target_gguf"] == tiny_gguf
    assert sidecar["launch"] == (f"llama-server -m {tiny_gguf} -md {out / GGUF_FILE} --spec-type draft-eagle3 "
                                 "--spec-draft-n-max 2")
    back, meta = load_exported_head(out)
    assert meta["aux_layer_ids"] == [1, 3, 6] and meta["dtype"] == "bfloat16"
    for name, value in back.export_state_dict().items():
        want = state[name].to(torch.bfloat16).float() if state[name].is_floating_point() else state[name]
        assert torch.equal(value, want), name
    # the GGUF export re-exports for another engine: the same bf16 tensors as exporting the checkpoint directly
    again = load_file(str(export_checkpoint(out, "vllm", tmp_path / "v") / "model.safetensors"))
    direct = load_file(str(export_checkpoint(tmp_path / "h.ckpt", "vllm", tmp_path / "d") / "model.safetensors"))
    assert again.keys() == direct.keys() and all(torch.equal(again[k], direct[k]) for k in direct)


def test_eagle31_norm_before_fc_and_residual_flags(tiny_target_dir, tiny_gguf, tmp_path):
    head, _, out = _export(tmp_path, tiny_target_dir, tiny_gguf, {"norm_before_fc": True},
                           norm_before_residual=True)
    fields, tensors = _read(out)
    assert fields["eagle3.norm_before_fc"] is True and fields["eagle3.norm_before_residual"] is True
    assert tensors["enc.output_norm.weight"].tensor_type == T.F32
    assert tuple(tensors["enc.output_norm.weight"].shape.tolist()) == (192,)
    back, _ = load_exported_head(out)
    assert back.config.norm_before_fc and back.config.norm_before_residual
    assert torch.equal(back.input_norm.weight, head.input_norm.weight.to(torch.bfloat16).float())


def test_q8_0_matrices_and_self_check(tiny_target_dir, tiny_gguf, tmp_path):
    head, _, out = _export(tmp_path, tiny_target_dir, tiny_gguf, dtype="q8_0")
    fields, tensors = _read(out)
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert {n: tensors[n].tensor_type for n in MATRICES} == dict.fromkeys(MATRICES, T.Q8_0)
    assert {n: tensors[n].tensor_type for n in NORMS} == dict.fromkeys(NORMS, T.F32)
    back, meta = load_exported_head(out)
    assert meta["dtype"] == "float32"  # dequantized
    state = head.export_state_dict()
    rounded = round_weights(state, "q8_0")
    w = state["fc.weight"]
    assert not torch.equal(rounded["fc.weight"], w)  # quantized, yet close: int8 per 32-value block
    assert float((rounded["fc.weight"] - w).abs().max()) <= float(w.abs().max()) / 127
    for name, value in back.export_state_dict().items():
        assert torch.equal(value, rounded[name]), name


LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LLAMA3_SCALING = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}


def test_llama3_rope_is_written_as_rope_freqs(tiny_target_dir, tiny_gguf, tmp_path):
    head, _, out = _export(tmp_path, tiny_target_dir, tiny_gguf, {"rope": {"rope_parameters": LLAMA3}})
    _, tensors = _read(out)
    factors = torch.from_numpy(tensors["rope_freqs.weight"].data.copy())
    assert tensors["rope_freqs.weight"].tensor_type == T.F32 and factors.shape == (8,)
    # d = 16, theta 5e4, 64 original positions: the fastest pair keeps its frequency, the slowest is divided by 8
    assert factors[0] == 1.0 and factors[-1] == pytest.approx(8.0)
    back, _ = load_exported_head(out)
    assert rope_legacy_fields(back.config.rope) == rope_legacy_fields(head.config.rope) == (50000.0, LLAMA3_SCALING)


@pytest.mark.parametrize("flags, lacks", [({"fc_norm": True}, "lacks fc_norm"),
                                          ({"norm_output": True}, "lacks norm_output"),
                                          ({"rope": {"rope_parameters": {**LLAMA3, "rope_type": "yarn"}}},
                                           "lacks scaled RoPE")])
def test_heads_llamacpp_cannot_serve_are_refused(flags, lacks, tiny_target_dir, tiny_gguf, tmp_path):
    with pytest.raises(ValueError, match=f"llama.cpp b11434 cannot serve this head: it {lacks}"):
        _export(tmp_path, tiny_target_dir, tiny_gguf, flags)
    assert not (tmp_path / "lc").exists()


def test_target_without_gguf_is_refused(tiny_target_dir, tmp_path):
    head, ids = make_head(tiny_target_dir)
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, tiny_target_dir, ids)
    with pytest.raises(ValueError, match="pass --target_gguf with the target GGUF"):
        export_checkpoint(ckpt, "llamacpp", tmp_path / "lc")
    other = _tokenizer_gguf(tmp_path / "other.gguf", 100)
    with pytest.raises(ValueError, match="other.gguf has 100 tokens but the head was trained for a target vocabulary "
                                         "of 320"):
        export_checkpoint(ckpt, "llamacpp", tmp_path / "lc", target_gguf=other)
    with pytest.raises(ValueError, match="unknown dtype 'q8_0' for vllm"):
        export_checkpoint(ckpt, "vllm", tmp_path / "v", dtype="q8_0")
    assert not (tmp_path / "lc").exists()


def test_launch_line_chains_ngram_mod_for_a_hybrid_report(tmp_path):
    """A report whose choice was a hybrid with prompt lookup is served by llama.cpp as a chain of spec types (the
    n-gram draft when it has a match); a plain chain stays draft-eagle3 alone; paths are shell-quoted."""
    from types import SimpleNamespace

    from draftkit.export.llamacpp import launch_command

    source = SimpleNamespace()
    out = tmp_path / "my head"
    plain = launch_command(source, str(out), 3, target_gguf="t.gguf")
    hybrid = launch_command(source, str(out), 3, target_gguf="t.gguf", hybrid={"mode": "switch", "lookup_tokens": 8})
    assert plain == f"llama-server -m t.gguf -md '{out / GGUF_FILE}' --spec-type draft-eagle3 --spec-draft-n-max 3"
    assert hybrid == plain.replace("--spec-type draft-eagle3 ", "--spec-type draft-eagle3,ngram-mod ")
