"""The per-GPU memory estimate that ``fit`` prints before loading (``draftkit.models.memory``), and the refusal of
a run that will not fit."""

from pathlib import Path

import pytest
from transformers import LlamaConfig

from draftkit.models.memory import check_memory, estimate_memory

AUX = [2, 4, 5]


LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0)
"""Llama-3.3-70B-Instruct's shape (its config.json)."""


def test_memory_estimate_counts_the_real_modules(tiny_llama_config_):
    """Each part from the parameter counts of the real modules (tiny target: 336,960 parameters, 8 layers)."""
    from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead

    whole, layer, embed = 336960, 36992, 320 * 64
    head = Eagle3LlamaHead(Eagle3Config.from_target_config(tiny_llama_config_, AUX, 64))
    head_params = sum(p.numel() for p in head.parameters())
    trainable = head_params - head.embed_tokens.weight.numel()
    ddp = estimate_memory(tiny_llama_config_, "ddp", 2, 4, 128, 4, 3, 64)
    sharded = estimate_memory(tiny_llama_config_, "fsdp_target", 2, 4, 128, 4, 3, 64)
    activations = 3 * 4 * 128 * 2 * (24 * 64 + 3 * tiny_llama_config_.intermediate_size + 10 * 64) + 4 * 4 * 128 * 320
    assert (ddp.world, ddp.target, ddp.gathered) == (1, whole * 4, 0)
    assert (sharded.world, sharded.target, sharded.gathered) == (2, whole * 2, max(2 * layer, embed + layer) * 4)
    for est in (ddp, sharded):
        assert (est.head, est.optimizer, est.activations) == (head_params * 4, trainable * 12, activations)
    assert ddp.total == whole * 4 + head_params * 4 + trainable * 12 + activations


def test_a_70b_target_is_refused_under_ddp_and_fits_sharded_on_8_gpus():
    """Llama-3.3-70B in bf16 on 8 x 80 GB at 2,048 tokens: ddp is stopped before loading and told the fix;
    fsdp_target's estimate (the table in recipes/llama3.3-70b-eagle3-8gpu.yaml) fits."""
    config = LlamaConfig(**LLAMA_70B)
    args = (8, 2, 2048, 1, 7, 32000)
    with pytest.raises(ValueError, match=r"^the run will not fit: ~186.1 GB per GPU estimated, the GPU has 80.0 GB; "
                                         r"trainer.strategy fsdp_target shards the target over the 8 GPUs: ~66.4 GB "
                                         r"per GPU \(fits\). Stopped before loading anything"):
        check_memory(config, "ddp", *args, gpu_bytes=80 * 10**9)
    report = check_memory(config, "fsdp_target", *args, gpu_bytes=80 * 10**9)
    recipe = (Path(__file__).resolve().parents[2] / "recipes/llama3.3-70b-eagle3-8gpu.yaml").read_text()
    for line in report.splitlines()[1:]:
        assert line.split("GB")[0] in recipe  # the recipe's comment is this table
    with pytest.raises(ValueError, match=r"~66.4 GB per GPU estimated, the GPU has 40.0 GB; lower data.max_length"):
        check_memory(config, "fsdp_target", *args, gpu_bytes=40 * 10**9)
