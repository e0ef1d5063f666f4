"""Non-finite logits never become tokens: the samplers raise naming the position, ``evaluate`` names the prompt
and the dtypes (issue 30 item 1, case b14)."""

import pytest
import torch

from draftkit.decoding.harness import evaluate_head
from draftkit.sampling import NonFiniteLogitsError, check_finite_logits, probs_from_logits, sample
from draftkit.decoding.verify import greedy_verify


def test_b14_greedy_sample_on_nan_names_the_position():
    """Case b14: at T=0 the argmax of [0, .., nan at 5, .., 0] was 5, returned without complaint."""
    z = torch.zeros(10)
    z[5] = float("nan")
    with pytest.raises(NonFiniteLogitsError) as err:
        sample(z, 0.0)
    assert isinstance(err.value, ValueError)
    assert err.value.position == (5,) and err.value.dtype == "float32"
    assert str(err.value).startswith(
        "non-finite logits: 1 of 10 values (float32) are NaN/inf, first at position [5] (vocab id 5) = nan; ")


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 0.9)])
def test_every_sampling_mode_refuses_inf(temperature, top_k, top_p):
    z = torch.zeros(2, 6, dtype=torch.bfloat16)
    z[1, 4] = float("inf")
    z[1, 5] = float("-inf")
    for fn in (sample, probs_from_logits):
        with pytest.raises(NonFiniteLogitsError, match=r"2 of 12 values \(bfloat16\) are NaN/inf, first at position "
                           r"\[1, 4\] \(row \(1,\), vocab id 4\) = inf; bfloat16 arithmetic may have overflowed"):
            fn(z, temperature, top_k, top_p)


def test_finite_logits_pass_and_greedy_verify_checks_the_target():
    z = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    check_finite_logits(z)  # no error
    assert sample(z, 0.0).tolist() == [1, 0]
    assert greedy_verify(torch.tensor([1]), z) == (1, 0)
    z[0, 2] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite target verify logits: .* position \[0, 2\]"):
        greedy_verify(torch.tensor([1]), z)


PROMPTS = [[256, 1, 2, 3], [256, 9, 300, 9], [256, 4, 5]]


def _nan_when(module, bad_token: int | None = None):
    """Forward hook: NaN output when the module's input ids hold ``bad_token`` (None: always)."""

    def hook(mod, args, out):
        if bad_token is None or bool((args[0] == bad_token).any()):
            return out * float("nan")
        return out

    return module.register_forward_hook(hook)


def test_evaluate_names_the_prompt_and_dtype_of_nan_target_logits(tiny, tiny_head):
    """Prompt 1 (and only it) holds token 300, whose embedding the hook turns into NaN: the target's prefill
    logits are NaN there; prompt 0 decodes normally first."""
    target, _ = tiny
    handle = _nan_when(target.model.get_input_embeddings(), 300)
    try:
        with pytest.raises(NonFiniteLogitsError) as err:
            evaluate_head(tiny_head, target, None, PROMPTS, k=3, max_new_tokens=5, eos_token_ids=[257],
                          prompt_lookup=False, warmup=False)
    finally:
        handle.remove()
    msg = str(err.value)
    assert msg.startswith("prompt 1 (id '1'): non-finite target logits: 320 of 320 values (float32) are NaN/inf, "
                          "first at position [0] (vocab id 0) = nan")
    assert msg.endswith("[target dtype float32, head dtype float32]")
    # the same evaluation without the hook runs through
    report = evaluate_head(tiny_head, target, None, PROMPTS, k=3, max_new_tokens=5, eos_token_ids=[257],
                           prompt_lookup=False, warmup=False)
    assert report["num_prompts"] == 3


def test_evaluate_names_the_prompt_of_nan_draft_logits_in_bfloat16(tiny, tiny_head):
    """A bf16 head whose lm_head outputs NaN: the first draft of prompt 0 stops the run (chain and tree)."""
    target, _ = tiny
    head = tiny_head.to(torch.bfloat16)
    handle = _nan_when(head.lm_head)
    try:
        with pytest.raises(NonFiniteLogitsError, match=r"^prompt 0 \(id '0'\) \(warm-up\): non-finite draft logits "
                           r"at draft position 1: 256 of 256 values \(bfloat16\) .*\[target dtype float32, head dtype "
                           r"bfloat16\]$"):
            evaluate_head(head, target, None, PROMPTS, k=3, max_new_tokens=5, eos_token_ids=[257],
                          prompt_lookup=False)
        from draftkit.decoding.tree import TreeConfig

        with pytest.raises(NonFiniteLogitsError, match=r"^prompt 0 \(id '0'\): non-finite draft logits at tree depth 1"):
            evaluate_head(head, target, None, PROMPTS, tree=TreeConfig(2, 2, 4), max_new_tokens=5,
                          eos_token_ids=[257], prompt_lookup=False, warmup=False, baseline=False)
    finally:
        handle.remove()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_chain_names_the_draft_position_of_its_first_nan(tiny, tiny_head, temperature):
    """The chain, greedy or sampled, checks its k draft logits once a round (one host sync, not one a token) and
    still names the first non-finite position: the head's 2nd lm_head call of the first round (draft position 2)
    is NaN."""
    target, _ = tiny
    calls = []

    def hook(mod, args, out):
        calls.append(1)
        return out * float("nan") if len(calls) == 2 else out

    handle = tiny_head.lm_head.register_forward_hook(hook)
    try:
        with pytest.raises(NonFiniteLogitsError, match=r"^prompt 0 \(id '0'\): non-finite draft logits at draft "
                           r"position 2: 256 of 256 values \(float32\)"):
            evaluate_head(tiny_head, target, None, PROMPTS, k=3, max_new_tokens=5, eos_token_ids=[257],
                          prompt_lookup=False, warmup=False, baseline=False, temperature=temperature)
    finally:
        handle.remove()
    assert len(calls) == 3  # the round drafted all k = 3 tokens before its one check
