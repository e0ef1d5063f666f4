"""Mutation check: do the tests catch one-line bugs in draftkit's core? (issue 17)

Each mutant in :data:`MUTANTS` is one exact snippet of a module replaced by a plausible bug. The check copies
the repository into a temporary directory (never touching the working tree), then for every mutant writes
the mutated module there, runs that mutant's pytest selection, and restores the module. A mutant is
*killed* when its selection fails (pytest exit status 1) or hangs past the timeout; it *survives* when the
selection passes or selects nothing (an older tree without the test). Each selection is first run on the
unmutated copy: one that fails there is reported as broken and its mutants count as not killed. The score
is killed / applied; a mutant whose snippet is not in the tree (``--rev`` of an older commit) is listed as
not applied and left out of it.

Usage (from the repository root, in the project's environment):
    python benchmarks/mutation_check.py                  # all mutants on the working tree (~6 min, 2 busy cores)
    python benchmarks/mutation_check.py --rev 7b3ee2e    # on a committed tree (e.g. the tests before a change)
    python benchmarks/mutation_check.py -k speculative   # mutants whose module or name contains a word
    python benchmarks/mutation_check.py --list           # print the list and check every snippet matches once

Speed: the check imports torch, transformers and Lightning once and forks one pytest run per mutant (each
run imports the copy's draftkit afresh), so a mutant costs its tests, ~4-7 s on 2 loaded cores.

Updating the list: when code moves, repoint the module key (and the selection) of its mutants; ``--list``
and ``tests/test_mutation_check.py`` fail naming every snippet that no longer occurs exactly once.
The opt-in test ``DRAFTKIT_MUTATION=1 pytest -m mutation`` runs the whole check and needs a score >= 95 %.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    """One one-line bug.

    Attributes:
        name: short id, unique within its module.
        original: exact snippet of the module (must occur exactly once).
        replacement: what the snippet becomes.
        tests: pytest arguments of the selection that must fail (paths, ``-k`` expressions).
        issue: ``17.n`` for the survivors listed in issue 17 (before its tests), else "".
    """

    name: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    issue: str = ""


def M(name: str, original: str, replacement: str, *tests: str, issue: str = "") -> Mutant:
    return Mutant(name, original, replacement, tests, issue)


MODULE = "tests/models/test_eagle3_module.py"
STUBS = "tests/decoding/test_speculative_stubs.py"
TINY = "tests/decoding/test_speculative_tiny.py"
EVALUATE = "tests/decoding/test_evaluate.py"
CHAT = "tests/data/test_chat.py"
ROUNDTRIP = "tests/export/test_export_roundtrip.py"
METRICS = "tests/decoding/test_decoding_metrics.py"

# module path -> its mutants; each selection is the few tests that guard the line (seconds each)
MUTANTS: dict[str, list[Mutant]] = {
    "draftkit/models/eagle3.py": [
        M("acc-one-row-early", "teacher_argmax[teacher], w.reshape(-1)", "teacher_argmax[(teacher - 1).clamp_min(0)], w.reshape(-1)",
          MODULE, "-k", "accuracy", issue="17.1"),
        M("acc-counts-mismatches", "correct = (logits.argmax(-1) == teacher_argmax)",
          "correct = (logits.argmax(-1) != teacher_argmax)", MODULE, "-k", "soft_ce or accuracy", issue="17.2"),
        M("entropy-key-offset", "key_offset=-1, downweight=cfg.downweight", "key_offset=1, downweight=cfg.downweight",
          MODULE, "-k", "entropy", issue="17.3"),
        M("lr-constant-after-warmup",
          "return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress))",
          "return 1.0", MODULE, "-k", "lr", issue="17.4"),
        M("init-from-target-ignored", "if self.hparams.init_from_target:", "if False:", MODULE, "-k", "init_from_target",
          issue="17.11"),
        M("ttt-ids-shift", "ids = _shift(input_ids, 1 + step)", "ids = _shift(input_ids, step)", MODULE, "-k", "ttt"),
        M("loss-mask-shift", "weight = _shift(weights, 2 + step)", "weight = _shift(weights, 1 + step)",
          MODULE, "-k", "ttt"),
        M("in-draft-shift", "* _shift(in_draft, 1 + step)", "* _shift(in_draft, 2 + step)", MODULE, "-k", "ttt"),
        M("ttt-decay-power", "(self.ttt.decay ** k) * loss_sum", "(self.ttt.decay ** (k + 1)) * loss_sum",
          MODULE, "-k", "reference"),
        M("ttt-positions", "positions + k, ttt_cache", "positions, ttt_cache", MODULE, "-k", "reference"),
        M("soft-ce-mean", "(teacher_probs * logits).sum(-1)", "(teacher_probs * logits).mean(-1)", MODULE,
          "-k", "reference or soft_ce"),
        M("tau-sim-sum", "        total += prod\n", "        total += a\n", MODULE, "-k", "tau_sim"),
    ],
    "draftkit/heads/eagle3_llama.py": [
        M("attention-input-order", "u = torch.cat([self.input_layernorm(emb), g], dim=-1)",
          "u = torch.cat([g, self.input_layernorm(emb)], dim=-1)", ROUNDTRIP, "-k", "independent_reference"),
        M("residual-variant-swapped", "residual = g if self.norm_before_residual else feature",
          "residual = feature if self.norm_before_residual else g", ROUNDTRIP, "-k", "independent_reference"),
        M("logits-without-norm", "return self.lm_head(self.norm(h))", "return self.lm_head(h)",
          ROUNDTRIP, "-k", "independent_reference"),
    ],
    "draftkit/selection/vocab.py": [
        M("d2t-absolute-ids", "d2t = used - torch.arange(used.numel())", "d2t = used",
          "tests/selection/test_vocab_layers.py", "-k", "d2t"),
    ],
    "draftkit/data/chat.py": [
        M("truncation-keeps-mask", "ids, mask = ids[:max_length], mask[:max_length]", "ids, mask = ids[:max_length], mask",
          CHAT, "-k", "truncation", issue="17.5"),
        M("mask-span-trailing-whitespace", "spans.append((len(prefix), len(upto.rstrip())))",
          "spans.append((len(prefix), len(upto)))", CHAT, "-k", "loss_mask"),
    ],
    "draftkit/data/datamodule.py": [
        M("cache-key-without-code", "tokenization_fingerprint(), self._data_fingerprint(path)",
          "self._data_fingerprint(path)", CHAT, "-k", "cache_key"),
    ],
    "draftkit/heads/checkpoint.py": [
        M("t2d-without-d2t-offset", "ids = torch.arange(vm.numel()) + vm", "ids = torch.arange(vm.numel())",
          ROUNDTRIP, "-k", "t2d", issue="17.6"),
    ],
    "draftkit/export/sglang.py": [
        M("sglang-ids-unshifted", "if rule == PLUS_ONE:\n        return [i - 1 for i in ids]",
          "if rule == PLUS_ONE:\n        return ids", "tests/export/test_layer_ids.py", "-k", "worked_examples"),
    ],
    "draftkit/export/trtllm.py": [
        M("trtllm-ids-unshifted", "else [i - 1 for i in ids]", "else ids", "tests/export/test_layer_ids.py",
          "-k", "worked_examples"),
    ],
    "draftkit/decoding/verify.py": [
        M("kl-next-target-row", "distribution_metrics(logits[:kd], draft.logits",
          "distribution_metrics(logits[1:kd + 1], draft.logits",
          STUBS, "-k", "kl", issue="17.7"),
        M("bonus-from-last-draft-row", "return a, int(sample_from_probs(target_probs[k], generator))",
          "return a, int(sample_from_probs(target_probs[k - 1], generator))", STUBS, "-k", "bonus", issue="17.10"),
        M("greedy-verify-not-prefix", "a = int((draft_ids == best[:k]).int().cumprod(0).sum()) if k else 0",
          "a = int((draft_ids == best[:k]).int().sum()) if k else 0", STUBS, "-k", "greedy_verify"),
        M("greedy-verify-next-row", "return a, int(best[a])", "return a, int(best[max(a - 1, 0)])",
          STUBS, "-k", "greedy_verify"),
        M("rejection-accept-ignores-q", "accept = u * q < p", "accept = u < p", STUBS, "-k", "rejection_sampling"),
        M("rejection-residual-is-p", "residual = (target_probs[a] - draft_probs[a]).clamp_min(0)",
          "residual = target_probs[a].clone()", STUBS, "-k", "rejection_sampling"),
        M("target-cache-no-rollback", "target.crop(L + a + 1)", "target.crop(L + kd + 1)", TINY, "-k", "controlled"),
        M("drafter-commit-rows", "drafter.commit(aux[:a + 1])", "drafter.commit(aux[:a])", STUBS, "-k", "exact_tau"),
    ],
    "draftkit/decoding/drafters.py": [
        M("draft-chain-position", "z, h = self._step(t.view(1), h, L + j)",
          "z, h = self._step(t.view(1), h, L + j + 1)", TINY, "-k", "drafter_chain"),
        M("drafter-ignores-d2t", "torch.arange(cfg.draft_vocab_size, device=self.device) + head.d2t",
          "torch.arange(cfg.draft_vocab_size, device=self.device)", TINY, "-k", "d2t"),
    ],
    "draftkit/decoding/metrics.py": [
        M("tau-without-bonus", "return sum(a + 1 for a in accepted) / len(accepted)",
          "return sum(a for a in accepted) / len(accepted)", METRICS),
        M("alpha-strict", "sum(a >= i for a in accepted)", "sum(a > i for a in accepted)", METRICS),
        M("kl-reversed", "return (log_p.exp() * (log_p - log_q)).sum(-1)", "return (log_q.exp() * (log_q - log_p)).sum(-1)",
          METRICS),
    ],
    "draftkit/decoding/harness.py": [
        M("first-diff-ignores-length", "return None if len(a) == len(b) else min(len(a), len(b))", "return None",
          EVALUATE, "-k", "first_diff", issue="17.8"),
        M("greedy-equal-always", "equal += diff is None", "equal += 1", EVALUATE, "-k", "greedy_equal", issue="17.9"),
    ],
}


def all_mutants() -> list[tuple[str, Mutant]]:
    return [(path, m) for path, ms in MUTANTS.items() for m in ms]


def check_snippets(root: Path) -> list[str]:
    """Problems with the list against the tree at ``root``: snippets that do not occur exactly once."""
    problems = []
    for path, m in all_mutants():
        f = root / path
        n = f.read_text().count(m.original) if f.is_file() else -1
        if n != 1:
            where = "module missing" if n < 0 else f"found {n} times"
            problems.append(f"{path} {m.name}: original snippet {m.original!r}: {where}")
    return problems


def _copy_tree(dest: Path, rev: str | None) -> None:
    """Copy the working tree's tracked and unignored files (or a committed tree) to ``dest``."""
    if rev:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


