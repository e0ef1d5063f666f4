"""``python -m draftkit``: LightningCLI for ``fit``/``validate`` plus draftkit's own verbs.

``--recipe`` (alias ``-r``, ``-c``, ``--config``) is the config-file flag; repeat it to stack recipes
(later files win for scalars; ``trainer: {callbacks+: [...]}`` appends callbacks).

Verbs: fit, validate (LightningCLI); evaluate (``--decoding dual-precision`` for dual-precision decoding),
select-layers, export, bench, cache-hidden-states (draftkit commands).
"""

from __future__ import annotations

import importlib
import logging
import sys

from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["DraftkitCLI", "main"]

VERBS = {
    "evaluate": "draftkit.decoding.evaluate",
    "evaluate-dual-precision": "draftkit.decoding.dual_precision_cli",
    "select-layers": "draftkit.analysis.select",
    "export": "draftkit.export.cli",
    "bench": "draftkit.bench",
    "cache-hidden-states": "draftkit.cache_hidden_states",
}


class DraftkitCLI(LightningCLI):
    """LightningCLI with ``--recipe`` as the config flag and ``data.tokenizer`` linked to ``model.target``."""

    def __init__(self, *args, **kwargs) -> None:
        from draftkit.data.datamodule import ChatDataModule
        from draftkit.models.eagle3 import Eagle3Module

        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(Eagle3Module, ChatDataModule, *args, **kwargs)

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        parser = LightningArgumentParser(**kwargs)
        parser.add_argument(
            "-r", "--recipe", "-c", "--config", action=ActionConfigFile,
            help="Recipe YAML (repeatable: later files override earlier ones).",
        )
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.target", "data.tokenizer")

    def after_fit(self) -> None:
        trainer = self.trainer
        ckpt = trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", "") if ckpt else ""
        last = getattr(ckpt, "last_model_path", "") if ckpt else ""
        logdir = trainer.logger.log_dir if trainer.logger else trainer.default_root_dir
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        rank_zero_info(
            "\ndraftkit fit finished.\n"
            f"  best checkpoint: {best or '(none)'}\n  last checkpoint: {last or '(none)'}\n"
            f"  TensorBoard logs: {logdir}  (tensorboard --logdir {logdir})\n"
            f"  validation: {metrics}"
        )


def _option(args: list[str], name: str) -> str | None:
    """Value of ``--name value`` or ``--name=value`` in an argument list, else None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m draftkit`` and the ``draftkit`` script."""
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args and args[0] in VERBS:
        verb = args[0]
        if verb == "evaluate" and _option(args, "--decoding") == "dual-precision":
            verb = "evaluate-dual-precision"
        module = importlib.import_module(VERBS[verb])
        return int(module.main(args[1:]) or 0)
    DraftkitCLI(args=argv)
    return 0
