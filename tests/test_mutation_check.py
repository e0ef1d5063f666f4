"""benchmarks/mutation_check.py: the mutation list still matches the code; the whole check is opt-in."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]




def test_every_mutant_applies_exactly_once(benchmark_module):
    """Each original snippet occurs once in its module, names are unique and every selection names test files
    that exist: when code moves, this names the mutants to repoint."""
    mod = benchmark_module("mutation_check")
    mutants = mod.all_mutants()
    assert len(mutants) >= 36 and sum(bool(m.issue) for _, m in mutants) == 11
    assert mod.check_snippets(REPO) == []
    assert len({(path, m.name) for path, m in mutants}) == len(mutants)
    for _, m in mutants:
        assert m.original != m.replacement
        assert all((REPO / t.split("::")[0]).is_file() for t in m.tests if t.startswith("tests/")), m.name


@pytest.mark.mutation
@pytest.mark.skipif(not os.environ.get("DRAFTKIT_MUTATION"), reason="opt-in: set DRAFTKIT_MUTATION=1 (a few minutes)")
def test_mutation_score():
    """The whole check in its own process (it must import draftkit only inside its scratch copies)."""
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mutation_check.py"), "--min-score", "0.95"],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
