"""``callbacks/`` installs as ``draftkit.callbacks`` with its YAML bundle."""

import importlib.resources
from pathlib import Path

import yaml


def test_callbacks_package_and_bundle():
    import draftkit.callbacks

    assert Path(draftkit.callbacks.__file__).parent.name == "callbacks"
    bundle = yaml.safe_load(importlib.resources.files("draftkit.callbacks").joinpath("default.yaml").read_text())
    paths = [c["class_path"] for c in bundle["trainer"]["callbacks+"]]
    assert "lightning.pytorch.callbacks.LearningRateMonitor" in paths
    # no second copy of the package inside draftkit/ (tools/mutation.py's scratch tree links it there: allowed)
    inner = Path(__file__).resolve().parents[2] / "draftkit" / "callbacks"
    assert not inner.exists() or inner.is_symlink()
