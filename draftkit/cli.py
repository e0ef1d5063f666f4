"""``DraftkitCLI``: the LightningCLI behind ``draftkit fit`` and ``draftkit validate``, and :func:`load_recipe`.

``--recipe`` (alias ``-r``, ``-c``, ``--config``) is the config-file flag; repeat it to stack recipes
(later files win for scalars; ``trainer: {callbacks+: [...]}`` appends callbacks). The other verbs are in
``draftkit.commands``; those that read a recipe read it through :func:`load_recipe` or ``DraftkitCLI(run=False)``.

Precision: ``trainer.precision`` left unset (null) and ``model.target_dtype: auto`` are resolved by the
precision policy (``draftkit.precision``) for the trainer's accelerator before anything is instantiated
(``bf16-mixed``/``bfloat16`` where the device computes bf16 fast, ``32-true``/``float32`` otherwise); an
explicit value wins. The choice and its reason go to the logger's hparams and the end-of-fit summary.

A fit's life around Lightning's loop (resume checks, the run directory, interrupts, the final ``last.ckpt``) is
``draftkit.fit_run``.
"""

from __future__ import annotations

import shlex
import sys
import time

from jsonargparse import ActionConfigFile
from lightning.pytorch import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from draftkit.fit_progress import ProgressLog
from draftkit.fit_run import (
    HELD_OUT_KEY, RunStart, check_fresh_start, check_max_steps, check_resume_options, claim_run_dir, continue_run_dir,
    remove_run_dir,
    report_stop, save_final_last, trainer_record, warn_replaced_model_options, with_step,
)
from draftkit.precision import auto_precision, default_device, resolve_dtype, resolve_trainer_precision
from draftkit.strategy import check_strategy

__all__ = ["DraftkitCLI", "load_recipe"]


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


def _check_context_window(config) -> None:
    """Refuse a ``data.max_length`` past the target's context window (``max_position_embeddings``): the target's
    states and logits there are not what it serves (RoPE past its trained range), and ``evaluate`` refuses such
    lengths. Reads only the target's config, before the data is tokenized.

    Raises:
        ValueError: naming both numbers and ``model.target``.
    """
    from transformers import AutoConfig

    from draftkit.artifacts import resolve_model_dir
    from draftkit.target.frozen import text_config

    target, max_length = config.model.target, config.data.max_length
    window = getattr(text_config(AutoConfig.from_pretrained(resolve_model_dir(target, "model.target"))),
                     "max_position_embeddings", None)
    if window and max_length > window:
        raise ValueError(
            f"data.max_length={max_length} exceeds the context window of model.target {target} "
            f"(max_position_embeddings={window}): the target's states past {window} tokens are not the ones it "
            f"serves; set data.max_length to at most {window}"
        )


