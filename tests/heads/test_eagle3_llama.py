"""Head shapes, serving keys, and the TTT path against step-by-step cached decoding."""

import pytest
import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead, KVCache
from draftkit.testing import tiny_llama_config


def _head(dtype=torch.float64, seed=0):
    cfg = Eagle3Config.from_target_config(tiny_llama_config(), [2, 4, 5], 320)
    torch.manual_seed(seed)
    head = Eagle3LlamaHead(cfg).to(dtype)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return head


def test_serving_keys_and_shapes():
    head = _head()
    shapes = {k: tuple(v.shape) for k, v in head.export_state_dict().items()}
    assert shapes == {
        "d2t": (320,), "t2d": (320,), "fc.weight": (64, 192),
        "midlayer.input_layernorm.weight": (64,), "midlayer.hidden_norm.weight": (64,),
        "midlayer.self_attn.q_proj.weight": (64, 128), "midlayer.self_attn.k_proj.weight": (32, 128),
        "midlayer.self_attn.v_proj.weight": (32, 128), "midlayer.self_attn.o_proj.weight": (64, 64),
        "midlayer.post_attention_layernorm.weight": (64,), "midlayer.mlp.gate_proj.weight": (128, 64),
        "midlayer.mlp.up_proj.weight": (128, 64), "midlayer.mlp.down_proj.weight": (64, 128),
        "norm.weight": (64,), "lm_head.weight": (320, 64),
    }
    assert not head.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("pad", [False, True])
def test_ttt_unrolled_equals_step_by_step_cached_decoding(pad):
    """Row p at TTT step k equals a chain that prefills rows 0..p and then drafts k tokens with a KV cache."""
    head = _head()
    b, t, steps = 2, 7, 4
    torch.manual_seed(1)
    aux = torch.randn(b, t, 192, dtype=torch.float64)
    ids = torch.randint(0, 320, (b, t + steps))
    pos = torch.arange(t).expand(b, t)
    mask = torch.ones(b, t, dtype=torch.bool)
    if pad:
        mask[1, 5:] = False  # sequence 1 has 5 real tokens
    cache, feature, outs = [], head.project(aux), []
    for k in range(steps):
        logits, feature = head.ttt_step(ids[:, 1 + k : 1 + k + t], feature, pos + k, cache, mask)
        outs.append(logits)
    for row in range(b):
        n = int(mask[row].sum())
        for p in range(n):
            kv = KVCache()
            sl = slice(row, row + 1)
            logits, h = head(ids[sl, 1 : p + 2], head.project(aux[sl, : p + 1]), pos[sl, : p + 1], kv)
            torch.testing.assert_close(logits[0, -1], outs[0][row, p], rtol=1e-9, atol=1e-9)
            f = h[:, -1:]
            for k in range(1, steps):
                logits, f = head(ids[sl, p + 1 + k : p + 2 + k], f, pos[sl, p : p + 1] + k, kv)
                torch.testing.assert_close(logits[0, -1], outs[k][row, p], rtol=1e-9, atol=1e-9)


def test_logits_index_selects_rows():
    head = _head()
    aux = torch.randn(2, 5, 192, dtype=torch.float64)
    ids = torch.randint(0, 320, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    full, _ = head.ttt_step(ids, head.project(aux), pos, [], mask)
    rows = torch.tensor([0, 3, 9])
    part, _ = head.ttt_step(ids, head.project(aux), pos, [], mask, rows)
    torch.testing.assert_close(part, full.reshape(10, -1)[rows])


def test_unsupported_target_type():
    cfg = tiny_llama_config()
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match="unsupported target model_type 'gpt2'"):
        Eagle3Config.from_target_config(cfg, [2, 4, 5], 64)


def test_set_vocab_shape_mismatch():
    head = _head()
    with pytest.raises(ValueError, match="do not match the head"):
        head.set_vocab(torch.zeros(10, dtype=torch.long), torch.zeros(320, dtype=torch.bool))


def test_ttt_step_on_nested_row_subsets_equals_all_rows():
    """Steps >= 1 computed only on some rows (nested sets) give those rows' logits and h exactly."""
    head = _head()
    b, t = 2, 6
    torch.manual_seed(2)
    aux = torch.randn(b, t, 192, dtype=torch.float64)
    ids = torch.randint(0, 320, (b, t))
    pos = torch.arange(t).expand(b, t)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 4:] = False
    subsets = [None, torch.tensor([0, 2, 3, 5, 6, 8]), torch.tensor([2, 5, 8])]
    full_cache, part_cache = [], []
    full_h = part_h = head.project(aux)
    for k, rows in enumerate(subsets):
        full_logits, full_h = head.ttt_step(ids, full_h, pos + k, full_cache, mask)
        if rows is None:
            part_logits, part_h = head.ttt_step(ids, part_h, pos + k, part_cache, mask)
            part_h, prev = part_h.reshape(b * t, -1), torch.arange(b * t)
            continue
        feat = part_h[torch.searchsorted(prev, rows)]
        part_logits, part_h = head.ttt_step(ids, feat, pos + k, part_cache, mask, torch.arange(len(rows)), rows)
        prev = rows
        torch.testing.assert_close(part_logits, full_logits.reshape(b * t, -1)[rows], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(part_h, full_h.reshape(b * t, -1)[rows], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="step 0"):
        head.ttt_step(ids, head.project(aux).reshape(b * t, -1)[:3], pos, [], mask, None, torch.arange(3))


# Eagle3Config defaults that change the head's output (issue 36).


def test_config_defaults():
    cfg = Eagle3Config(target_hidden_size=8, hidden_size=8, num_aux_layers=3, intermediate_size=16, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, vocab_size=32, draft_vocab_size=16)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.rope) == (1e-5, 8192, {"rope_theta": 10000.0})