PRELOAD = ("torch", "transformers", "lightning.pytorch", "datasets", "torchmetrics", "safetensors.torch", "pytest")
"""Third-party libraries imported once by the check and shared by every forked pytest run (their import is
most of a short run's cost); draftkit itself is never imported by the parent, so each run imports the copy."""


def _preload() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in PRELOAD:
        importlib.import_module(name)
    from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: F401  (transformers imports lazily)

    if any(name == "draftkit" or name.startswith("draftkit.") for name in sys.modules):
        raise RuntimeError("draftkit was imported by the check itself; forked runs would not see the mutant")


def _forked(root: Path, timeout: float, work) -> tuple[int | None, float]:
    """Run ``work()`` (returns an exit status) in a forked child with cwd and sys.path[0] = ``root``, output
    discarded; returns (status or None on timeout, seconds)."""
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        rc = 3
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.chdir(root)
            sys.path.insert(0, str(root))
            sys.dont_write_bytecode = True  # a mutant restored within the same second must never hit a stale .pyc
            rc = int(work())
        finally:
            os._exit(rc)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, time.perf_counter() - t0
        time.sleep(0.05)


def _pytest(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, float]:
    """(pytest exit status or None on timeout, seconds) of the selection run in ``root`` on one thread."""
    import pytest

    args = ["-q", "-x", "-p", "no:cacheprovider", "-m", "not slow and not gpu", *tests]
    return _forked(root, timeout, lambda: pytest.main(args))


