"""``draftkit`` (``python -m draftkit``): one table of verbs.

Each verb is a typed function; its signature and its ``Args:`` docstring are its command line (jsonargparse
``add_function_arguments``, as litgpt's ``__main__`` does), and the first docstring line is its summary in
``draftkit --help``. ``fit`` and ``validate`` are LightningCLI (``draftkit.cli.DraftkitCLI``): recipes,
``--trainer.*``, ``--model.*``, ``--data.*``.

Flags are the parameters' names (``--num_speculative_tokens``); the short aliases of :data:`ALIASES` are the
only other spellings. A ``bool`` option given bare means ``true``; a repeated ``--recipe`` (``-r``, as ``fit``)
stacks; ``--model.*``, ``--data.*`` and ``--trainer.*`` after ``bench train`` or ``cache-hidden-states`` override
the recipe.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from draftkit.commands.bench import decode as bench_decode
from draftkit.commands.bench import train as bench_train
from draftkit.commands.cache_hidden_states import cache_hidden_states
from draftkit.commands.evaluate import evaluate
from draftkit.commands.evaluate_dual_precision import evaluate_dual_precision
from draftkit.commands.export import export
from draftkit.commands.generate import generate
from draftkit.commands.select_layers import select_layers

__all__ = ["COMMANDS", "LIGHTNING_VERBS", "build_parser", "main"]

LIGHTNING_VERBS = {
    "fit": "Train a draft head on a frozen target (LightningCLI: --recipe R [--recipe R2 ...], --trainer.*, --model.*, --data.*).",
    "validate": "Validate a draft head checkpoint (LightningCLI: --recipe R --ckpt_path CKPT).",
}
"""Verbs run by ``DraftkitCLI``, with their summaries."""

COMMANDS: dict[str, Callable | dict[str, Callable]] = {
    "evaluate": evaluate,
    "evaluate-dual-precision": evaluate_dual_precision,
    "select-layers": select_layers,
    "export": export,
    "bench": {"train": bench_train, "decode": bench_decode},
    "cache-hidden-states": cache_hidden_states,
    "generate": generate,
}
"""The draftkit verbs: name -> function (or name -> {sub-verb: function})."""

POSITIONAL = {"export"}
"""Verbs whose required arguments are positional (``export CHECKPOINT OUT_DIR --to ENGINE``)."""

RECIPE_SECTIONS = ("--model.", "--data.", "--trainer.", "--optimizer", "--lr_scheduler", "--seed_everything")
"""Arguments that override a recipe; they pass through to verbs with an ``overrides`` argument."""

ALIASES = {
    "export": {"-k": "--num_speculative_tokens"},
    "cache-hidden-states": {"-o": "--output"},
    "select-layers": {"--model.target": "--target", "--model.target_dtype": "--target_dtype", "--data.path": "--data",
                      "--data.chat_template": "--chat_template", "--data.max_length": "--max_length",
                      "--data.max_conversations": "--max_conversations"},
}
"""Short aliases of a verb's flags -> the flags (``draftkit bench decode`` is the verb ``bench decode``)."""

RECIPE_FLAGS = ("--recipe", "-r", "-c", "--config")
"""The recipe flag and its aliases, as ``fit``'s (``draftkit.cli``); repeated, the recipes stack."""


def _summary(fn: Callable) -> str:
    return (inspect.getdoc(fn) or "").split("\n", 1)[0]


def _engines() -> str:
    from draftkit.export import ENGINES

    return f"Engines (--to): {', '.join(ENGINES)}."


EXTRA_HELP = {"export": _engines}
"""Help computed when the parser is built (registries that tests or plugins extend)."""


def _function_parser(fn: Callable, prog: str, positional: bool, extra: str = ""):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog=prog, description=f"{_summary(fn)} {extra}".strip())
    parser.add_function_arguments(fn, as_positional=positional)
    return parser


