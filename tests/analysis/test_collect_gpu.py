"""The analysis on CUDA equals the CPU result (gpu tier)."""

import pytest
import torch

from draftkit.analysis.collect import LayerAnalysisConfig, collect_layer_statistics


def _batches(num=4, b=2, t=64):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(num):
        loss = torch.zeros(b, t, dtype=torch.long)
        loss[:, 20:] = 1
        out.append({"input_ids": torch.randint(0, 256, (b, t), generator=g),
                    "attention_mask": torch.ones(b, t, dtype=torch.long), "loss_mask": loss})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cka", ["exact", "minibatch"])
def test_cuda_equals_cpu(tiny_llama, cka):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, _ = tiny_llama
    cfg = LayerAnalysisConfig(num_tokens=10_000, min_tokens=16, cka=cka, cka_batch_size=64, warmup_rows=64,
                              sink_factor=100.0, entropy_quantile=0.3, rerank_rows=64)
    cpu = collect_layer_statistics(model, _batches(), cfg)
    model.cuda()
    try:
        gpu = collect_layer_statistics(model, _batches(), cfg, device="cuda")
    finally:
        model.cpu()
    assert gpu.num_rows == cpu.num_rows and gpu.counts == cpu.counts
    assert torch.allclose(gpu.h1, cpu.h1, atol=1e-4) and torch.allclose(gpu.h2, cpu.h2, atol=1e-4)
    assert torch.allclose(gpu.cka, cpu.cka, atol=1e-4)
    assert gpu.concat_entropies([0, 2, 5])[0] == pytest.approx(cpu.concat_entropies([0, 2, 5])[0], abs=1e-4)