def _imports_from(root: Path) -> bool:
    def work() -> int:
        import draftkit

        return 0 if draftkit.__file__.startswith(str(root)) else 1

    return _forked(root, 120.0, work)[0] == 0


def _say(line: str) -> None:
    print(line, flush=True)


def run(mutants: list[tuple[str, Mutant]], rev: str | None = None, timeout: float = 300.0, out=_say) -> dict:
    """Run the check; returns ``{"killed": n, "total": n, "score": float, "results": [...]}``.

    Raises:
        RuntimeError: if a run in the scratch copy would import draftkit from somewhere else.
    """
    with tempfile.TemporaryDirectory(prefix="draftkit-mutants-") as tmp:
        root = Path(tmp)
        _copy_tree(root, rev)
        _preload()
        if not _imports_from(root):
            raise RuntimeError(f"a run in the scratch copy {root} imports draftkit from elsewhere")
        for problem in check_snippets(root):
            out(f"list: {problem}")
        broken = {}
        for tests in dict.fromkeys(m.tests for _, m in mutants):
            rc, _ = _pytest(root, tests, timeout)
            if rc not in (0, 5):  # 5: nothing selected on this tree
                broken[tests] = rc
                out(f"broken selection (exit {rc} without a mutant): {' '.join(tests)}")
        results = []
        for path, m in mutants:
            f = root / path
            text = f.read_text() if f.is_file() else ""
            if text.count(m.original) != 1:
                status, seconds = "not applied", 0.0
            elif m.tests in broken:
                status, seconds = "broken selection", 0.0
            else:
                f.write_text(text.replace(m.original, m.replacement))
                try:
                    rc, seconds = _pytest(root, m.tests, timeout)
                finally:
                    f.write_text(text)
                status = {None: "killed (timeout)", 1: "killed", 0: "survived", 5: "survived (no test selected)"}.get(
                    rc, f"survived (pytest exit {rc})")
            results.append({"module": path, "name": m.name, "issue": m.issue, "status": status, "seconds": seconds})
            tag = f" [issue {m.issue}]" if m.issue else ""
            out(f"{status:<28s} {path}::{m.name}{tag} ({seconds:.1f} s)")
    applied = [r for r in results if r["status"] != "not applied"]
    killed = sum(r["status"].startswith("killed") for r in applied)
    score = killed / len(applied) if applied else 0.0
    skipped = f"; {len(results) - len(applied)} not applied (snippet not in this tree)" if len(applied) < len(results) else ""
    out(f"mutation score: {killed}/{len(applied)} killed ({100 * score:.1f} %){skipped}")
    return {"killed": killed, "total": len(applied), "score": score, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", help="run on this committed tree instead of the working tree")
    p.add_argument("-k", dest="keyword", help="only mutants whose module path or name contains this")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (a hang counts as killed)")
    p.add_argument("--list", action="store_true", help="print the mutants and check their snippets, run nothing")
    p.add_argument("--min-score", type=float, default=0.0, help="exit 1 below this score (0..1)")
    args = p.parse_args(argv)
    mutants = [(path, m) for path, m in all_mutants() if not args.keyword or args.keyword in f"{path}::{m.name}"]
    if args.list:
        for path, m in mutants:
            print(f"{path}::{m.name}{' [issue ' + m.issue + ']' if m.issue else ''}  ->  {' '.join(m.tests)}")
        problems = check_snippets(REPO)
        for problem in problems:
            print(f"list: {problem}")
        return 1 if problems else 0
    report = run(mutants, args.rev, args.timeout)
    return 0 if report["score"] >= args.min_score else 1


if __name__ == "__main__":
    raise SystemExit(main())