def build_parser():
    """The ``draftkit`` parser: one subcommand per verb of :data:`LIGHTNING_VERBS` and :data:`COMMANDS`.

    ``fit``/``validate`` are listed for ``--help`` only; :func:`main` hands them to ``DraftkitCLI``.
    """
    from jsonargparse import ArgumentParser

    import draftkit

    parser = ArgumentParser(
        prog="draftkit", description=f"draftkit {draftkit.__version__}: train EAGLE3 draft heads on a frozen target, "
        "evaluate them and export them for vLLM, SGLang and TensorRT-LLM. `draftkit VERB --help` for a verb's options.",
    )
    verbs = parser.add_subcommands(dest="verb")
    for name, summary in LIGHTNING_VERBS.items():
        verbs.add_subcommand(name, ArgumentParser(prog=f"draftkit {name}", description=summary), help=summary)
    for name, fn in COMMANDS.items():
        if not isinstance(fn, dict):
            extra = EXTRA_HELP[name]() if name in EXTRA_HELP else ""
            verbs.add_subcommand(name, _function_parser(fn, f"draftkit {name}", name in POSITIONAL, extra),
                                 help=_summary(fn))
            continue
        summary = f"Benchmarks on this machine: {', '.join(fn)} (`draftkit {name} SUB --help`)."
        sub = ArgumentParser(prog=f"draftkit {name}", description=summary)
        verbs.add_subcommand(name, sub, help=summary)
        subverbs = sub.add_subcommands(dest="subverb")
        for sub_name, sub_fn in fn.items():
            subverbs.add_subcommand(sub_name, _function_parser(sub_fn, f"draftkit {name} {sub_name}", False),
                                    help=_summary(sub_fn))
    return parser


def _normalize(args: list[str]) -> list[str]:
    """Aliases -> flags, bare ``bool`` flags -> ``=true``, repeated recipes -> ``--recipe+``, recipe overrides ->
    ``--overrides`` (see the module docstring)."""
    verb = " ".join(args[:2]) if args[:1] == ["bench"] else args[0]
    fn = COMMANDS.get(args[0])
    fn = fn.get(args[1]) if isinstance(fn, dict) and len(args) > 1 else fn
    params = inspect.signature(fn).parameters if callable(fn) else {}
    aliases = ALIASES.get(verb, {})
    bools = {f"--{n}" for n, p in params.items() if p.annotation in (bool, "bool")}
    head, rest = args[: len(verb.split())], args[len(verb.split()):]
    out, overrides, i = [], [], 0
    while i < len(rest):
        arg = rest[i]
        name, eq, value = arg.partition("=")
        name = aliases.get(name, name)
        if "overrides" in params and name.startswith(RECIPE_SECTIONS):
            overrides.append(name + eq + value)
            if not eq and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                overrides.append(rest[i + 1])
                i += 1
        elif name.startswith(RECIPE_SECTIONS) and params:
            raise ValueError(f"{verb} takes no recipe override {name}: see `python -m draftkit {verb} --help` for "
                             "its options" + (" (--recipe reads a recipe's values)" if "recipe" in params else ""))
        elif "recipe" in params and name in RECIPE_FLAGS and not eq:
            out.append("--recipe+")
        elif name in bools and not eq and (i + 1 == len(rest) or rest[i + 1] not in ("true", "false")):
            out.append(f"{name}=true")
        else:
            out.append(name + eq + value)
        i += 1
    if overrides:
        out.append(f"--overrides={overrides!r}".replace("'", '"'))
    return [*head, *out]


def _check_target_arg(args: list[str]) -> None:
    """A ``--model.target`` given on the command line that looks like a local path must exist; checked before
    set-up so the error names ``model.target`` (``data.tokenizer``, linked to it, is resolved first otherwise).

    Raises:
        FileNotFoundError: see ``draftkit.artifacts.resolve_artifact``.
    """
    from draftkit.artifacts import looks_like_path, resolve_artifact

    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == "--model.target":
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if looks_like_path(value):
                resolve_artifact(value, "model.target")


