"""model.init_decoder_from_target_layer: the draft decoder layer starts from one target decoder layer's weights
(Eagle3LlamaHead.init_decoder_from_target_layer; the target's layer from FrozenTarget or the offline loader)."""

from pathlib import Path

import pytest
import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.models.eagle3 import Eagle3Module
from draftkit.target.frozen import FrozenTarget, load_target
from draftkit.target.lm_head import load_target_lm_head

LAYER = 3
COPIED = {  # target layer name -> head name (the full tensor)
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "hidden_norm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny Llama with layer norms that are not ones, so that a copied norm is visible."""
    model, _ = load_target(str(tiny_target_dir), "float32")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.input_layernorm.weight.copy_(torch.linspace(0.5, 1.5, 64) + i)
            layer.post_attention_layernorm.weight.copy_(torch.linspace(2.0, 0.25, 64) - 0.1 * i)
    path = tmp_path_factory.mktemp("normed") / "llama"
    model.save_pretrained(path)
    for f in Path(tiny_target_dir).iterdir():  # the tokenizer files
        if not (path / f.name).exists():
            (path / f.name).write_bytes(f.read_bytes())
    return path


def _head(target, dtype=torch.float32) -> Eagle3LlamaHead:
    torch.manual_seed(0)
    cfg = Eagle3Config.from_target_config(target.config, target.aux_layer_ids, 320)
    return Eagle3LlamaHead(cfg).to(dtype)


@pytest.mark.parametrize("offline", [False, True])
def test_copies_are_exact_and_the_embedding_half_is_zero(target_dir, offline):
    """Every mapped tensor equals the target layer's bit for bit; q/k/v hold it in their feature half (columns
    H..2H) and zeros in their embedding half (0..H); the embedding's input_layernorm stays at ones; the copies do
    not share storage with the target. Online (FrozenTarget) and offline (safetensors by name) alike."""
    model, _ = load_target(str(target_dir), "float32")
    target = load_target_lm_head(str(target_dir), "float32") if offline else FrozenTarget(model)
    layer = {k: v.clone() for k, v in model.model.layers[LAYER].state_dict().items()}
    head = _head(target)
    head.init_decoder_from_target_layer(target.decoder_layer_state(LAYER), target.config)
    mid = dict(head.midlayer.named_parameters())
    for src, dst in COPIED.items():
        assert torch.equal(mid[dst], layer[src]), dst
    for p in "qkv":
        w = mid[f"self_attn.{p}_proj.weight"]
        assert w.shape[1] == 128
        assert torch.equal(w[:, 64:], layer[f"self_attn.{p}_proj.weight"])
        assert torch.equal(w[:, :64], torch.zeros_like(w[:, :64]))
    assert torch.equal(mid["input_layernorm.weight"], torch.ones(64))
    with torch.no_grad():
        head.midlayer.mlp.up_proj.weight.add_(1.0)  # the head's tensor is its own
    assert torch.equal(model.model.layers[LAYER].mlp.up_proj.weight, layer["mlp.up_proj.weight"])


def test_the_initialised_layer_is_the_target_layer_on_the_feature(target_dir):
    """With the embedding half at zero, the draft layer on feature hidden_states[l] (any token embedding, causal,
    no cache) returns hidden_states[l + 1], the target layer's own output."""
    model, _ = load_target(str(target_dir), "float32")
    target = FrozenTarget(model)
    head = _head(target)
    head.init_decoder_from_target_layer(target.decoder_layer_state(LAYER), target.config)
    ids = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        pos = torch.arange(9).expand(2, 9)
        cos, sin = head.rope(states[LAYER], pos)
        emb = torch.randn(2, 9, 64)
        h = head.midlayer(emb, states[LAYER], lambda u: head.midlayer.self_attn.forward_cached(u, cos, sin, None))
    torch.testing.assert_close(h, states[LAYER + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target_dtype, dtype", [("float32", torch.bfloat16), ("float32", torch.float16),
                                                 ("bfloat16", torch.float32)])
def test_the_copy_takes_the_heads_dtype(target_dir, target_dtype, dtype):
    """A target layer copied into a head of another dtype: each tensor is the target's, cast once."""
    model, _ = load_target(str(target_dir), target_dtype)
    target = FrozenTarget(model)
    head = _head(target, dtype)
    head.init_decoder_from_target_layer(target.decoder_layer_state(LAYER), target.config)
    w = head.midlayer.self_attn.k_proj.weight
    assert w.dtype == dtype
    assert torch.equal(w[:, 64:], model.model.layers[LAYER].self_attn.k_proj.weight.to(dtype))


def test_a_head_of_another_shape_or_a_layer_it_cannot_hold_is_refused(target_dir):
    """A head of another geometry than the target's (intermediate size; heads split 8 x 8 instead of 4 x 16, where
    q and o keep their shapes), a tensor of another shape, a bias or q/k norm the head has no place for, a
    missing tensor, or a non-SiLU MLP: ValueError naming what differs, and nothing is copied."""
    model, _ = load_target(str(target_dir), "float32")
    target = FrozenTarget(model)
    state = target.decoder_layer_state(LAYER)
    for override, message in (({"intermediate_size": 96}, r"intermediate_size 96 \(target 128\)"),
                              ({"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8},
                               r"num_attention_heads 8 \(target 4\), num_key_value_heads 4 \(target 2\), "
                               r"head_dim 8 \(target 16\)")):
        cfg = Eagle3Config.from_target_config(target.config, target.aux_layer_ids, 320, **override)
        head = Eagle3LlamaHead(cfg)
        before = {k: v.clone() for k, v in head.midlayer.state_dict().items()}
        with pytest.raises(ValueError, match=rf"the draft layer's geometry differs from the target layer's: {message}"):
            head.init_decoder_from_target_layer(state, target.config)
        assert all(torch.equal(v, before[k]) for k, v in head.midlayer.state_dict().items())
    head = _head(target)
    before = {k: v.clone() for k, v in head.midlayer.state_dict().items()}
    cases = [
        ({**state, "mlp.down_proj.weight": state["mlp.down_proj.weight"][:, :96]},
         r"target layer tensor mlp.down_proj.weight is \(64, 96\), the head's needs \(64, 128\)"),
        ({**state, "self_attn.q_norm.weight": torch.ones(16)}, r"has no place for: \['self_attn.q_norm.weight'\]"),
        ({k: v for k, v in state.items() if k != "mlp.down_proj.weight"}, r"missing: \['mlp.down_proj.weight'\]"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            head.init_decoder_from_target_layer(bad, target.config)
    gelu = type(target.config)(**{**target.config.to_dict(), "hidden_act": "gelu_pytorch_tanh"})
    with pytest.raises(ValueError, match="activation 'gelu_pytorch_tanh'"):
        head.init_decoder_from_target_layer(state, gelu)
    assert all(torch.equal(v, before[k]) for k, v in head.midlayer.state_dict().items())


def test_the_module_option_refuses_naming_itself(tmp_path, tiny_target_dir):
    """Eagle3Module.build: a layer out of range and a target whose layers carry q/k biases are refused, the
    message naming model.init_decoder_from_target_layer."""
    from draftkit.testing import build_tiny_target

    with pytest.raises(ValueError, match=r"model.init_decoder_from_target_layer=8: decoder layer 8 is not a layer "
                                         r"of the target: it has 8 decoder layers, 0..7"):
        Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=320,
                     init_decoder_from_target_layer=8).build()
    biased = build_tiny_target(tmp_path / "biased", attention_bias=True)
    with pytest.raises(ValueError, match=r"model.init_decoder_from_target_layer=2: .*has no place for: "
                                         r"\['self_attn.k_proj.bias', 'self_attn.o_proj.bias'"):
        Eagle3Module(str(biased), target_dtype="float32", draft_vocab_size=320,
                     init_decoder_from_target_layer=2).build()


def test_fit_with_the_option_trains_and_its_checkpoint_reloads_and_exports_the_same(tmp_path, monkeypatch, target_dir):
    """3 optimizer steps of the tiny recipe from layer 3 of the target: the layer starts as the copy, trains
    (the zeroed embedding half moves), and the checkpoint read back and its vLLM export hold the module's tensors."""
    from draftkit.cli import DraftkitCLI
    from draftkit.export import export_checkpoint, load_exported_head
    from draftkit.heads.checkpoint import head_from_checkpoint

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml", "--model.target", str(target_dir),
                            "--model.init_decoder_from_target_layer", str(LAYER), "--model.draft_vocab_size", "320",
                            "--trainer.max_steps", "3",
                            "--trainer.max_time", "null", "--trainer.default_root_dir", str(tmp_path),
                            "--data.hidden_states_cache", "null"], run=False)
    cli.datamodule.setup("fit")
    cli.model.build(cli.datamodule)
    q0 = cli.model.head.midlayer.self_attn.q_proj.weight.detach().clone()
    assert torch.equal(q0[:, 64:], cli.model.target.decoder_layer_state(LAYER)["self_attn.q_proj.weight"])
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 3
    q = cli.model.head.midlayer.self_attn.q_proj.weight
    assert not torch.equal(q[:, :64], q0[:, :64]) and not torch.equal(q[:, 64:], q0[:, 64:])
    ckpt = tmp_path / "last.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    trained = cli.model.head.export_state_dict()
    assert torch.load(ckpt, weights_only=False)["hyper_parameters"]["init_decoder_from_target_layer"] == LAYER
    head, _ = head_from_checkpoint(ckpt)
    reloaded = head.export_state_dict()
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[k], trained[k]) for k in trained)
    exported, _ = load_exported_head(export_checkpoint(ckpt, "vllm", tmp_path / "vllm", dtype="float32"))
    out = exported.export_state_dict()
    assert out.keys() == trained.keys() and all(torch.equal(out[k], trained[k]) for k in trained)


def test_refused_together_with_init_head():
    """Both options start the draft decoder layer; setting both is refused before anything loads, naming both."""
    with pytest.raises(ValueError, match=r"model.init_head and model.init_decoder_from_target_layer both start"):
        Eagle3Module(target="tiny:llama", init_head="some/head.ckpt", init_decoder_from_target_layer=1)
