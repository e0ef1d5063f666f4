"""``DraftkitCLI``: the LightningCLI behind ``draftkit fit`` and ``draftkit validate``, and :func:`load_recipe`.

``--recipe`` (alias ``-r``, ``-c``, ``--config``) is the config-file flag; repeat it to stack recipes
(later files win for scalars; ``trainer: {callbacks+: [...]}`` appends callbacks). The other verbs are in
``draftkit.commands``; those that read a recipe read it through :func:`load_recipe` or ``DraftkitCLI(run=False)``.
"""

from __future__ import annotations

from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["DraftkitCLI", "load_recipe"]


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


class _RecipeReader(DraftkitCLI):
    """DraftkitCLI that parses and stops: nothing is instantiated (no target, no logger directory)."""

    def instantiate_classes(self) -> None:
        """Reading a recipe instantiates nothing."""


def load_recipe(recipes: list[str], overrides: list[str] | None = None):
    """The parsed config of stacked recipes, exactly as ``fit`` reads them (the only recipe reader).

    Args:
        recipes: recipe YAML paths, stacked in order (later files win for scalars; ``callbacks+`` appends).
        overrides: more LightningCLI arguments (``--data.max_length 512``).

    Returns:
        A jsonargparse ``Namespace`` with ``model``, ``data``, ``trainer``, ... (class paths not instantiated).

    Raises:
        SystemExit: (status 2) on a recipe the parser refuses, with jsonargparse's message.
    """
    args = [x for r in recipes for x in ("--recipe", str(r))] + list(overrides or [])
    return _RecipeReader(args=args, run=False).config
