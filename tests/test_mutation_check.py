"""tools/mutation.py: the generator's exact mutants, the hand list still matches the code, a run mutates the tree
its tests import (callbacks included) and a cached rerun retests nothing; the whole check is opt-in."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "mutation.py"


@pytest.fixture(scope="module")
def mutation():
    spec = importlib.util.spec_from_file_location("mutation", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


SOURCE = '''\
def f(x, mask, n=2):
    """Docs 1 < 2."""
    if x < n and not mask:
        raise ValueError(f"bad {n + 1}")
    y = (x * mask).sum() - x[1:n].max()
    y += g(x, n).detach()
    return -y
'''


def test_generator_lists_exact_mutants(mutation):
    """Every operator site of a tiny function, in source order; the docstring, the raise and its f-string
    are left alone, and each mutant is its exact original text at its offset and the replacement."""
    got = [(m.name, m.original, m.replacement) for m in mutation.generate(SOURCE)]
    assert got == [
        ("const:2->3@1:17", "2", "3"),
        ("boolop:And->Or@3:7", "x < n and not mask", "(x < n or not mask)"),
        ("cmp:Lt->LtE@3:7", "x < n", "(x <= n)"),
        ("not:drop@3:17", "not mask", "mask"),
        ("binop:Sub->Add@5:8", "(x * mask).sum() - x[1:n].max()", "((x * mask).sum() + x[1:n].max())"),
        ("reduce:sum->mean@5:8", "(x * mask).sum()", "(x * mask).mean()"),
        ("binop:Mult->Div@5:9", "x * mask", "(x / mask)"),
        ("mask:drop-operand@5:9", "x * mask", "x"),
        ("reduce:max->min@5:27", "x[1:n].max()", "x[1:n].min()"),
        ("argconf:max->argmax@5:27", "x[1:n].max()", "x[1:n].argmax()"),
        ("slice:upper+1@5:27", "x[1:n]", "x[1:n + 1]"),
        ("offset:upper-1@5:27", "x[1:n]", "x[1:n - 1]"),
        ("const:1->0@5:29", "1", "0"),
        ("augassign:Add->Sub@6:4", "y += g(x, n).detach()", "y -= g(x, n).detach()"),
        ("detach:drop@6:9", "g(x, n).detach()", "g(x, n)"),
        ("swap:args-0-1@6:9", "g(x, n)", "g(n, x)"),
        ("neg:drop@7:11", "-y", "y"),
    ]
    for m in mutation.generate(SOURCE):
        mutated = m.apply(SOURCE)
        assert mutated != SOURCE and compile(mutated, "<mutant>", "exec")
        assert mutated[:m.start] + m.original + mutated[m.start + len(m.replacement):] == SOURCE
    assert mutation.generate("x = 1\n")[0].apply("xy = 1\n") is None  # not where it was: not applied


WRITTEN = '''\
def cache_key(a, b, c):
    return {"a": a, "c": c}


def pick(hits, xs, i):
    best = min(xs, key=len)
    for j in range(1, i):
        best = sorted(xs, reverse=True)[0] + hits[-1] + xs[i] + xs.shape[0]
    return hits.argmax() + short_hash([a, b])
'''


def test_generator_lists_the_bugs_people_write(mutation):
    """Issue 56's kinds: first/last, min/argmin confusions and a dropped key=, a dropped fingerprint item (a
    literal inside a key function, a hash call's argument list), +-1 offsets of an index and of a range bound; a
    ``.shape[0]`` is left alone (1-D: the same size)."""
    new = ("firstlast", "argconf", "fingerprint", "offset", "range")
    got = [(m.name, m.original, m.replacement) for m in mutation.generate(WRITTEN) if mutation.kind_of(m.name) in new]
    assert got == [
        ("fingerprint:drop-key-0@2:11", '{"a": a, "c": c}', "({'c': c})"),
        ("fingerprint:drop-key-1@2:11", '{"a": a, "c": c}', "({'a': a})"),
        ("argconf:drop-key@6:11", "min(xs, key=len)", "min(xs)"),
        ("range:stop-1@7:13", "range(1, i)", "range(1, i - 1)"),
        ("range:stop+1@7:13", "range(1, i)", "range(1, i + 1)"),
        ("range:start+1@7:13", "range(1, i)", "range(1 + 1, i)"),
        ("firstlast:0->-1@8:15", "sorted(xs, reverse=True)[0]", "sorted(xs, reverse=True)[-1]"),
        ("firstlast:drop-reverse@8:15", "sorted(xs, reverse=True)", "sorted(xs)"),
        ("firstlast:-1->0@8:45", "hits[-1]", "hits[0]"),
        ("offset:index-1@8:56", "xs[i]", "xs[i - 1]"),
        ("offset:index+1@8:56", "xs[i]", "xs[i + 1]"),
        ("argconf:argmax->max@9:11", "hits.argmax()", "hits.max()"),
        ("fingerprint:drop-item-0.0@9:27", "short_hash([a, b])", "short_hash([b])"),
        ("fingerprint:drop-item-0.1@9:27", "short_hash([a, b])", "short_hash([a])"),
    ]
    assert mutation.kind_of("cmp:Lt->LtE@3:7") == "cmp" and mutation.kind_of("tau-without-bonus") == "hand"


def test_generator_columns_count_characters(mutation):
    """ast columns are UTF-8 bytes; the mutant's offset is in characters (a tau in a string before the site)."""
    (m,) = [m for m in mutation.generate('s = "τ"; t = 3\n') if m.name.startswith("const")]
    assert (m.name, m.apply('s = "τ"; t = 3\n')) == ("const:3->4@1:13", 's = "τ"; t = 4\n')


