"""Mutation testing of draftkit's core: do the tests catch one-line bugs they were not written against? (issues 17, 36)

Two sources of mutants, one runner:

- **generated** (the default): :func:`generate` walks a module's ``ast`` and writes one mutant per operator site
  (:data:`OPERATORS`): comparison boundary flips (``<``/``<=``, ``==``/``!=``, ``in``/``not in``), arithmetic swaps
  (``+``/``-``, ``*``/``/``, ``&``/``|``, augmented assignments too), ``and``/``or``, dropped ``not`` and unary minus,
  reduction swaps (``sum``/``mean``, ``max``/``min``, ``argmax``/``argmin``, ``any``/``all``), constants
  (0 -> 1, 1 -> 0, n -> n + 1, ``True``/``False``, defaults included), a dropped ``.detach()``, dropped masks
  (``x * mask`` -> ``x``, ``x[mask]`` -> ``x``, ``masked_fill`` dropped), the first two positional arguments of a
  call swapped, and off-by-one slice bounds (``a[i:j]`` -> ``a[i + 1:j]``, ``a[i:j + 1]``). Error messages,
  log calls, f-strings and annotations are not mutated. Issue 56 adds the kinds people write: first/last
  (``[0]``/``[-1]``, a dropped ``reverse=``), ``max``/``argmax`` and ``min``/``argmin`` confusions and a dropped
  ``key=``, one item dropped from a fingerprint or cache key, +-1 offsets of an index or slice bound and of a
  ``range`` bound. Over :data:`PACKAGES` (``models/`` ... ``callbacks/``, ``target/``, ``commands/`` and
  ``kernels/``, ``generation/``, ``strategy.py``, ``sampling.py``); scores per module, package and kind (``--kinds`` picks some).
- **hand** (``--hand``): the one-line mutants of issue 17 in :data:`MUTANTS`, each with its own selection.

Each mutant runs only the tests that cover its file (:func:`covering_tests`: the declared :data:`TESTS` map, else
every test file that imports the module by its dotted name or is named after it), with ``-x``, on one thread, in
a scratch copy of the repository that the runs import (``draftkit`` *and* ``draftkit.callbacks``, which the
editable install maps to ``callbacks/``; the copy links ``draftkit/callbacks`` to its own ``callbacks/`` and the
check refuses to run unless both ``__file__`` lie in it). The working tree is never touched. Every selection
first runs unmutated (its *baseline*); a selection that fails there is reported broken and its mutants are not
counted. A mutant is *killed* when its selection fails (pytest exit 1, or 2-3 when the mutant breaks collection)
or runs past ``max(--timeout, 4 x baseline)``; it *survives* when the selection passes; it is *not covered* when
no test covers its file. Mutants listed in ``tools/mutation_equivalent.txt`` (one line each: ``path::kind:detail``,
the backquoted source line and why no test can tell it from the original) are reported as equivalent and left
out of the score.

Cache: results are kept in a JSON file (``--cache``, default ``tools/mutation_cache.json``) under the key
(sha256 of the unmutated file, mutant name, sha256 of the covering tests' files and arguments), baselines under
(file hash, tests hash); a rerun retests only the mutants whose file or covering tests changed. ``--no-cache``
ignores it.

Usage (repository root, the project's environment; ``tools/README.md`` has the worked commands):
    python tools/mutation.py --sample 80 --seed 0       # 80 generated mutants spread over the packages
    python tools/mutation.py -k selection/vocab.py      # every generated mutant of matching modules
    python tools/mutation.py --list --sample 20         # print mutants and their selections, run nothing
    python tools/mutation.py --hand                     # issue 17's hand list (~6 min, 2 busy cores)
    python tools/mutation.py --hand --rev 7b3ee2e       # on a committed tree (e.g. the tests before a change)

The score is killed / (killed + survived), per module, per package and overall. Speed: torch, transformers and
Lightning are imported once and every pytest run is forked from that process (each imports the copy's draftkit
afresh), so a mutant costs its selection: seconds when killed early (``-x``), the whole selection when it survives.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import importlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "heads", "selection", "data", "decoding", "export", "analysis", "quant", "dual_precision",
            "callbacks", "target", "kernels", "generation", "commands", "strategy.py", "sampling.py")
"""What users rely on: ``draftkit/<package>/*.py``, ``callbacks/*.py`` (installed as ``draftkit.callbacks``) and the
top-level modules named with their ``.py`` (``draftkit/sampling.py``: its own package in the scores)."""
CACHE = REPO / "tools" / "mutation_cache.json"
EQUIVALENT = REPO / "tools" / "mutation_equivalent.txt"


@dataclass(frozen=True)
class Mutant:
    """One one-line bug.

    Attributes:
        name: id, unique within its module (generated: ``kind:detail@line:col``).
        original: the exact source text that changes (hand mutants: must occur exactly once in the module).
        replacement: what it becomes.
        tests: pytest arguments of the selection that must fail (paths, ``-k`` expressions); empty for a
            generated mutant (its module's :func:`covering_tests`).
        issue: ``17.n`` for the survivors listed in issue 17 (before its tests), else "".
        start: character offset of ``original`` in the module (generated mutants), -1 for "find it".
    """

    name: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    issue: str = ""
    start: int = -1

    def apply(self, text: str) -> str | None:
        """The mutated module text, or None when ``original`` is not where (or not once) it should be."""
        if self.start >= 0:
            end = self.start + len(self.original)
            return text[:self.start] + self.replacement + text[end:] if text[self.start:end] == self.original else None
        return text.replace(self.original, self.replacement) if text.count(self.original) == 1 else None


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
        M("entropy-key-offset", "key_offset=-1, downweight=cfg.downweight", "key_offset=1, downweight=cfg.downweight",
          MODULE, "-k", "entropy", issue="17.3"),
        M("ttt-decay-power", "(self.ttt.decay ** k) * loss_sum", "(self.ttt.decay ** (k + 1)) * loss_sum",
          MODULE, "-k", "reference"),
        M("ttt-positions", "positions + k, ttt_cache", "positions, ttt_cache", MODULE, "-k", "reference"),
    ],
    "draftkit/models/start.py": [
        M("init-from-target-ignored", "if hp.init_from_target:", "if False:", MODULE, "-k", "init_from_target",
          issue="17.11"),
    ],
    "draftkit/models/ttt.py": [
        M("acc-counts-mismatches", "correct = (logits.argmax(-1) == teacher_argmax)",
          "correct = (logits.argmax(-1) != teacher_argmax)", MODULE, "-k", "soft_ce or accuracy", issue="17.2"),
        M("ttt-ids-shift", "ids = shift(input_ids, 1 + step)", "ids = shift(input_ids, step)", MODULE, "-k", "ttt"),
        M("loss-mask-shift", "weight = shift(weights, 2 + step)", "weight = shift(weights, 1 + step)",
          MODULE, "-k", "ttt"),
        M("in-draft-shift", "* shift(in_draft, 1 + step)", "* shift(in_draft, 2 + step)", MODULE, "-k", "ttt"),
        M("soft-ce-mean", "(teacher_probs * logits).sum(-1)", "(teacher_probs * logits).mean(-1)", MODULE,
          "-k", "reference or soft_ce"),
        M("tau-sim-sum", "        total += prod\n", "        total += a\n", MODULE, "-k", "tau_sim"),
    ],
    "draftkit/models/schedule.py": [
        M("lr-constant-after-warmup",
          "return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))",
          "return 1.0", MODULE, "-k", "lr", issue="17.4"),
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
        M("cache-key-without-code", "tokenization_fingerprint(), self._source",
          "self._source", CHAT, "-k", "cache_key"),
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
        M("greedy-verify-not-prefix", "    while a < k and drafts[a] == best[a]:\n        a += 1",
          "    a = sum(d == b for d, b in zip(drafts, best))", STUBS, "-k", "greedy_verify"),
        M("greedy-verify-next-row", "return a, best[a]", "return a, best[max(a - 1, 0)]",
          STUBS, "-k", "greedy_verify"),
        M("rejection-accept-ignores-q", "accept = u * q < p", "accept = u < p", STUBS, "-k", "rejection_sampling"),
        M("rejection-residual-is-p", "residual = (target_probs[a] - draft_probs[a]).clamp_min(0)",
          "residual = target_probs[a].clone()", STUBS, "-k", "rejection_sampling"),
        M("target-cache-no-rollback", "target.crop(L + a + 1)", "target.crop(L + kd + 1)", TINY, "-k", "controlled"),
        M("drafter-commit-rows", "drafter.commit(aux[:a + 1])", "drafter.commit(aux[:a])", STUBS, "-k", "exact_tau"),
    ],
    "draftkit/decoding/drafters.py": [
        M("draft-chain-position", "z, h = self._step(t, h, L + j)",
          "z, h = self._step(t, h, L + j + 1)", TINY, "-k", "drafter_chain"),
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
    "callbacks/acceptance.py": [  # issue 36: callbacks/ was never mutated (the copy imported the installed one)
        M("measure-never", "if self._validations % self.every_n_validations == 0:",
          "if self._validations % self.every_n_validations == 1:", "tests/callbacks/test_acceptance.py",
          "-k", "every_n_validations"),
    ],
    "draftkit/decoding/harness.py": [
        M("first-diff-ignores-length", "return None if len(a) == len(b) else min(len(a), len(b))", "return None",
          EVALUATE, "-k", "first_diff", issue="17.8"),
        M("greedy-equal-always", "equal += diff is None", "equal += 1", EVALUATE, "-k", "greedy_equal", issue="17.9"),
    ],
}



# ----------------------------------------------------------------------------------------------------------------
# generated mutants

CMP_FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
BIN_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
             ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}
REDUCTIONS = {"sum": "mean", "mean": "sum", "max": "min", "min": "max", "amax": "amin", "amin": "amax",
              "argmax": "argmin", "argmin": "argmax", "any": "all", "all": "any"}
ARG_CONFUSIONS = {"max": "argmax", "argmax": "max", "min": "argmin", "argmin": "min"}
"""A value taken for its index or the reverse (tensor methods and ``torch.*`` calls)."""
FINGERPRINT = re.compile(r"fingerprint|hash|sha256|digest|identity|(^|_)key$", re.IGNORECASE)
"""Calls and functions whose arguments or literals are a cache key: each item dropped in turn is a mutant."""
NO_SWAP = {"isinstance", "issubclass", "hasattr", "getattr", "setattr", "super", "print", "format", "join"}
LOG_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "print", "write"}
OPERATORS = ("cmp", "binop", "augassign", "boolop", "not", "neg", "reduce", "const", "detach", "mask", "swap",
             "slice", "firstlast", "argconf", "fingerprint", "offset", "range")
"""Mutation kinds, in the order :func:`generate` lists a site's mutants. The last five are the bugs people write
(issue 56): ``firstlast`` (index ``0`` <-> ``-1``, a dropped ``reverse=``), ``argconf`` (``max`` <-> ``argmax``,
``min`` <-> ``argmin``, a dropped ``key=`` of ``min``/``max``/``sorted``), ``fingerprint`` (one argument of a
hash/key call, or one item of a literal inside a fingerprint function, dropped), ``offset`` (a scalar index or a
slice bound moved by -1/+1) and ``range`` (a ``range`` bound moved by one); ``cmp`` holds the ``<``/``<=`` boundary
swaps."""


def _op(node) -> str:
    return type(node).__name__


class _Sites:
    """Source offsets of ast nodes: ``span(node)`` -> (start, end) character offsets (ast columns are UTF-8 bytes)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def _offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode())

    def span(self, node) -> tuple[int, int]:
        return self._offset(node.lineno, node.col_offset), self._offset(node.end_lineno, node.end_col_offset)


def _skipped(tree: ast.AST) -> set[int]:
    """ids of nodes that are not mutated: raise statements (error messages), log/print calls, f-strings,
    annotations, docstrings and ``if TYPE_CHECKING``/``__name__`` blocks."""
    skip: set[int] = set()

    def mark(node) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.JoinedStr)):
            mark(node)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in LOG_CALLS:
                mark(node)
        elif isinstance(node, ast.arg):
            mark(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
        elif isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) or (
                isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)):
            mark(node)
    return skip


def _variants(node) -> list[tuple[str, ast.AST]]:
    """(kind:detail, mutated copy) for one node, in :data:`OPERATORS` order."""
    out = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in CMP_FLIPS:
                new = copy.deepcopy(node)
                new.ops[i] = CMP_FLIPS[type(op)]()
                out.append((f"cmp:{_op(op)}->{_op(new.ops[i])}", new))
    elif isinstance(node, ast.BinOp):
        if type(node.op) in BIN_SWAPS:
            new = copy.deepcopy(node)
            new.op = BIN_SWAPS[type(node.op)]()
            out.append((f"binop:{_op(node.op)}->{_op(new.op)}", new))
        if isinstance(node.op, (ast.Mult, ast.BitAnd)):
            for keep, drop in ((node.left, node.right), (node.right, node.left)):
                if "mask" in ast.unparse(drop).lower():
                    out.append(("mask:drop-operand", copy.deepcopy(keep)))
    elif isinstance(node, ast.AugAssign) and type(node.op) in BIN_SWAPS:
        new = copy.deepcopy(node)
        new.op = BIN_SWAPS[type(node.op)]()
        out.append((f"augassign:{_op(node.op)}->{_op(new.op)}", new))
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append((f"boolop:{_op(node.op)}->{_op(new.op)}", new))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("not:drop", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and not isinstance(node.operand, ast.Constant):
        out.append(("neg:drop", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in REDUCTIONS and (isinstance(f, ast.Attribute) or name in ("max", "min", "any", "all")):
            new = copy.deepcopy(node)
            if isinstance(f, ast.Attribute):
                new.func.attr = REDUCTIONS[name]
            else:
                new.func.id = REDUCTIONS[name]
            out.append((f"reduce:{name}->{REDUCTIONS[name]}", new))
        if isinstance(f, ast.Attribute) and name == "detach" and not node.args:
            out.append(("detach:drop", copy.deepcopy(f.value)))
        if isinstance(f, ast.Attribute) and name in ("masked_fill", "masked_fill_"):
            out.append(("mask:drop-masked_fill", copy.deepcopy(f.value)))
        args = node.args
        if (name not in NO_SWAP and len(args) >= 2 and not any(isinstance(a, ast.Starred) for a in args[:2])
                and ast.dump(args[0]) != ast.dump(args[1])):
            new = copy.deepcopy(node)
            new.args[0], new.args[1] = new.args[1], new.args[0]
            out.append(("swap:args-0-1", new))
    elif isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)) and node.value is not None:
        v = node.value
        if isinstance(v, bool):
            new_v = not v
        elif isinstance(v, (int, float)) and not isinstance(v, complex):
            new_v = 1 if v == 0 else 0 if v == 1 else v + 1
            new_v = type(v)(new_v)
        else:
            return out
        out.append((f"const:{v!r}->{new_v!r}", ast.Constant(new_v)))
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        s = node.slice
        if isinstance(s, ast.Name) and "mask" in s.id.lower():
            out.append(("mask:drop-index", copy.deepcopy(node.value)))
        if isinstance(s, ast.Slice):
            for bound in ("lower", "upper"):
                b = getattr(s, bound)
                if b is not None and not isinstance(b, ast.Constant):
                    new = copy.deepcopy(node)
                    setattr(new.slice, bound, ast.BinOp(getattr(new.slice, bound), ast.Add(), ast.Constant(1)))
                    out.append((f"slice:{bound}+1", new))
    return out


def _name(f) -> str:
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _plus(node, k: int):
    """``node + k`` (``node - 1`` for k = -1) as a new expression."""
    return ast.BinOp(copy.deepcopy(node), ast.Add() if k > 0 else ast.Sub(), ast.Constant(abs(k)))


def _drop_each(node, field: str, kind: str) -> list[tuple[str, ast.AST]]:
    """One mutant per item of ``node.<field>`` (a list of >= 2 items, none starred) with that item left out."""
    items = getattr(node, field)
    if len(items) < 2 or any(isinstance(a, ast.Starred) for a in items):
        return []
    out = []
    for i in range(len(items)):
        new = copy.deepcopy(node)
        del getattr(new, field)[i]
        if isinstance(new, ast.Dict):
            del new.values[i]
        out.append((f"{kind}-{i}", new))
    return out


def _variants_written(node, in_fingerprint: bool) -> list[tuple[str, ast.AST]]:
    """The issue 56 kinds (:data:`OPERATORS`' last five) for one node; ``in_fingerprint``: the node lies in a
    function whose name matches :data:`FINGERPRINT`."""
    out = []
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        s = node.slice
        first = isinstance(s, ast.Constant) and s.value == 0 and type(s.value) is int
        last = isinstance(s, ast.UnaryOp) and isinstance(s.op, ast.USub) and isinstance(s.operand, ast.Constant) \
            and s.operand.value == 1
        shape = isinstance(node.value, ast.Attribute) and node.value.attr == "shape"  # 1-D: the same size
        if (first or last) and not shape:
            new = copy.deepcopy(node)
            new.slice = ast.UnaryOp(ast.USub(), ast.Constant(1)) if first else ast.Constant(0)
            out.append((f"firstlast:{'0->-1' if first else '-1->0'}", new))
        elif isinstance(s, (ast.Name, ast.BinOp, ast.Attribute)) and "mask" not in ast.unparse(s).lower():
            for k in (-1, 1):
                new = copy.deepcopy(node)
                new.slice = _plus(s, k)
                out.append((f"offset:index{k:+d}", new))
        elif isinstance(s, ast.Slice):
            for bound in ("lower", "upper"):
                b = getattr(s, bound)
                if b is not None and not isinstance(b, ast.Constant):
                    new = copy.deepcopy(node)
                    setattr(new.slice, bound, _plus(b, -1))
                    out.append((f"offset:{bound}-1", new))
    elif isinstance(node, ast.Call):
        name = _name(node.func)
        if isinstance(node.func, ast.Attribute) and name in ARG_CONFUSIONS:
            new = copy.deepcopy(node)
            new.func.attr = ARG_CONFUSIONS[name]
            out.append((f"argconf:{name}->{ARG_CONFUSIONS[name]}", new))
        for kw_name, kind in (("key", "argconf:drop-key"), ("reverse", "firstlast:drop-reverse")):
            if name in ("min", "max", "sorted", "sort") and any(k.arg == kw_name for k in node.keywords):
                new = copy.deepcopy(node)
                new.keywords = [k for k in new.keywords if k.arg != kw_name]
                out.append((kind, new))
        if FINGERPRINT.search(name):
            out += [(f"fingerprint:drop-arg-{i}", n) for i, n in
                    ((int(k.rsplit("-", 1)[1]), n) for k, n in _drop_each(node, "args", "x"))]
            for j, arg in enumerate(node.args if not in_fingerprint else ()):  # else: the literal's own mutants
                if isinstance(arg, ast.Call) and _name(arg.func) in ("list", "tuple") and arg.args:
                    arg = arg.args[0]
                if isinstance(arg, (ast.List, ast.Tuple)):
                    for k, new_arg in _drop_each(arg, "elts", "x"):
                        new = copy.deepcopy(node)
                        new.args[j] = new_arg if node.args[j] is arg else ast.Call(
                            copy.deepcopy(node.args[j].func), [new_arg], [])
                        out.append((f"fingerprint:drop-item-{j}.{k.rsplit('-', 1)[1]}", new))
        if name == "range" and isinstance(node.func, ast.Name) and node.args and not any(
                isinstance(a, ast.Starred) for a in node.args):
            stop = 0 if len(node.args) == 1 else 1
            for k in (-1, 1):
                new = copy.deepcopy(node)
                new.args[stop] = _plus(node.args[stop], k)
                out.append((f"range:stop{k:+d}", new))
            if len(node.args) >= 2:
                new = copy.deepcopy(node)
                new.args[0] = _plus(node.args[0], 1)
                out.append(("range:start+1", new))
    elif in_fingerprint and isinstance(node, (ast.Tuple, ast.List)) and isinstance(node.ctx, ast.Load):
        out += [(f"fingerprint:drop-item-{k.rsplit('-', 1)[1]}", n) for k, n in _drop_each(node, "elts", "x")]
    elif in_fingerprint and isinstance(node, ast.Dict) and None not in node.keys:
        out += [(f"fingerprint:drop-key-{k.rsplit('-', 1)[1]}", n) for k, n in _drop_each(node, "keys", "x")]
    return out


def _in_fingerprint_functions(tree: ast.AST) -> set[int]:
    """ids of the nodes inside functions named like a fingerprint (:data:`FINGERPRINT`)."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and FINGERPRINT.search(node.name):
            ids.update(id(n) for n in ast.walk(node))
    return ids


def generate(source: str) -> list[Mutant]:
    """Every generated mutant of one module's source, in source order (then :data:`OPERATORS` order per site).

    Each replaces the exact text of one node (``Mutant.original`` at ``Mutant.start``) by ``ast.unparse`` of the
    mutated node, parenthesized when it is an expression; a replacement that does not compile is dropped. Names are ``kind:detail@line:col`` (1-based line, 0-based character column).

    Raises:
        SyntaxError: if ``source`` does not parse.
    """
    tree = ast.parse(source)
    sites, skip = _Sites(source), _skipped(tree)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out, seen = [], set()
    nodes = [n for n in ast.walk(tree) if hasattr(n, "lineno") and id(n) not in skip and id(n) not in docstrings]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
    fingerprinting = _in_fingerprint_functions(tree)
    for node in nodes:
        for kind, new in _variants(node) + _variants_written(node, id(node) in fingerprinting):
            start, end = sites.span(node)
            text = ast.unparse(new)
            if isinstance(node, ast.expr) and not isinstance(new, (ast.Constant, ast.Name, ast.Attribute, ast.Call,
                                                                    ast.Subscript)):
                text = f"({text})"
            try:
                compile(text, "<mutant>", "eval" if isinstance(node, ast.expr) else "exec")
            except SyntaxError:
                continue
            line = source.count("\n", 0, start) + 1
            col = start - (source.rfind("\n", 0, start) + 1)
            name = f"{kind}@{line}:{col}"
            if name in seen:
                continue
            seen.add(name)
            out.append(Mutant(name, source[start:end], text, (), start=start))
    return out


def package_modules(root: Path = REPO) -> list[str]:
    """The mutated modules: ``draftkit/<package>/**/*.py`` for :data:`PACKAGES` and ``callbacks/*.py``, sorted."""
    paths = []
    for package in PACKAGES:
        base = root / "callbacks" if package == "callbacks" else root / "draftkit" / package
        files = [base] if package.endswith(".py") else sorted(base.rglob("*.py"))
        paths += [p.relative_to(root).as_posix() for p in files if p.is_file()]
    return paths


def package_of(path: str) -> str:
    parts = path.split("/")
    return "callbacks" if parts[0] == "callbacks" else parts[1]


ROUNDTRIP_TESTS = ("tests/export/test_layer_ids.py", "tests/export/test_export_roundtrip.py",
                   "tests/export/test_engine_config_fields.py")
TESTS: dict[str, tuple[str, ...]] = {
    "draftkit/models/eagle3.py": ("tests/models/test_eagle3_module.py",),
    "draftkit/models/guards.py": ("tests/models/test_nonfinite.py", "tests/models/test_val_nothing_to_measure.py",
                                  "tests/models/test_tau_sim_coverage.py", "tests/models/test_eagle3_module.py"),
    "draftkit/fit_run.py": ("tests/test_resume_options.py", "tests/test_interrupted_fit.py", "tests/test_fit_setup.py"),
    "draftkit/models/ttt.py": ("tests/models/test_eagle3_module.py", "tests/models/test_ttt_schedule.py"),
    "draftkit/models/schedule.py": ("tests/models/test_eagle3_module.py", "tests/models/test_ttt_schedule.py",
                                    "tests/callbacks/"),
    "draftkit/heads/eagle3_llama.py": ("tests/heads/", "tests/export/test_export_roundtrip.py"),
    "draftkit/data/datamodule.py": ("tests/data/test_chat.py", "tests/data/test_splits.py",
                                    "tests/data/test_data_order.py", "tests/data/test_skips.py"),
    "draftkit/decoding/report.py": ("tests/decoding/test_evaluate.py",),
    "draftkit/sampling.py": ("tests/test_sampling.py", "tests/decoding/test_speculative_stubs.py"),
    "draftkit/export/sglang.py": ROUNDTRIP_TESTS,
    "draftkit/export/trtllm.py": ROUNDTRIP_TESTS,
    "draftkit/export/vllm.py": ROUNDTRIP_TESTS,
    "draftkit/export/speculators.py": ROUNDTRIP_TESTS,
}
"""Declared selections, where the rule of :func:`covering_tests` would run too much or too little."""
NOT_COVERING = ("tests/test_layering.py", "tests/test_docs.py")
"""Tests that name modules without testing what they compute (import rules, documentation)."""


def covering_tests(module: str, root: Path = REPO) -> tuple[str, ...]:
    """The pytest paths that cover ``module`` (a path like ``draftkit/data/chat.py`` or ``callbacks/export.py``):
    :data:`TESTS` if declared, else every ``tests/**/test_*.py`` (but :data:`NOT_COVERING`) that names its dotted
    module (``draftkit.data.chat``; ``draftkit.callbacks.export``) or lies in ``tests/<package>/`` with the module's
    stem as a word of its name (``test_quant_int8.py`` for ``quant/int8.py``), else every test of
    ``tests/<package>/``; empty if none."""
    if module in TESTS:
        return TESTS[module]
    stem = Path(module).stem
    package = package_of(module)
    dotted = f"draftkit.callbacks.{stem}" if package == "callbacks" else module[:-3].replace("/", ".")
    if stem == "__init__":
        dotted = dotted.rsplit(".", 1)[0]
    pattern = re.compile(rf"\b{re.escape(dotted)}\b(?!\.)" if stem == "__init__" else rf"\b{re.escape(dotted)}\b")
    tests = [p for p in sorted((root / "tests").rglob("test_*.py")) if p.relative_to(root).as_posix() not in NOT_COVERING]
    found = [p for p in tests if (p.parent.name == package and stem in p.stem.split("_")) or pattern.search(_text(p))]
    if not found:
        found = [p for p in tests if p.parent.name == package]
    return tuple(p.relative_to(root).as_posix() for p in found)


_TEXTS: dict[Path, str] = {}


def _text(path: Path) -> str:
    if path not in _TEXTS:
        _TEXTS[path] = path.read_text()
    return _TEXTS[path]


def sample(mutants: list[tuple[str, Mutant]], n: int, seed: int, modules: int | None = None) -> list[tuple[str, Mutant]]:
    """``n`` mutants spread evenly over the packages (round robin over each package's seeded shuffle), in
    module order; all of them when ``n`` >= their number. ``modules``: draw from only that many modules per
    package (seeded choice, ``__init__.py`` left out), so that fewer selections need a baseline run."""
    rng = random.Random(seed)
    if modules:
        keep = set()
        for package in sorted({package_of(p) for p, _ in mutants}):
            names = sorted({p for p, _ in mutants if package_of(p) == package and not p.endswith("__init__.py")})
            keep.update(rng.sample(names, min(modules, len(names))))
        mutants = [item for item in mutants if item[0] in keep]
    if n >= len(mutants):
        return mutants
    by_package: dict[str, list] = {}
    for item in mutants:
        by_package.setdefault(package_of(item[0]), []).append(item)
    queues = []
    for package in sorted(by_package):
        items = by_package[package][:]
        rng.shuffle(items)
        queues.append(items)
    chosen = []
    while len(chosen) < n:
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop())
    order = {id(item): i for i, item in enumerate(mutants)}
    return sorted(chosen, key=lambda item: order[id(item)])


def equivalent_key(path: str, m: Mutant, source: str) -> str:
    """The key of a mutant in the equivalent list: ``path::kind:detail `source line` `` (the stripped line where
    the mutant starts; no line number, so edits elsewhere in the module do not unlist it)."""
    start = m.start if m.start >= 0 else max(source.find(m.original), 0)
    line = source[source.rfind("\n", 0, start) + 1:].split("\n", 1)[0].strip()
    return f"{path}::{m.name.split('@')[0]} `{line}`"


def load_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    """``{equivalent_key: reason}`` from the equivalent-mutant list: lines ``path::kind:detail `source line` reason``
    (``#`` comments and blank lines ignored); every generated mutant of that kind starting on a line with that
    text in that module is equivalent.

    Raises:
        ValueError: naming the line, if it has no backquoted original or no reason.
    """
    out = {}
    if not path.is_file():
        return out
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"(\S+::\S+) (`[^`]+`) (.+)", line)
        if not match:
            raise ValueError(f"{path}:{i}: write 'path::kind:detail `source line` why it is equivalent'")
        out[f"{match[1]} {match[2]}"] = match[3].strip()
    return out


# ----------------------------------------------------------------------------------------------------------------
# running

def all_mutants() -> list[tuple[str, Mutant]]:
    """The hand list, as (module path, mutant)."""
    return [(path, m) for path, ms in MUTANTS.items() for m in ms]


def generated_mutants(root: Path = REPO, keyword: str | None = None) -> list[tuple[str, Mutant]]:
    """Every generated mutant of :func:`package_modules` (those whose path contains ``keyword``, if given)."""
    return [(path, m) for path in package_modules(root) if not keyword or keyword in path
            for m in generate((root / path).read_text())]


def check_snippets(root: Path) -> list[str]:
    """Problems with the hand list against the tree at ``root``: snippets that do not occur exactly once."""
    problems = []
    for path, m in all_mutants():
        f = root / path
        n = f.read_text().count(m.original) if f.is_file() else -1
        if n != 1:
            where = "module missing" if n < 0 else f"found {n} times"
            problems.append(f"{path} {m.name}: original snippet {m.original!r}: {where}")
    return problems


def _copy_tree(dest: Path, rev: str | None) -> None:
    """Copy the working tree's tracked and unignored files (or a committed tree) to ``dest``, and link
    ``draftkit/callbacks`` to the copy's ``callbacks/`` so that ``draftkit.callbacks`` imports from the copy (the
    editable install maps it to the working tree's ``callbacks/``, and its finder comes after the path's)."""
    if rev:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                               check=True, capture_output=True).stdout.decode().split("\0")
        for name in filter(None, files):
            src = REPO / name
            if src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
    link = dest / "draftkit" / "callbacks"
    if (dest / "callbacks").is_dir() and not link.exists():
        link.symlink_to(Path("..") / "callbacks", target_is_directory=True)


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

    args = ["-q", "-x", "-p", "no:cacheprovider", "-m", "not slow and not gpu and not interop and not mutation", *tests]
    return _forked(root, timeout, lambda: pytest.main(args))


def imported_files(root: Path) -> tuple[str, str]:
    """(``draftkit.__file__``, ``draftkit.callbacks.__file__``) as a run in ``root`` imports them (in a fork)."""
    r, w = os.pipe()

    def work() -> int:
        import draftkit
        import draftkit.callbacks

        os.write(w, f"{draftkit.__file__}\n{draftkit.callbacks.__file__}".encode())
        return 0

    _forked(root, 120.0, work)
    os.close(w)
    with os.fdopen(r) as f:
        first, _, second = f.read().partition("\n")
    return first, second


def _sha(*texts: str) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _tests_hash(root: Path, tests: tuple[str, ...]) -> str:
    """sha256 of the selection's arguments, of every file they name (every test file below a named folder) and of
    the test tree's conftest/helpers."""
    texts = list(tests)
    for t in tests:
        p = root / t.split("::")[0]
        for f in sorted(p.rglob("test_*.py")) if p.is_dir() else [p] if p.is_file() else []:
            texts.append(f.read_text())
    helpers = sorted(p for p in (root / "tests").rglob("*.py") if not p.name.startswith("test_"))
    texts += [p.read_text() for p in helpers]
    return _sha(*texts)


def _say(line: str) -> None:
    print(line, flush=True)


KILLED = {None: "killed (timeout)", 1: "killed", 2: "killed (collection)", 3: "killed (internal error)"}


def run(mutants: list[tuple[str, Mutant]], rev: str | None = None, timeout: float = 120.0, out=_say,
        cache: Path | None = None, equivalent: dict[str, str] | None = None) -> dict:
    """Run mutants; returns ``{"killed", "survived", "equivalent", "total", "score", "results", "retested",
    "by_module", "by_package"}`` (score = killed / (killed + survived)).

    Args:
        mutants: (module path, mutant); a mutant without ``tests`` runs its module's :func:`covering_tests`.
        timeout: seconds; a run is stopped (and the mutant killed) after ``max(timeout, 4 x baseline)``.
        cache: JSON file of earlier results (read and written), None for none.
        equivalent: ``{equivalent_key: reason}``; those mutants are not run and not scored.

    Raises:
        RuntimeError: if a run in the scratch copy would import draftkit or draftkit.callbacks from elsewhere.
    """
    equivalent = equivalent or {}
    store = json.loads(cache.read_text()) if cache and cache.is_file() else {}
    store.setdefault("mutants", {})
    store.setdefault("baselines", {})
    results, retested = [], 0
    with tempfile.TemporaryDirectory(prefix="draftkit-mutants-") as tmp:
        root = Path(tmp)
        _copy_tree(root, rev)
        _preload()
        files = imported_files(root)
        if not all(f.startswith(str(root) + os.sep) for f in files):
            raise RuntimeError(f"a run in the scratch copy {root} imports draftkit from elsewhere: {files}")
        if mutants and all(m.tests for _, m in mutants):  # the hand list
            for problem in check_snippets(root):
                out(f"list: {problem}")
        for path, m in mutants:
            f = root / path
            text = f.read_text() if f.is_file() else ""
            tests = m.tests or covering_tests(path, root)
            # a declared test file that a committed tree (--rev) does not have yet is left out of its selection
            tests = tuple(t for t in tests if not t.startswith("tests/") or (root / t.split("::")[0]).exists())
            key = f"{path}::{m.name}"
            seconds = 0.0
            mutated = m.apply(text)
            if equivalent_key(path, m, text) in equivalent:
                status = "equivalent"
            elif mutated is None:
                status = "not applied"
            elif not tests:
                status = "not covered"
            else:
                th, fh = _tests_hash(root, tests), _sha(text)
                ckey = f"{fh}|{key}|{th}"
                if ckey in store["mutants"]:
                    status, seconds = store["mutants"][ckey]["status"], store["mutants"][ckey]["seconds"]
                else:
                    bkey = f"{fh}|{path}|{th}"
                    if bkey not in store["baselines"]:
                        rc, s = _pytest(root, tests, max(timeout, 600.0))
                        store["baselines"][bkey] = {"rc": rc, "seconds": s}
                        out(f"baseline {'passes' if rc == 0 else f'FAILS (exit {rc})'}: {' '.join(tests)} ({s:.1f} s)")
                    base = store["baselines"][bkey]
                    if base["rc"] != 0:
                        status = "broken selection"
                    else:
                        f.write_text(mutated)
                        try:
                            rc, seconds = _pytest(root, tests, max(timeout, 4 * base["seconds"]))
                        finally:
                            f.write_text(text)
                        status = KILLED.get(rc, "survived" if rc == 0 else f"survived (pytest exit {rc})")
                        retested += 1
                    store["mutants"][ckey] = {"status": status, "seconds": seconds}
                    if cache:
                        cache.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
            results.append({"module": path, "name": m.name, "issue": m.issue, "status": status, "seconds": seconds,
                            "original": m.original, "replacement": m.replacement})
            tag = f" [issue {m.issue}]" if m.issue else ""
            out(f"{status:<24s} {key}{tag} ({seconds:.1f} s)  {m.original!r} -> {m.replacement!r}"[:400])
    report = summarize(results)
    report.update(results=results, retested=retested)
    for line in format_scores(report):
        out(line)
    return report


def _tally(rows: list[dict]) -> dict:
    killed = sum(r["status"].startswith("killed") for r in rows)
    survived = sum(r["status"].startswith("survived") for r in rows)
    equivalent = sum(r["status"] == "equivalent" for r in rows)
    other = len(rows) - killed - survived - equivalent
    scored = killed + survived
    return {"mutants": len(rows), "killed": killed, "survived": survived, "equivalent": equivalent, "other": other,
            "score": killed / scored if scored else None}


def summarize(results: list[dict]) -> dict:
    """Counts and score overall, per module and per package (``other``: not covered, not applied, broken)."""
    report = _tally(results)
    report["total"] = report["killed"] + report["survived"]
    report["by_module"] = {m: _tally([r for r in results if r["module"] == m]) for m in dict.fromkeys(
        r["module"] for r in results)}
    report["by_package"] = {p: _tally([r for r in results if package_of(r["module"]) == p]) for p in dict.fromkeys(
        package_of(r["module"]) for r in results)}
    report["by_kind"] = {k: _tally([r for r in results if kind_of(r["name"]) == k]) for k in sorted(
        {kind_of(r["name"]) for r in results})}
    return report


def kind_of(name: str) -> str:
    """The operator kind of a mutant name (``cmp:Lt->LtE@3:7`` -> ``cmp``); ``hand`` for the hand list's names."""
    kind = name.split(":", 1)[0]
    return kind if ":" in name and kind in OPERATORS else "hand"


def format_scores(report: dict) -> list[str]:
    """The score table: one line per module, per package and overall."""
    def line(name: str, t: dict) -> str:
        score = "  -  " if t["score"] is None else f"{100 * t['score']:5.1f} %"
        return (f"{name:<40s} {t['mutants']:4d} mutants {t['killed']:4d} killed {t['survived']:4d} survived "
                f"{t['equivalent']:3d} equivalent {t['other']:3d} other  score {score}")
    lines = [line(m, t) for m, t in report["by_module"].items()]
    lines += [line(f"package {p}", t) for p, t in report["by_package"].items()]
    lines += [line(f"kind {k}", t) for k, t in report.get("by_kind", {}).items()]
    lines.append(line("overall", report))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hand", action="store_true", help="run issue 17's hand list instead of generated mutants")
    p.add_argument("--rev", help="run on this committed tree instead of the working tree")
    p.add_argument("-k", dest="keyword", help="only mutants whose module path or name contains this")
    p.add_argument("--only", action="append", metavar="PATH::NAME",
                   help="only this mutant (repeatable; e.g. the survivors of an earlier run's --json)")
    p.add_argument("--sample", type=int, help="draw this many mutants, spread over the packages")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample")
    p.add_argument("--modules", type=int, help="with --sample: draw from this many modules per package")
    p.add_argument("--kinds", help="only these operator kinds, comma-separated (e.g. firstlast,offset,fingerprint)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds per pytest run, at least 4 x its baseline (a hang counts as killed)")
    p.add_argument("--cache", type=Path, default=CACHE, help="JSON file of results kept between runs")
    p.add_argument("--no-cache", action="store_true", help="retest everything and write no cache")
    p.add_argument("--json", type=Path, help="write the report (results and scores) to this file")
    p.add_argument("--list", action="store_true", help="print the mutants and their selections, run nothing")
    p.add_argument("--min-score", type=float, default=0.0, help="exit 1 below this score (0..1)")
    args = p.parse_args(argv)
    if args.hand:
        mutants = all_mutants()
    else:
        mutants = generated_mutants(REPO)
    mutants = [(path, m) for path, m in mutants if not args.keyword or args.keyword in f"{path}::{m.name}"]
    if args.kinds:
        mutants = [(path, m) for path, m in mutants if kind_of(m.name) in args.kinds.split(",")]
    if args.only:
        missing = set(args.only) - {f"{path}::{m.name}" for path, m in mutants}
        for key in sorted(missing):
            print(f"--only {key}: no such mutant in this tree (its module changed?)")
        mutants = [(path, m) for path, m in mutants if f"{path}::{m.name}" in args.only]
    if args.sample:
        mutants = sample(mutants, args.sample, args.seed, args.modules)
    equivalent = load_equivalent()
    if args.list:
        for path, m in mutants:
            tests = m.tests or covering_tests(path)
            tag = " [equivalent]" if equivalent_key(path, m, (REPO / path).read_text()) in equivalent else ""
            print(f"{path}::{m.name}{tag}  {m.original!r} -> {m.replacement!r}  |  {' '.join(tests) or '(no test)'}")
        problems = check_snippets(REPO) if args.hand else stale_equivalents(equivalent)
        for problem in problems:
            print(f"list: {problem}")
        return 1 if problems else 0
    t0 = time.perf_counter()
    report = run(mutants, args.rev, args.timeout, cache=None if args.no_cache else args.cache, equivalent=equivalent)
    print(f"{len(mutants)} mutants, {report['retested']} retested, {time.perf_counter() - t0:.0f} s wall", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if (report["score"] or 0.0) >= args.min_score else 1


def stale_equivalents(equivalent: dict[str, str], root: Path = REPO) -> list[str]:
    """Entries of the equivalent list that match no generated mutant of the tree (edited code)."""
    keys: dict[str, set[str]] = {}
    problems = []
    for key in equivalent:
        path = key.split("::")[0]
        if path not in keys:
            text = (root / path).read_text() if (root / path).is_file() else ""
            keys[path] = {equivalent_key(path, m, text) for m in generate(text)} if text else set()
        if key not in keys[path]:
            problems.append(f"{EQUIVALENT.name}: {key} matches no generated mutant of this tree (code edited?)")
    return problems


if __name__ == "__main__":
    raise SystemExit(main())
