"""Shared offline fixtures: a seeded tiny Llama target with a byte-level ChatML tokenizer, tiny chat data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftkit import precision
from draftkit.testing import build_tiny_target, tiny_llama_config

REPO = Path(__file__).resolve().parents[1]


def pytest_report_header(config) -> str:
    """The precision policy's choice on this machine: the ``slow`` tests on the real SmolLM2 run in it."""
    choice = precision.auto_precision("cpu")
    return f"draftkit precision auto: {choice.reason} (torch {torch.__version__}, {torch.get_num_threads()} threads)"


@pytest.fixture()
def fake_precision(monkeypatch):
    """Fake the policy's decision: ``fake_precision("float32", slowdown=30.0)``; the caches are cleared before
    and after, so other tests see this machine's real choice."""

    def install(dtype: str, slowdown: float | None = None, reason: str | None = None) -> precision.PrecisionChoice:
        choice = precision.PrecisionChoice("cpu", dtype, reason or f"fake cpu -> {dtype}", slowdown)
        monkeypatch.setattr(precision, "choose_precision", lambda device, **kw: choice)
        precision._decide.cache_clear()
        precision._warn_if_slow_bf16.cache_clear()
        return choice

    yield install
    precision._decide.cache_clear()
    precision._warn_if_slow_bf16.cache_clear()


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path_factory, monkeypatch):
    """Unit tests write draftkit caches under a per-session temporary directory; ``slow`` tests use the
    user's cache so the real SmolLM2 and ShareGPT are fetched and prepared once per machine."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "draftkit-cache"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # unit tests are tiny; one thread keeps them fast on a shared 2-core machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_config_():
    return tiny_llama_config()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A seeded tiny ``LlamaForCausalLM`` (vocab 320, hidden 64, 8 layers) saved with ``save_pretrained``."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny(tiny_target_dir):
    """(FrozenTarget in float32, tokenizer) of the tiny Llama: V=320, H_t=64, 8 layers, aux ids [2, 4, 5]."""
    from draftkit.target.frozen import FrozenTarget, load_target

    model, tokenizer = load_target(str(tiny_target_dir), "float32")
    return FrozenTarget(model, None), tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture()
def tiny_chat_jsonl(tmp_path) -> Path:
    """8 chat rows (role/content)."""
    path = tmp_path / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} ok"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


@pytest.fixture()
def prompts_file(tmp_path):
    """A JSONL prompt file with an MT-bench record, a ``prompt`` record and a ``messages`` record."""
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"question_id": 7, "turns": ["Tell me a story.", "second turn is ignored"]},
        {"prompt": "abc abc abc abc"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture()
def tiny_module_and_batch(monkeypatch):
    """(built Eagle3Module of recipes/tiny-debug.yaml, float32 target, online; its first training batch)."""
    from draftkit.cli import DraftkitCLI

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml", "--model.target_dtype", "float32",
                            "--data.hidden_states_cache", "null"], run=False)
    cli.datamodule.setup("fit")
    cli.model.build(cli.datamodule)
    return cli.model, next(iter(cli.datamodule.train_dataloader()))
