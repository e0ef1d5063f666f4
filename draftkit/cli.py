"""``DraftkitCLI``: the LightningCLI behind ``draftkit fit`` and ``draftkit validate``, and :func:`load_recipe`.

``--recipe`` (alias ``-r``, ``-c``, ``--config``) is the config-file flag; repeat it to stack recipes
(later files win for scalars; ``trainer: {callbacks+: [...]}`` appends callbacks). The other verbs are in
``draftkit.commands``; those that read a recipe read it through :func:`load_recipe` or ``DraftkitCLI(run=False)``.

Precision: ``trainer.precision`` left unset (null) and ``model.target_dtype: auto`` are resolved by the
precision policy (``draftkit.precision``) for the trainer's accelerator before anything is instantiated
(``bf16-mixed``/``bfloat16`` where the device computes bf16 fast, ``32-true``/``float32`` otherwise); an
explicit value wins. The choice and its reason go to the logger's hparams and the end-of-fit summary.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from jsonargparse import ActionConfigFile, Namespace
from lightning.pytorch import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from draftkit.precision import auto_precision, default_device, resolve_dtype, resolve_trainer_precision

__all__ = ["DraftkitCLI", "load_recipe"]


RUN_DIR_KEY = "draftkit_log_dir"  # checkpoint key: the logger directory of the run that wrote it


def _continue_run_dir(config) -> None:
    """Point a resumed fit's TensorBoard logger at the version directory of the run that wrote its checkpoint.

    ``fit --ckpt_path FILE`` would otherwise open a new ``version_N``: the learning curve splits in two and
    ``ModelCheckpoint``, whose default ``dirpath`` lies below the version directory, drops its best-k record
    (Lightning reloads it only for an unchanged ``dirpath``). TensorBoard appends a new event file, so the run
    continues as one. Applies to the default logger and to a ``TensorBoardLogger`` without a ``version``, and only
    when the checkpoint's directory (``RUN_DIR_KEY``, written by ``_RunStart``) lies under the configured
    ``save_dir/name``; anything else is left as configured (a ``CSVLogger`` would delete the old metrics file).
    """
    path = config.get("ckpt_path")
    if not path or not os.path.isfile(path):
        return
    logger = config.trainer.logger
    if logger is None or logger is True:
        args = Namespace(save_dir=config.trainer.default_root_dir or os.getcwd(), name="lightning_logs", version=None)
    elif isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("TensorBoardLogger"):
        args = logger.init_args
    else:
        return
    if args.get("version") is not None:
        return
    import torch

    log_dir = torch.load(path, map_location="cpu", mmap=True, weights_only=False).get(RUN_DIR_KEY)
    if not log_dir or Path(log_dir).parent.resolve() != (Path(args.save_dir) / (args.name or "")).resolve():
        return
    args.version = Path(log_dir).name
    if logger is None or logger is True:
        config.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=args)
    rank_zero_info(f"resuming {path}: logging into its run directory {log_dir}")


def _device_type(accelerator) -> str:
    """Torch device type of a Lightning ``trainer.accelerator`` value (``auto`` -> the default device)."""
    name = str(getattr(accelerator, "class_path", accelerator) or "auto").lower()
    if name in ("auto", "none"):
        return default_device()
    if name in ("gpu", "cuda") or "cuda" in name:
        return "cuda"
    return "mps" if "mps" in name else "cpu"


class _LogHyperparams(Callback):
    """Logs fixed hyperparameters to every logger once the loggers exist (``setup``, after ``prepare_data``)."""

    def __init__(self, params: dict) -> None:
        self.params = params

    def setup(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.params)


class _RunStart(Callback):
    """The optimizer step a run starts from, read once a checkpoint is restored (``on_train_start``), and a first
    Ctrl-C turned into SIGTERM: Lightning stops at the next loop boundary on SIGTERM (and the recipes'
    ``InterruptCheckpoint`` writes a state that resumes exactly), while a raw KeyboardInterrupt can land inside
    an optimizer step and checkpoint parameters one update ahead of their counters. A second Ctrl-C interrupts
    at once. Only where SIGINT has Python's default handler (not in a background job that ignores it). Every
    checkpoint records the logger directory, so that ``fit --ckpt_path`` continues that run (``_continue_run_dir``)."""

    step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        """Read the start step; install the Ctrl-C handler (after Lightning's own signal set-up, which restores
        the handlers it found when fit ends)."""
        self.step = trainer.global_step
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # SIGINT ignored (a background job) or handled by the caller: leave it so

        def first_ctrl_c(signum, frame):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            rank_zero_info("Ctrl-C: stopping at the next step boundary (Ctrl-C again to interrupt at once)")
            os.kill(os.getpid(), signal.SIGTERM)

        self._previous = signal.signal(signal.SIGINT, first_ctrl_c)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Record the run's logger directory, so that a resume continues it (``_continue_run_dir``)."""
        if trainer.logger is not None and trainer.logger.log_dir:
            checkpoint[RUN_DIR_KEY] = str(trainer.logger.log_dir)

    def _restore(self) -> None:
        if hasattr(self, "_previous"):
            signal.signal(signal.SIGINT, self._previous)
            del self._previous

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()