def test_sample_spreads_over_packages_and_is_seeded(mutation):
    ms = mutation.generated_mutants(REPO)
    packages = {mutation.package_of(p) for p, _ in ms}
    assert packages == set(mutation.PACKAGES)  # callbacks/, target/, commands/ and the top-level modules included
    assert {"target", "kernels", "generation", "commands", "strategy.py", "sampling.py"} <= packages
    a, b = mutation.sample(ms, 20, seed=3), mutation.sample(ms, 20, seed=3)
    assert [(p, m.name) for p, m in a] == [(p, m.name) for p, m in b] and len(a) == 20
    assert {mutation.package_of(p) for p, _ in a} == packages  # 2 per package
    assert [(p, m.name) for p, m in mutation.sample(ms, 20, seed=4)] != [(p, m.name) for p, m in a]


def test_covering_tests_map(mutation):
    assert mutation.covering_tests("draftkit/selection/vocab.py")[-1] == "tests/target/test_frozen.py"
    assert "tests/callbacks/test_time_budget.py" in mutation.covering_tests("callbacks/time_budget.py")
    assert mutation.covering_tests("draftkit/quant/int8.py")[0] == "tests/quant/test_quant_int8.py"
    for path in mutation.package_modules(REPO):
        assert mutation.covering_tests(path), path  # every mutated module has tests
        assert not set(mutation.covering_tests(path)) & set(mutation.NOT_COVERING)


def test_every_hand_mutant_applies_exactly_once(mutation):
    """Each original snippet occurs once in its module, names are unique and every selection names test files
    that exist: when code moves, this names the mutants to repoint."""
    mutants = mutation.all_mutants()
    assert len(mutants) >= 37 and sum(bool(m.issue) for _, m in mutants) == 11
    assert mutation.check_snippets(REPO) == []
    assert len({(path, m.name) for path, m in mutants}) == len(mutants)
    for _, m in mutants:
        assert m.original != m.replacement
        assert all((REPO / t.split("::")[0]).exists() for t in m.tests if t.startswith("tests/")), m.name


def test_equivalent_list_names_current_mutants(mutation):
    """Every entry of tools/mutation_equivalent.txt has a reason and names a generated mutant of this tree."""
    equivalent = mutation.load_equivalent()
    assert all(equivalent.values())
    assert mutation.stale_equivalents(equivalent) == []


@pytest.mark.mutation
@pytest.mark.skipif(not os.environ.get("DRAFTKIT_MUTATION"), reason="opt-in: set DRAFTKIT_MUTATION=1 (~2 min)")
def test_callback_mutant_is_killed_and_rerun_is_cached(tmp_path):
    """A callbacks/ mutant runs in the copy its tests import (the tool checks draftkit.__file__ and
    draftkit.callbacks.__file__) and is killed; the same run again reads the cache and retests nothing."""
    cache = tmp_path / "cache.json"
    cmd = [sys.executable, str(TOOL), "--hand", "-k", "callbacks/", "--cache", str(cache), "--json",
           str(tmp_path / "report.json")]
    env = {**os.environ, "PYTHONPATH": ""}
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["module"], r["status"]) for r in report["results"]] == [("callbacks/acceptance.py", "killed")]
    assert report["retested"] == 1 and report["by_package"]["callbacks"]["score"] == 1.0
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    again = json.loads((tmp_path / "report.json").read_text())
    assert again["retested"] == 0 and [r["status"] for r in again["results"]] == ["killed"]
    assert "baseline" not in second.stdout


@pytest.mark.mutation
@pytest.mark.skipif(not os.environ.get("DRAFTKIT_MUTATION"), reason="opt-in: set DRAFTKIT_MUTATION=1 (a few minutes)")
def test_mutation_score():
    """The hand list in its own process (it must import draftkit only inside its scratch copies)."""
    run = subprocess.run([sys.executable, str(TOOL), "--hand", "--no-cache", "--min-score", "0.95"],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
