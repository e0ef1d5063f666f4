"""Import floors of the package (architecture.md "Floors"), checked on the source with ``ast``.

A module may import only from its own floor or lower ones, lazy (function-level) imports included, and
nothing in ``draftkit/`` may import ``draftkit.callbacks``, and no two packages (``draftkit.X``) import each other,
on one floor or not:

1. selection, quant, jsonio, artifacts, testing, precision, strategy, sampling, kernels, llama_server, heads/eagle3_llama,
   analysis/{cka, entropy, moments, subsets, token_entropy, plots}
2. target, heads/checkpoint, data, kernels/{compile, option}, generation
3. decoding, dual_precision, export, analysis/{collect, report}
4. models
5. cli, fit_run, fit_progress, callbacks (callbacks may import any of 1-4)
6. commands, __main__
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FLOORS = {
    1: ["draftkit", "draftkit.selection", "draftkit.quant", "draftkit.jsonio", "draftkit.artifacts",
        "draftkit.testing", "draftkit.precision", "draftkit.strategy", "draftkit.sampling", "draftkit.kernels",
        "draftkit.llama_server", "draftkit.heads", "draftkit.heads.config", "draftkit.heads.eagle3_llama",
        "draftkit.analysis", "draftkit.analysis.cka", "draftkit.analysis.entropy", "draftkit.analysis.moments",
        "draftkit.analysis.subsets", "draftkit.analysis.token_entropy", "draftkit.analysis.plots"],
    2: ["draftkit.target", "draftkit.heads.checkpoint", "draftkit.data", "draftkit.kernels.compile",
        "draftkit.kernels.option", "draftkit.generation"],
    3: ["draftkit.decoding", "draftkit.dual_precision", "draftkit.export", "draftkit.analysis.collect",
        "draftkit.analysis.report"],
    4: ["draftkit.models"],
    5: ["draftkit.cli", "draftkit.fit_run", "draftkit.fit_progress", "draftkit.callbacks"],
    6: ["draftkit.commands", "draftkit.__main__"],
}
RULES = {name: floor for floor, names in FLOORS.items() for name in names}


def floor_of(module: str) -> int:
    """Floor of a dotted module name: the longest rule that is the name or a package above it.

    Raises:
        KeyError: for a draftkit module no rule covers (add it to FLOORS and architecture.md).
    """
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in RULES and (n == len(parts) or name != "draftkit"):
            return RULES[name]
    raise KeyError(f"{module} is in no floor: add it to tests/test_layering.py FLOORS and architecture.md")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for base, package in ((ROOT / "draftkit", "draftkit"), (ROOT / "callbacks", "draftkit.callbacks")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            rel = rel[:-1] if rel[-1] == "__init__" else rel
            out.append((".".join((package, *rel)), path))
    return out


MODULES = _modules()
KNOWN = {name for name, _ in MODULES}


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """Every draftkit module a file imports, with its line (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, mod] if mod else base)
            for a in node.names:  # `from draftkit.export import vllm` imports the submodule
                sub = f"{mod}.{a.name}"
                found.append((sub if sub in KNOWN else mod, node.lineno))
    return [(m, line) for m, line in found if m == "draftkit" or m.startswith("draftkit.")]


def test_every_module_has_a_floor():
    assert len(MODULES) > 40
    for name, _ in MODULES:
        floor_of(name)


@pytest.mark.parametrize("name, path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_stay_on_or_below_the_floor(name, path):
    own = floor_of(name)
    bad = []
    for target, line in _imports(name, path):
        if target.startswith("draftkit.callbacks") and not name.startswith("draftkit.callbacks"):
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}: nothing in draftkit/ imports callbacks")
        elif floor_of(target) > own:
            bad.append(f"{path.relative_to(ROOT)}:{line} (floor {own}) imports {target} (floor {floor_of(target)})")
    assert not bad, "\n".join(bad)


def test_floor_rules_on_examples():
    assert floor_of("draftkit.analysis.cka") == 1 and floor_of("draftkit.analysis.collect") == 3
    assert floor_of("draftkit.heads.checkpoint") == 2 and floor_of("draftkit.heads.eagle3_llama") == 1
    assert floor_of("draftkit.kernels.ttt_attention") == 1 and floor_of("draftkit.kernels.option") == 2
    assert floor_of("draftkit.decoding.tree") == 3 and floor_of("draftkit.commands.evaluate") == 6
    assert floor_of("draftkit.generation.hidden_states") == 2 and floor_of("draftkit.data.hidden_cache") == 2
    assert floor_of("draftkit.decoding.lossless") == 3
    assert floor_of("draftkit.callbacks.export") == 5 and floor_of("draftkit") == 1
    with pytest.raises(KeyError, match="no floor"):
        floor_of("draftkit.somewhere_new")


def _package(module: str) -> str:
    """``draftkit.X`` of a module ``draftkit.X.y`` (``draftkit`` itself for the top-level modules' package)."""
    return ".".join(module.split(".")[:2])


def package_cycles(modules: list[tuple[str, Path]], root: Path = ROOT) -> list[str]:
    """Pairs of packages that import each other, each with one import line of either direction."""
    edges: dict[tuple[str, str], str] = {}
    for name, path in modules:
        for target, line in _imports(name, path):
            a, b = _package(name), _package(target)
            if a != b and "draftkit" not in (a, b):
                edges.setdefault((a, b), f"{path.relative_to(root)}:{line}")
    return [f"{a} <-> {b}: {edges[a, b]} and {edges[b, a]}" for a, b in sorted(edges) if a < b and (b, a) in edges]


def test_no_two_packages_import_each_other():
    assert not package_cycles(MODULES), "\n".join(package_cycles(MODULES))


def test_package_cycles_finds_a_pair_on_one_floor(tmp_path):
    (tmp_path / "a.py").write_text("from draftkit.export.load import load_head\n")
    (tmp_path / "b.py").write_text("def f():\n    from draftkit.decoding import tree\n")
    fake = [("draftkit.decoding.bench", tmp_path / "a.py"), ("draftkit.export.x", tmp_path / "b.py")]
    assert package_cycles(fake, tmp_path) == ["draftkit.decoding <-> draftkit.export: a.py:1 and b.py:2"]


def test_data_does_not_run_the_target():
    """``data/`` keeps formats, readers, splits and the datamodule; data made by running the target (regeneration,
    the hidden-state cache writer) lives in ``generation/``. So of ``draftkit.target`` a ``data`` module imports
    only the tokenizer facts (``target.tokens``)."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}" for name, path in MODULES
           if name.startswith("draftkit.data.") for target, line in _imports(name, path)
           if target.startswith("draftkit.target") and target != "draftkit.target.tokens"]
    assert not bad, "\n".join(bad)
