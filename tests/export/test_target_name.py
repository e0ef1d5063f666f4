"""Portable exports (issue 14, item 6): an export names its target by the reference the user gave, or by
``--target_name``, and warns when only a local cache path is available."""

import json
import logging
from pathlib import Path

from export_helpers import make_head, write_checkpoint

from draftkit.artifacts import resolve_model_dir
from draftkit.export.exporter import export_checkpoint


def _export(tmp_path, target_ref, engine, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    head, ids = make_head(resolve_model_dir(target_ref))
    ckpt = write_checkpoint(tmp_path / "h.ckpt", head, target_ref, ids)
    out = export_checkpoint(ckpt, engine, tmp_path / engine, **kw)
    return json.loads((out / "config.json").read_text()), json.loads((out / "draftkit_export.json").read_text())


def test_tiny_target_exports_with_a_warning_and_target_name_overrides_it(tmp_path, caplog):
    """A head trained on ``tiny:llama`` (or ``pypi:``) has only a cache path to offer: warned; --target_name wins."""
    cache_path = resolve_model_dir("tiny:llama")
    with caplog.at_level(logging.WARNING, logger="draftkit.export.exporter"):
        config, sidecar = _export(tmp_path / "a", "tiny:llama", "speculators")
    name = Path(cache_path).name  # the cache folder's name: no path of this machine in the export
    assert config["speculators_config"]["verifier"]["name_or_path"] == name == sidecar["target_name"]
    assert sidecar["target_path"] == name
    assert "the name of its local cache path" in caplog.text and "--target_name" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draftkit.export.exporter"):
        config, sidecar = _export(tmp_path / "b", "tiny:llama", "speculators", target_name="org/tiny-llama")
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert sidecar["target_name"] == "org/tiny-llama" and sidecar["target"] == "tiny:llama"
    assert "local cache path" not in caplog.text
    _, sidecar = _export(tmp_path / "c", "tiny:llama", "vllm", target_name="org/tiny-llama")
    assert sidecar["launch"].startswith("vllm serve org/tiny-llama --speculative-config")


def test_a_local_path_is_kept_as_written(tmp_path, tiny_target_dir, caplog, monkeypatch):
    """Another reference: a target directory outside the draftkit cache, given relative to the working dir."""
    target = Path(tiny_target_dir)
    monkeypatch.chdir(target.parent)
    relative = f"./{target.name}"
    with caplog.at_level(logging.WARNING, logger="draftkit.export.exporter"):
        config, sidecar = _export(tmp_path, relative, "speculators")
    assert config["speculators_config"]["verifier"]["name_or_path"] == relative == sidecar["target_name"]
    assert "local cache path" not in caplog.text
