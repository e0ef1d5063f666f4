"""Fixtures of the benchmark-script tests: the scripts in ``benchmarks/`` loaded as modules."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def benchmark_module():
    """``load(name)`` imports ``benchmarks/<name>.py`` (not a package) as a module, registered in ``sys.modules``
    (dataclasses resolve annotations through it)."""
    import importlib.util
    import sys

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