class DraftkitCLI(LightningCLI):
    """LightningCLI with ``--recipe`` as the config flag, ``data.tokenizer`` linked to ``model.target``, and the
    precision policy applied to ``trainer.precision`` and ``model.target_dtype`` (see the module docstring).

    Attributes:
        precision: after parsing, ``{"trainer_precision", "target_dtype", "requested": {...}, "auto": {...}}``,
            the resolved values, what the recipe asked for, and the policy's choice with its reason.
    """

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

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit":
            _continue_run_dir(config)
        device = _device_type(config.trainer.accelerator)
        requested = {"trainer_precision": config.trainer.precision, "target_dtype": config.model.target_dtype}
        config.trainer.precision = resolve_trainer_precision(config.trainer.precision, device)
        config.model.target_dtype = resolve_dtype(config.model.target_dtype, device, "model.target_dtype")
        self.precision = {
            "trainer_precision": str(config.trainer.precision), "target_dtype": config.model.target_dtype,
            "requested": {k: (str(v) if v is not None else None) for k, v in requested.items()},
            "auto": auto_precision(device).as_dict(),
        }

    def before_fit(self) -> None:
        self._fit_started = time.monotonic()
        self._run_start = _RunStart()
        self.trainer.callbacks.append(self._run_start)
        # logged in the setup hook, after prepare_data: a run that the data or model checks stop writes nothing
        self.trainer.callbacks.append(_LogHyperparams({"precision": self.precision}))

    def after_fit(self) -> None:
        trainer = self.trainer
        ckpt = trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", "") if ckpt else ""
        last = _save_final_last(trainer, ckpt)
        logdir = trainer.logger.log_dir if trainer.logger else trainer.default_root_dir
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        steps = trainer.global_step - self._run_start.step
        seconds = time.monotonic() - self._fit_started
        p, auto = self.precision, self.precision["auto"]
        timers = [cb for cb in trainer.callbacks if hasattr(cb, "summary") and hasattr(cb, "budget_s")]
        budget = timers[0].summary() if timers else "none (add draftkit.callbacks.time_budget.TimeBudget)"
        rank_zero_info(
            "\ndraftkit fit finished.\n"
            f"  trained: {trainer.global_step} optimizer steps ({steps} in this run, "
            f"{seconds / max(1, steps):.2f} s/step overall with set-up and validation), "
            f"{getattr(self.model, 'tokens_trained', 0):,} tokens\n"
            f"  precision: head {p['trainer_precision']}, target {p['target_dtype']} "
            f"(requested {p['requested']['trainer_precision'] or 'auto'}/{p['requested']['target_dtype']}; "
            f"auto on this machine: {auto['reason']})\n"
            f"  time budget: {budget}\n"
            f"  best checkpoint: {_with_step(best)}\n  last checkpoint: {_with_step(last)}\n"
            f"  TensorBoard logs: {logdir}  (tensorboard --logdir {logdir})\n"
            f"  validation: {metrics}"
        )


def _stored_step(path: str) -> int | None:
    """The ``global_step`` stored in checkpoint ``path`` (None when it cannot be read)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("global_step"))
    except Exception:  # noqa: BLE001 - a missing or unreadable file is reported as "(none)"/no step
        return None


def _with_step(path: str) -> str:
    """``path (step N)`` for the end-of-fit summary, ``(none)`` for no path."""
    if not path:
        return "(none)"
    step = _stored_step(path)
    return f"{path} (step {step})" if step is not None else path


def _save_final_last(trainer, ckpt) -> str:
    """Make ``last.ckpt`` hold the final optimizer step and return its path ("" when there is no last checkpoint).

    Lightning's ``ModelCheckpoint(save_last=True)`` refreshes ``last.ckpt`` only together with a save it makes on
    a validation or epoch end, so a run whose monitored metric falls (or whose last steps follow the last
    validation) leaves ``last.ckpt`` at an earlier step. After fit the trainer's state is written to that path
    again when its stored ``global_step`` differs from ``trainer.global_step``. Called on every rank
    (``trainer.save_checkpoint`` is collective)."""
    if ckpt is None or not getattr(ckpt, "save_last", None):
        return getattr(ckpt, "last_model_path", "") if ckpt else ""
    last = getattr(ckpt, "last_model_path", "") or ""
    if not last:
        if not ckpt.dirpath:
            return ""
        last = ckpt.format_checkpoint_name({}, ckpt.CHECKPOINT_NAME_LAST)
    stored = _stored_step(last) if os.path.isfile(last) else None
    if stored != trainer.global_step and trainer.global_step > 0:
        trainer.save_checkpoint(last)
        ckpt.last_model_path = last
        rank_zero_info(f"last checkpoint {last}: written at the final step {trainer.global_step} (held {stored})")
    return last


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