class DraftkitCLI(LightningCLI):
    """LightningCLI with ``--recipe`` as the config flag, ``data.tokenizer`` linked to ``model.target``, the
    prompts ``model.init_head`` trained on kept out of validation (``ChatDataModule.hold_out_head``), and the
    precision policy applied to ``trainer.precision`` and ``model.target_dtype`` (see the module docstring).

    Attributes:
        precision: after parsing, ``{"trainer_precision", "target_dtype", "requested": {...}, "auto": {...}}``,
            the resolved values, what the recipe asked for, and the policy's choice with its reason.
    """

    def __init__(self, *args, **kwargs) -> None:
        from draftkit.data.datamodule import ChatDataModule
        from draftkit.models.eagle3 import Eagle3Module

        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self._argv = [str(a) for a in (kwargs.get("args") if isinstance(kwargs.get("args"), list) else sys.argv[1:])]
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

    def _parse_ckpt_path(self) -> None:
        """``fit``/``validate --ckpt_path``: a file that is no draftkit checkpoint is refused naming it; ``fit``
        refuses options that differ from the checkpoint's (``check_resume_options``), ``validate`` names those it
        replaces (``warn_replaced_model_options``), before LightningCLI fills
        ``model.*`` from the checkpoint's hyperparameters (which then changes only the placeholders of
        ``fit_run.RESOLVED_ON_RUN``)."""
        config = self.config.get(self.config.get("subcommand") or "", None)
        path = config.get("ckpt_path") if config is not None else None
        verb = self.config.get("subcommand")
        kept = {}  # model options that may change on resume, set again after LightningCLI restores the checkpoint's
        if verb in ("fit", "validate") and path and path not in ("best", "last", "hpc") \
                and not path.startswith("registry"):  # Lightning's names; a file is read or refused naming it
            from draftkit.heads.checkpoint import load_checkpoint

            ckpt = load_checkpoint(path, "--ckpt_path")[0]
            held = ckpt.get(HELD_OUT_KEY)  # the split the run trained with (restore_head_prompts)
            self._held_out = (held["hashes"] if isinstance(held, dict) else None,)
            if verb == "fit":
                kept = check_resume_options(config, ckpt, path)
            else:
                warn_replaced_model_options(config, ckpt, path)
        super()._parse_ckpt_path()
        for field, value in kept.items():
            self.config[verb].model[field] = value

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_strategy(config)  # an FSDP/DeepSpeed/... recipe stops here, before any model is loaded
        if self.subcommand == "fit":
            continue_run_dir(config)
        device = _device_type(config.trainer.accelerator)
        requested = {"trainer_precision": config.trainer.precision, "target_dtype": config.model.target_dtype}
        config.trainer.precision = resolve_trainer_precision(config.trainer.precision, device)
        config.model.target_dtype = resolve_dtype(config.model.target_dtype, device, "model.target_dtype")
        self.precision = {
            "trainer_precision": str(config.trainer.precision), "target_dtype": config.model.target_dtype,
            "requested": {k: (str(v) if v is not None else None) for k, v in requested.items()},
            "auto": auto_precision(device).as_dict(),
        }

    def instantiate_classes(self) -> None:
        """LightningCLI's, then the datamodule keeps the prompts ``model.init_head`` trained on out of validation
        (every verb that reads a recipe: fit, validate, cache-hidden-states, bench)."""
        super().instantiate_classes()
        config = self.config[self.subcommand] if self.subcommand else self.config
        if hasattr(self.datamodule, "hold_out_head"):
            self.datamodule.hold_out_head(config.model.get("init_head"))

    def _run_subcommand(self, subcommand: str) -> None:
        """Run the verb; a ``fit`` stopped during training (Ctrl-C, SIGTERM, a second Ctrl-C) says what it wrote
        and how to resume, and exits non-zero (130 after Ctrl-C, 143 after SIGTERM; Lightning exits 0 on SIGTERM)."""
        try:
            super()._run_subcommand(subcommand)
        except BaseException as exc:
            run = getattr(self, "_run_start", None)
            if subcommand == "fit" and run is not None and not hasattr(run, "_started"):
                remove_run_dir(getattr(self, "_created_dirs", []), self.trainer)  # stopped in set-up: nothing to keep
            if isinstance(exc, ValueError) and "`val_check_interval`" in str(exc):
                raise ValueError(
                    f"trainer.val_check_interval={self.trainer.val_check_interval} exceeds the "
                    f"{self.trainer.num_training_batches} training batches of an epoch; set "
                    "trainer.check_val_every_n_epoch null (validation every trainer.val_check_interval batches "
                    "across epochs) or lower trainer.val_check_interval") from exc
            if not isinstance(exc, (SystemExit, KeyboardInterrupt)) or subcommand != "fit" or run is None \
                    or run.stopped is None:
                raise
            raise SystemExit(report_stop(self.trainer, run, self._argv)) from exc

    def before_validate(self) -> None:
        config = self.config[self.subcommand]
        _check_context_window(config)
        if not config.get("ckpt_path") and not config.model.get("init_head") and self.trainer.is_global_zero:
            import logging

            logging.getLogger(__name__).warning(
                "validate without --ckpt_path (or model.init_head) measures a newly initialised head, not a trained "
                "one: pass --ckpt_path CKPT (a fit checkpoint) or --model.init_head HEAD (a checkpoint or an export "
                "directory) to validate a trained head"
            )
        # the checkpoint holds the weights and d2t/t2d: build() skips model.init_head, which may be gone by now
        self.model.resume_ckpt_path = self.config[self.subcommand].get("ckpt_path")
        self._restore_split()

    def _restore_split(self) -> None:
        """With ``--ckpt_path``, validation keeps out the prompts the checkpoint's run kept out (not those
        ``model.init_head`` records now: it may have changed or gone)."""
        held_out = getattr(self, "_held_out", None)
        if held_out is not None and hasattr(self.datamodule, "restore_head_prompts"):
            self.datamodule.restore_head_prompts(held_out[0])

    def before_fit(self) -> None:
        check_fresh_start(self.trainer, self.config[self.subcommand].get("ckpt_path"), self._argv)
        check_max_steps(self.trainer.max_steps, self.config[self.subcommand].get("ckpt_path"))
        init_head = self.config[self.subcommand].model.get("init_head")
        if init_head and not self.config[self.subcommand].get("ckpt_path"):  # before the data and the target load
            from draftkit.models.init_head import check_head_options

            check_head_options(init_head, self.model.hparams)
        _check_context_window(self.config[self.subcommand])
        _check_memory(self.model, self.datamodule, self.trainer)
        self.model.resume_ckpt_path = self.config[self.subcommand].get("ckpt_path")  # build() skips model.init_head
        self._restore_split()
        self._created_dirs = claim_run_dir(self.trainer.logger) if self.trainer.world_size == 1 else []
        self._fit_started = time.monotonic()
        self._run_start = RunStart()
        self._run_start.trainer_options = trainer_record(self.config[self.subcommand] if self.subcommand else self.config)
        self.trainer.callbacks.append(self._run_start)
        if not sys.stdout.isatty() and not any(isinstance(cb, ProgressLog) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(ProgressLog())  # the progress bar draws nothing into a log file
        # logged in the setup hook, after prepare_data: a run that the data or model checks stop writes nothing
        self.trainer.callbacks.append(_LogHyperparams({"precision": self.precision}))

    def after_fit(self) -> None:
        trainer = self.trainer
        ckpt = trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", "") if ckpt else ""
        last = save_final_last(trainer, ckpt)
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
            f"  best checkpoint: {with_step(best)}\n  last checkpoint: {with_step(last)}\n"
            f"  TensorBoard logs: {logdir}  ({shlex.join(['tensorboard', '--logdir', str(logdir)])})\n"
            f"  validation: {metrics}"
        )


