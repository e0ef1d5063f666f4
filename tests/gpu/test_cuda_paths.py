"""The CUDA paths (gpu tier; skipped without CUDA): each equals its CPU run.

- the TTT attention and its FlexAttention candidate (value and gradient against the dense reference, on CUDA,
  bf16 and float32);
- the training step (loss and gradients of the tiny recipe's first batch, CUDA vs CPU, float32);
- the decode loops and ``evaluate --device cuda`` (greedy tokens identical to the CPU's in float32).
``benchmarks/gpu_check.sh`` runs them on a GPU machine.
"""

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
REPO = Path(__file__).resolve().parents[2]
PROMPT = [256, 10, 72, 101, 108, 108, 111, 257, 10]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("t", [7, 300])
def test_ttt_attention_on_cuda_equals_the_dense_reference(dtype, tol, t):
    from draftkit.kernels.ttt_attention import ttt_attention, ttt_attention_eager, ttt_attention_flex

    g = torch.Generator().manual_seed(0)
    b, heads, kv, d = 2, 4, 2, 64
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, (2 * t) // 3:] = False
    for steps in (1, 3):
        q = torch.randn(b, heads, t, d, generator=g).cuda().to(dtype).requires_grad_()
        cache = [tuple(torch.randn(b, kv, t, d, generator=g).cuda().to(dtype).requires_grad_() for _ in range(2))
                 for _ in range(steps)]
        leaves = [q] + [x for kv_ in cache for x in kv_]
        real = mask.cuda()[:, None, :, None]
        outs = []
        for attend in (ttt_attention_eager, ttt_attention, ttt_attention_flex):  # flex: the CUDA candidate
            o = attend(q, cache, mask.cuda(), d**-0.5)
            outs.append([o * real] + list(torch.autograd.grad((o.float() * real).sum(), leaves)))
        for candidate in outs[1:]:
            for ref, got in zip(outs[0], candidate):
                torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_training_step_on_cuda_equals_cpu(tiny_module_and_batch):
    model, batch = tiny_module_and_batch
    params = [p for p in model.head.parameters() if p.requires_grad]
    loss_cpu, _ = model.ttt_loss(batch)
    grads_cpu = torch.autograd.grad(loss_cpu, params)
    model.cuda()
    cuda_batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    loss_gpu, _ = model.ttt_loss(cuda_batch)
    grads_gpu = torch.autograd.grad(loss_gpu, params)
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads_gpu, grads_cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-3, atol=1e-5)


def test_decode_loops_on_cuda_equal_cpu(tiny):
    import sys

    sys.path.insert(0, str(REPO / "tests" / "decoding"))
    from decoding_stubs import make_head

    from draftkit.decoding.drafters import Eagle3Drafter
    from draftkit.decoding.tree import Eagle3TreeDrafter, TreeConfig, generate_tree
    from draftkit.decoding.verify import generate_plain, generate_speculative
    from draftkit.sampling import DecodeConfig
    from draftkit.target.session import TargetSession

    target, _ = tiny
    head = make_head(target)
    cfg = DecodeConfig(max_new_tokens=24)
    outs = {}
    for device in ("cpu", "cuda"):
        target.model.to(device)
        head.to(device)
        session = TargetSession(target)
        prompt = torch.tensor(PROMPT, device=device)
        outs[device] = (generate_plain(session, prompt, cfg).tokens,
                        generate_speculative(session, Eagle3Drafter(head), prompt, 3, cfg).tokens,
                        generate_tree(session, Eagle3TreeDrafter(head), prompt, TreeConfig(3, 2, 4), cfg).tokens)
    target.model.to("cpu")
    assert outs["cuda"] == outs["cpu"]
    assert outs["cuda"][1] == outs["cuda"][0] == outs["cuda"][2]  # lossless on CUDA too


def test_evaluate_runs_on_cuda(tmp_path, tiny, tiny_target_dir, prompts_file):
    import dataclasses
    import json
    import sys

    sys.path.insert(0, str(REPO / "tests" / "decoding"))
    from decoding_stubs import make_head

    from draftkit.commands import main

    head = make_head(tiny[0])
    meta = {"head_config": dataclasses.asdict(head.config), "target": str(tiny_target_dir), "target_dtype": "float32",
            "aux_layer_ids": list(head.config.aux_layer_ids), "chat_template": None, "ttt": {"steps": 3, "decay": 0.8}}
    ckpt = tmp_path / "head.ckpt"
    torch.save({"state_dict": {f"head.{k}": v for k, v in head.export_state_dict().items()}, "draftkit": meta}, ckpt)
    out = tmp_path / "report.json"
    assert main(["evaluate", "--checkpoint", str(ckpt), "--prompts", str(prompts_file), "--output", str(out),
                 "--max_new_tokens", "12", "--k", "3", "--dtype", "float32", "--device", "cuda"]) == 0
    report = json.loads(out.read_text())
    assert report["setup"]["device"].startswith("cuda") and report["greedy_equal"] == report["num_prompts"] == 3
