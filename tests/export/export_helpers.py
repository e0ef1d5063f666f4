"""Helpers for export tests: the tiny seeded Llama target (``draftkit.testing.build_tiny_target``), and a writer for minimal
draftkit training checkpoints with the layout ``draftkit fit`` writes (no trainer needed)."""

from __future__ import annotations

import dataclasses

import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.selection.vocab import VocabMap
from draftkit.testing import build_tiny_target


def save_tiny_target(path, **overrides):
    """The shared tiny Llama with a non-default RoPE theta (a config field an exporter forgets shows up)."""
    return str(build_tiny_target(path, **{"rope_theta": 50000.0, **overrides}))


def make_head(target_dir, aux_layer_ids=None, draft_vocab_size=96, norm_before_residual=False, seed=1):
    """A randomly initialised head sized from the tiny target, with random norm weights and a sparse vocab."""
    from transformers import AutoConfig

    from draftkit.selection.layers import validate_aux_layer_ids

    tcfg = AutoConfig.from_pretrained(target_dir)
    ids = validate_aux_layer_ids(aux_layer_ids, tcfg.num_hidden_layers)
    cfg = Eagle3Config.from_target_config(tcfg, ids, draft_vocab_size, norm_before_residual=norm_before_residual)
    torch.manual_seed(seed)
    head = Eagle3LlamaHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # not all-ones, so a swapped norm shows up
    g = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab_size]).values
    vm = VocabMap.from_ids(used, cfg.vocab_size)
    head.set_vocab(vm.d2t, vm.t2d)
    return head.eval(), ids


def make_flagged_head(target_dir, flags, **make_head_args):
    """:func:`make_head` with Eagle3Config fields ``flags`` set (e.g. the EAGLE-3.1 ``norm_before_fc``,
    ``fc_norm``, ``norm_output``); the new input/fc norm weights are random around 1 too."""
    base, ids = make_head(target_dir, **make_head_args)
    head = Eagle3LlamaHead(Eagle3Config(**{**base.config.__dict__, **flags}))
    head.load_state_dict(base.state_dict(), strict=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("input_norm.", "fc_norm.")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return head.eval(), ids


def write_checkpoint(path, head, target, aux_layer_ids, drop=(), state_extra=None):
    """Save {"state_dict": {"head."+k: ...}, "draftkit": meta} like a draftkit training checkpoint (the aux ids
    stored once, in ``head_config``)."""
    state = {"head." + k: v.clone() for k, v in head.export_state_dict().items() if k not in drop}
    state.update(state_extra or {})
    meta = {
        "head_config": {**dataclasses.asdict(head.config), "aux_layer_ids": list(aux_layer_ids)},
        "target": str(target),
        "target_dtype": "float32",
        "chat_template": None,
        "ttt": {"steps": 7, "decay": 0.8},
    }
    torch.save({"state_dict": state, "draftkit": meta}, path)
    return path