def _check_recipes(args: list[str]) -> None:
    """Every recipe file given (``--recipe``, ``-r``, ``-c``, ``--config``) must be YAML whose top level is a
    mapping; checked before a parser reads it, since jsonargparse's error names neither the file nor its line.

    Raises:
        ValueError: naming the flag, the file, the line and column, and what YAML found.
    """
    import yaml

    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if flag not in RECIPE_FLAGS or not os.path.isfile(value):
            continue  # an inline YAML string, or a missing file (the parser names it)
        try:
            data = yaml.safe_load(Path(value).read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            why = getattr(exc, "problem", None) or exc
            raise ValueError(f"{flag} {value}: not valid YAML{where} ({why}); fix the file") from exc
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"{flag} {value}: its top level is a YAML {type(data).__name__}, not the sections of a "
                             "recipe (model:, data:, trainer:, ...)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftkit`` and ``python -m draftkit``.

    Returns:
        0 on success; 2 on bad input: a ``ValueError`` or ``OSError`` from any verb (``fit``/``validate``
        included), or Lightning's ``MisconfigurationException`` (a trainer option it refuses), prints one line
        ``draftkit VERB: error: ...`` to stderr, no traceback; set ``DRAFTKIT_DEBUG=1``
        to raise it with its traceback instead. 130 after Ctrl-C (a ``KeyboardInterrupt``), without a traceback:
        the verb has said what it kept (``generate``: its shards and that the same command resumes), as a stopped
        ``fit`` exits 130 after its report (``fit_run.report_stop``). Other exceptions (bugs) propagate with their
        traceback.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    verb = " ".join(args[:2]) if args[:1] == ["bench"] else (args[0] if args else "")
    try:
        _check_recipes(args)
        if args and args[0] in LIGHTNING_VERBS:
            from draftkit.cli import DraftkitCLI

            if logging.getLogger().handlers:  # Lightning adds a handler of its own that also propagates: print once
                logging.getLogger("lightning").handlers.clear()
            _check_target_arg(args)
            DraftkitCLI(args=argv, parser_kwargs={"prog": "draftkit"})
            return 0
        if args and not args[0].startswith("-"):
            args = _normalize(args)
        parser = build_parser()
        config = parser.parse_args(args)
        init = parser.instantiate(config) if hasattr(parser, "instantiate") else parser.instantiate_classes(config)
        fn, options = COMMANDS[config.verb], init[config.verb]
        if isinstance(fn, dict):
            fn, options = fn[options.subverb], options[options.subverb]
        options = {k: v for k, v in vars(options).items() if k in inspect.signature(fn).parameters}
        fn(**options)
    except (Exception, KeyboardInterrupt) as exc:
        if os.environ.get("DRAFTKIT_DEBUG", "") not in ("", "0") or not _user_error(exc):
            raise
        if isinstance(exc, KeyboardInterrupt):  # 128 + SIGINT, the shell's code for a Ctrl-C; 143 after a SIGTERM
            return getattr(exc, "exit_code", 130)  # that a verb handled as one (generation.regenerate.Terminated)
        print(f"draftkit {verb}: error: {_message(exc)}", file=sys.stderr)
        return 2
    return 0


def _user_error(exc: BaseException) -> bool:
    """Bad files or options, a head/target mismatch (``ValueError``, ``OSError``), a trainer option Lightning refuses
    (its ``MisconfigurationException``), or Ctrl-C: reported without a traceback; anything else is a bug."""
    return (isinstance(exc, (ValueError, OSError, KeyboardInterrupt))
            or type(exc).__name__ == "MisconfigurationException")


_UNION = "Does not validate against any of the Union subtypes"


def _message(exc: Exception) -> str:
    """The error's text; for an option typed ``Optional[SomeConfig]`` (``select-layers --analysis.k 0``) only the
    config's own error, not jsonargparse's list of Union subtypes, the ``NoneType`` mismatch and the whole
    namespace (8 lines)."""
    text = str(exc)
    if text.startswith(_UNION):
        errors = [line[4:] for line in text.splitlines()
                  if line.startswith("  - ") and not line.startswith("  - Expected a <class 'NoneType'>")]
        if len(errors) == 1:
            return errors[0]
    return text