def _check_memory(model, dm, trainer) -> None:
    """Print the per-GPU memory estimate of an online ``fit`` before anything loads, and stop a run that will
    not fit its GPUs (``draftkit.models.memory.check_memory``). Skipped, with the reason, when the target's
    config cannot be read yet, and for offline runs (``data.hidden_states_cache``: no target forward)."""
    from transformers import AutoConfig

    from draftkit.artifacts import resolve_model_dir
    from draftkit.models.memory import check_memory

    hp, data = getattr(model, "hparams", {}), getattr(dm, "hparams", {})
    if "target" not in hp or "max_length" not in data or data.get("hidden_states_cache"):
        return
    try:
        config = AutoConfig.from_pretrained(resolve_model_dir(hp["target"], "model.target"))
    except (OSError, ValueError) as e:
        rank_zero_info(f"memory estimate skipped: the target's config is not readable yet ({e})")
        return
    gpu_bytes = None
    if trainer.strategy.root_device.type == "cuda" and getattr(trainer.strategy, "_start_method", None) != "fork":
        import torch

        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    rank_zero_info(check_memory(
        config, getattr(trainer.strategy, "strategy_name", "ddp"), trainer.num_devices * trainer.num_nodes,
        4 if hp["target_dtype"] == "float32" else 2, data["max_length"], data["batch_size"], model.ttt.steps,
        hp["draft_vocab_size"], hp["aux_layer_ids"], gpu_bytes,
    ))


class _RecipeReader(DraftkitCLI):
    """DraftkitCLI that parses and stops: nothing is instantiated (no target, no logger directory)."""

    def instantiate_classes(self) -> None:
        """Reading a recipe instantiates nothing."""

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parse ``args`` only, without LightningCLI's warning that the process has command-line arguments too (a
        verb such as ``generate --recipe R`` reads its recipe here while ``sys.argv`` holds its own options)."""
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            super().parse_arguments(parser, args)


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
