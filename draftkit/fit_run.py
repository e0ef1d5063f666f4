"""A ``fit`` run's life around Lightning's loop (``DraftkitCLI``): resume, run directory, interrupts, final state.

- resume: ``fit --ckpt_path`` refuses options that differ from the checkpoint's (:func:`check_resume_options`,
  :data:`SAFE_ON_RESUME` lists those that may change) and logs into the run directory that wrote it
  (:func:`continue_run_dir`); a fit without ``--ckpt_path`` never resumes or overwrites a stopped run's state
  (:func:`check_fresh_start`);
- run directory: a new run claims its ``version_N`` at once (:func:`claim_run_dir`), and a run stopped during
  set-up removes it (:func:`remove_run_dir`);
- interrupts: a first Ctrl-C stops at the next step boundary (:class:`RunStart`), and a stopped fit says what it
  wrote and the command that resumes it (:func:`report_stop`, :func:`resume_command`);
- final state: ``last.ckpt`` holds the final optimizer step (:func:`save_final_last`).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

from draftkit.models.schedule import RESUME_KEY

__all__ = [
    "DATA_KEY", "HELD_OUT_KEY", "NOT_COMPARED", "NOT_USED_BY_VALIDATE", "RESOLVED_ON_RUN", "RUN_DIR_KEY", "SAFE_ON_RESUME",
    "RunStart", "check_fresh_start", "check_max_steps",
    "check_resume_options", "claim_run_dir", "continue_run_dir", "remove_run_dir", "report_stop", "resume_command",
    "save_final_last", "trainer_record", "warn_replaced_model_options", "with_step",
]


RUN_DIR_KEY = "draftkit_log_dir"  # checkpoint key: the logger directory of the run that wrote it
DATA_KEY = "draftkit_data_source"  # checkpoint key: the data source's content (ChatDataModule.source_fingerprint)
HELD_OUT_KEY = "draftkit_init_head_prompts"  # checkpoint key: the prompts model.init_head kept out of validation


SAFE_ON_RESUME: tuple[tuple[tuple[str, ...], str], ...] = (
    (("trainer.max_steps", "trainer.max_epochs", "trainer.max_time", "trainer.min_steps", "trainer.min_epochs"),
     "limits: they say when to stop, not how a step trains"),
    (("trainer.val_check_interval", "trainer.check_val_every_n_epoch", "trainer.limit_val_batches",
      "trainer.num_sanity_val_steps"), "validation: when and how much it measures; it never updates the head"),
    (("trainer.log_every_n_steps", "trainer.enable_progress_bar", "trainer.enable_model_summary"),
     "logging and display intervals"),
    (("trainer.devices", "trainer.num_nodes", "trainer.strategy", "trainer.accelerator"),
     "the processes a step runs on (data.batch_size is checked against them: the global batch must stay)"),
    (("trainer.callbacks", "trainer.enable_checkpointing"), "the monitor and callbacks: they watch and save the run"),
    (("trainer.logger", "trainer.default_root_dir"), "paths that only say where to write"),
    (("data.num_workers", "data.num_proc"), "loader and tokenizer processes: the rows and batches are the same"),
    (("trainer.precision", "model.target_dtype"), "the arithmetic a step runs in: a run started where bf16 is fast "
     "resumes in float32 on a CPU without it (~60x slower in bf16); it continues, not bit for bit"),
)
"""Options that ``fit --ckpt_path`` lets change (each change is logged once), with the reason; every other
``model.*``/``data.*`` option that differs from the checkpoint's is refused (:func:`check_resume_options`)."""

RESOLVED_ON_RUN = {"model.aux_layer_ids": None, "model.target_dtype": "auto", "data.hidden_states_cache": "auto",
                   "trainer.precision": None}
"""Options whose placeholder a run replaces in place (and the checkpoint stores resolved): the placeholder in
the resumed run's config means "the checkpoint's value", not a change."""

NOT_COMPARED = ("data.tokenizer",)
"""Linked to ``model.target``, which is compared."""


def _plain(value):
    """A config value as plain JSON types (tuples -> lists, Namespaces -> dicts, objects -> their repr)."""
    import json

    if isinstance(value, Namespace):
        value = value.as_dict()
    return json.loads(json.dumps(value, default=repr))


def _flatten(prefix: str, values: dict, nested: bool = True) -> dict:
    """``{"model.optim.lr": 0.001, ...}`` from nested dicts (lists and class_path dicts are kept whole)."""
    out = {}
    for key, value in values.items():
        if str(key).startswith("_"):
            continue  # Lightning's _instantiator / _class_path
        name = f"{prefix}.{key}"
        if nested and isinstance(value, dict) and "class_path" not in value:
            out.update(_flatten(name, value))
        else:
            out[name] = value
    return out


def trainer_record(config) -> dict:
    """The run's ``trainer.*`` options as plain values, stored in every checkpoint under ``RESUME_KEY``."""
    return _flatten("trainer", _plain(config.trainer), nested=False)


def _same(name: str, old, new) -> bool:
    """Whether a resumed run's ``new`` value of option ``name`` is the checkpoint's ``old`` one."""
    if old == new or (name in RESOLVED_ON_RUN and new == RESOLVED_ON_RUN[name] and old is not None):
        return True
    return isinstance(old, str) and isinstance(new, str) and os.path.exists(old) and os.path.exists(new) \
        and os.path.samefile(old, new)  # one data file named from another directory


def _world(trainer: dict) -> int | None:
    """Processes of a trainer record (``devices`` x ``num_nodes``), None when ``devices`` is not a count."""
    devices = trainer.get("trainer.devices")
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    count = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) and devices > 0 else None
    return None if count is None else count * int(trainer.get("trainer.num_nodes") or 1)


def _data_changed(config, ckpt: dict) -> str:
    """Why the data source differs from the one the checkpoint trained on ("" when it does not, or when the
    checkpoint stores no ``DATA_KEY``): a file that grew or was rewritten under the same ``data.path`` changes the
    rows, the split and the batch order, so a resume would silently train on other batches than the run planned."""
    old = ckpt.get(DATA_KEY)
    if not old or not config.get("data") or not config.data.get("path"):
        return ""
    from draftkit.artifacts import resolve_artifact
    from draftkit.data.datamodule import data_source_fingerprint

    new = data_source_fingerprint(resolve_artifact(config.data.path, "data.path"))
    if new == old:
        return ""
    return (f"data.path {config.data.path} holds other data than the run trained on (content {new[:16]} now, "
            f"{old[:16]} in the checkpoint: the file was rewritten or extended since), so the split and the batch "
            "order would change; restore the file the run started from to resume")


def check_resume_options(config, ckpt: dict, path: str) -> dict:
    """Compare a resumed fit's ``model.*``, ``data.*`` and ``trainer.*`` options with the checkpoint's.

    The checkpoint's model and data options are the ``hyper_parameters`` / ``datamodule_hyper_parameters``
    that ``save_hyperparameters`` stores; its trainer options are ``RESUME_KEY`` (written by ``RunStart``).
    A change listed in :data:`SAFE_ON_RESUME` is logged once (``old -> new``); ``data.batch_size`` may change
    only together with the processes, keeping the global batch (``batch_size x devices x num_nodes``). The data
    source's content must be the one the checkpoint stores under ``DATA_KEY`` (:func:`_data_changed`). An
    option the checkpoint does not store (written by an older draftkit) is reported and not compared.

    Returns:
        ``{field: this run's value}`` of the ``model.*`` options of :data:`SAFE_ON_RESUME` that changed: LightningCLI
        puts the checkpoint's hyperparameters back into ``model.*``, so the caller sets these again after it.

    Raises:
        ValueError: for any other difference, or a data file whose content changed (LightningCLI would otherwise
            replace the new ``model.*`` values with the checkpoint's without a word), naming each option, the
            checkpoint's and the new value, and how to proceed; raised before anything is instantiated.
    """
    safe = {name for names, _ in SAFE_ON_RESUME for name in names}
    stored = {**_flatten("model", ckpt.get("hyper_parameters") or {}),
              **_flatten("data", ckpt.get("datamodule_hyper_parameters") or {}),
              **(ckpt.get(RESUME_KEY) or {})}
    current = {**_flatten("model", _plain(config.model)), **_flatten("data", _plain(config.data)),
               **trainer_record(config)}
    if not ckpt.get(RESUME_KEY):
        rank_zero_info(f"resuming {path}: the checkpoint stores no trainer options (an older draftkit); "
                       "trainer options are not compared")
    old_world, new_world = _world(stored), _world(current)
    refused, missing, kept = [], [], {}
    for name, new in current.items():
        if name in NOT_COMPARED or (name.startswith("trainer.") and not ckpt.get(RESUME_KEY)):
            continue
        if name not in stored:
            missing.append(f"{name} (this run: {new!r})")
            continue
        old = stored[name]
        if _same(name, old, new):
            continue
        global_batch_kept = name == "data.batch_size" and old_world and new_world and old * old_world == new * new_world
        if name in safe or global_batch_kept:
            why = f" (global batch {old * old_world} kept)" if global_batch_kept else ""
            rank_zero_info(f"resuming {path}: {name} changed {old!r} -> {new!r}{why}")
            if name.startswith("model."):
                kept[name.removeprefix("model.")] = new
        else:
            hint = " (it may change only with trainer.devices, keeping the global batch)" if name == "data.batch_size" else ""
            refused.append(f"{name} is {new!r} in this run but {old!r} in the checkpoint{hint}")
    changed = _data_changed(config, ckpt)
    if changed:
        refused.append(changed)
    if missing:
        rank_zero_info(f"resuming {path}: the checkpoint stores no {', '.join(missing)} (written by an older "
                       "draftkit): not compared")
    if refused:
        raise ValueError(
            f"--ckpt_path {path}: {'; '.join(refused)}. Resuming continues the checkpoint's run, so these options "
            "cannot change: drop the flag (or set the recipe value back to the checkpoint's) to resume, or start a "
            f"new run without --ckpt_path to train with the new values (--model.init_head {path} starts it from this "
            "head's weights and draft vocab, e.g. to continue it on new data). Options that may change on resume: "
            + ", ".join(name for names, _ in SAFE_ON_RESUME for name in names)
        )
    return kept


NOT_USED_BY_VALIDATE = ("model.optim", "model.init_head", "model.init_from_target", "model.freeze_lm_head",
                        "model.init_decoder_from_target_layer", "model.hidden_state_noise")
"""``model.*`` options that only start or train a head: ``validate`` does not use them, so it names no change."""


def warn_replaced_model_options(config, ckpt: dict, path: str) -> list[str]:
    """``validate --ckpt_path``: name each ``model.*`` option of the run that the checkpoint's replaces.

    LightningCLI fills ``model.*`` from the checkpoint's ``hyper_parameters`` (the head is validated as it was
    trained: its draft vocab, aux layers, norms and target), so another ``--model.target`` or
    ``--model.draft_vocab_size`` was dropped without a word. Placeholders (:data:`RESOLVED_ON_RUN`) are no change;
    options of :data:`NOT_USED_BY_VALIDATE` are not compared.

    Returns:
        The replaced options as ``"name given -> checkpoint's"``, also logged in one warning.
    """
    stored = _flatten("model", ckpt.get("hyper_parameters") or {})
    current = _flatten("model", _plain(config.model))
    replaced = [f"{name} {new!r} -> {stored[name]!r}" for name, new in current.items()
                if name in stored and not _same(name, stored[name], new)
                and not name.startswith(tuple(f"{p}." for p in NOT_USED_BY_VALIDATE)) and name not in NOT_USED_BY_VALIDATE]
    if replaced:
        logging.getLogger(__name__).warning(
            f"validate --ckpt_path {path} runs the head with the checkpoint's model options, not this run's: "
            f"{'; '.join(replaced)}. To measure the head on another target use `draftkit evaluate --checkpoint "
            f"{path} --target T`; other head options need a new fit"
        )
    return replaced


def continue_run_dir(config) -> None:
    """Point a resumed fit's TensorBoard logger at the version directory of the run that wrote its checkpoint.

    ``fit --ckpt_path FILE`` would otherwise open a new ``version_N``: the learning curve splits in two and
    ``ModelCheckpoint``, whose default ``dirpath`` lies below the version directory, drops its best-k record
    (Lightning reloads it only for an unchanged ``dirpath``). TensorBoard appends a new event file, so the run
    continues as one. Applies to the default logger and to a ``TensorBoardLogger`` without a ``version``, and only
    when the checkpoint's directory (``RUN_DIR_KEY``, written by ``RunStart``) lies under the configured
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
    if not log_dir:
        return
    here = Path(args.save_dir) / (args.name or "")
    if Path(log_dir).parent.resolve() != here.resolve():
        logging.getLogger(__name__).warning(
            "resuming %s: its run directory %s is not under %s (trainer.default_root_dir or the logger changed), "
            "so this run logs into a new version directory there: the learning curve and the checkpoints continue "
            "in it; give the old trainer.default_root_dir to continue %s", path, log_dir, here, log_dir)
        return
    args.version = Path(log_dir).name
    if logger is None or logger is True:
        config.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=args)
    rank_zero_info(f"resuming {path}: logging into its run directory {log_dir}")


class RunStart(Callback):
    """The optimizer step a run starts from, read once a checkpoint is restored (``on_train_start``), and a first
    Ctrl-C turned into SIGTERM: Lightning stops at the next loop boundary on SIGTERM (and the recipes'
    ``InterruptCheckpoint`` writes a state that resumes exactly), while a raw KeyboardInterrupt can land inside
    an optimizer step and checkpoint parameters one update ahead of their counters. A second Ctrl-C interrupts
    at once. Only where SIGINT has Python's default handler (not in a background job that ignores it). Every
    checkpoint records the logger directory, so that ``fit --ckpt_path`` continues that run (``continue_run_dir``)."""

    step = 0
    ctrl_c = False
    """Whether a Ctrl-C asked this run to stop."""
    stopped: BaseException | None = None
    """The exception that stopped a fit after training started (``SIGTERMException`` for Ctrl-C/SIGTERM)."""
    saved_last: str = ""
    """``last.ckpt`` written at the step a SIGTERM/Ctrl-C stopped at ("" when none was)."""
    trainer_options: dict | None = None
    """The run's trainer options (``trainer_record``), stored in every checkpoint for resume checks."""

    def on_train_start(self, trainer, pl_module) -> None:
        """Read the start step; install the Ctrl-C handler (after Lightning's own signal set-up, which restores
        the handlers it found when fit ends)."""
        self.step = trainer.global_step
        self._started = True
        ckpt = trainer.checkpoint_callback
        if self.step and getattr(ckpt, "save_last", None) and not ckpt.last_model_path and ckpt.dirpath:
            last = ckpt.format_checkpoint_name({}, ckpt.CHECKPOINT_NAME_LAST)
            if os.path.isfile(last):  # written at the stop, after the resumed state was taken: refresh it, no -v1
                ckpt.last_model_path = last
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # SIGINT ignored (a background job) or handled by the caller: leave it so

        def first_ctrl_c(signum, frame):
            self.ctrl_c = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            rank_zero_info("Ctrl-C: stopping at the next step boundary (Ctrl-C again to interrupt at once)")
            os.kill(os.getpid(), signal.SIGTERM)

        self._previous = signal.signal(signal.SIGINT, first_ctrl_c)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Record the run's logger directory, so that a resume continues it (``continue_run_dir``), and its
        trainer options, so that a resume can compare them (``check_resume_options``)."""
        if trainer.logger is not None and trainer.logger.log_dir:
            checkpoint[RUN_DIR_KEY] = str(trainer.logger.log_dir)
        if self.trainer_options is not None:
            checkpoint[RESUME_KEY] = self.trainer_options
        source = getattr(trainer.datamodule, "source_fingerprint", None)
        if source is not None:
            checkpoint[DATA_KEY] = source()
        if hasattr(trainer.datamodule, "trained_prompts"):
            from draftkit.data.trained_prompts import CHECKPOINT_KEY, record

            checkpoint[CHECKPOINT_KEY] = record(trainer.datamodule.trained_prompts())
            held_out = trainer.datamodule.head_prompts()
            if held_out is not None:  # a resume keeps this split even if model.init_head changes or goes
                checkpoint[HELD_OUT_KEY] = record(held_out)

    def _restore(self) -> None:
        if hasattr(self, "_previous"):
            signal.signal(signal.SIGINT, self._previous)
            del self._previous

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Restore the Ctrl-C handler; after a SIGTERM or Ctrl-C stop during training (raised at a step boundary,
        so the state is consistent) write ``last.ckpt`` at the current step (``save_final_last``), so that no step
        is lost even without an ``InterruptCheckpoint``."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        self._restore()
        if trainer.state.fn != "fit" or not hasattr(self, "_started"):
            return
        self.stopped = exception
        if isinstance(exception, SIGTERMException):
            try:
                self.saved_last = save_final_last(trainer, trainer.checkpoint_callback)
            except Exception as exc:  # noqa: BLE001 - e.g. NaN weights: reported, the stop itself is what counts
                rank_zero_info(f"fit stopped: last.ckpt not written at step {trainer.global_step}: {exc}")


def resume_command(args: list[str], path: str) -> str:
    """The shell-safe ``python -m draftkit fit ...`` command line that resumes ``path``: ``args`` (the fit's
    arguments) with any ``--ckpt_path`` replaced."""
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--ckpt_path":
            skip = True
        elif not a.startswith("--ckpt_path="):
            kept.append(a)
    if not kept or kept[0] != "fit":
        kept.insert(0, "fit")
    return shlex.join(["python", "-m", "draftkit", *kept, "--ckpt_path", str(path)])


def claim_run_dir(logger) -> list[str]:
    """Create a new run's ``version_N`` directory at once, so that two fits started together with the same
    ``trainer.default_root_dir`` get one each (Lightning picks the next free number when it first writes, so both
    took ``version_0``): ``mkdir`` is atomic, a number another run took is skipped. Applies to a local
    TensorBoard or CSV logger without a ``version``; others are left as configured.

    Returns:
        the directories created, deepest first (the version directory and any parent that did not exist), for
        :func:`remove_run_dir`; empty when nothing was claimed.
    """
    if logger is None or getattr(logger, "_version", 0) is not None or not hasattr(logger, "_get_next_version"):
        return []
    root = str(logger.root_dir)
    if "://" in root:
        return []
    missing, parent = [], Path(root)
    while not parent.exists():
        missing.append(str(parent))
        parent = parent.parent
    os.makedirs(root, exist_ok=True)
    n = logger._get_next_version()
    while True:
        path = os.path.join(root, f"version_{n}")
        try:
            os.mkdir(path)
        except FileExistsError:
            n += 1
            continue
        logger._version = n
        return [path, *missing]


def _writes_stopped_state(callback) -> bool:
    """Whether ``callback`` writes a stopped run's state for ``--ckpt_path`` (``STOPPED_STATE`` set, as
    ``draftkit.callbacks.interrupt.InterruptCheckpoint`` does; its ``ckpt_path`` and ``written`` are read)."""
    return bool(getattr(callback, "STOPPED_STATE", False))


def check_fresh_start(trainer, ckpt_path, args: list[str]) -> None:
    """Refuse a ``fit`` without ``--ckpt_path`` that would resume implicitly or overwrite a stopped run's state.

    Lightning turns ``fit(ckpt_path=None)`` into ``"last"`` (its newest ``OnExceptionCheckpoint`` or ``last.ckpt``)
    whenever an ``OnExceptionCheckpoint`` is registered, past draftkit's resume-option check; and an
    ``InterruptCheckpoint`` file of a stopped run would be overwritten by this run's stop (or deleted at its end).
    A resume goes through ``--ckpt_path`` only (checked by ``check_resume_options``).

    Raises:
        ValueError: naming the callback or the stopped run's checkpoint (its step and run directory) and the
            command that resumes it; raised before the target is loaded or anything is written.
    """
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    if ckpt_path:
        return
    for cb in trainer.callbacks:
        if isinstance(cb, OnExceptionCheckpoint):
            raise ValueError(
                "trainer.callbacks: lightning's OnExceptionCheckpoint makes a fit without --ckpt_path resume "
                "silently from its file or a last.ckpt, past the resume-option check; use "
                "draftkit.callbacks.interrupt.InterruptCheckpoint (same init_args) and resume with --ckpt_path"
            )
        if _writes_stopped_state(cb) and hasattr(cb, "bind_trainer"):
            cb.bind_trainer(trainer)  # a folder that follows trainer.default_root_dir
        if _writes_stopped_state(cb) and os.path.isfile(cb.ckpt_path):
            import torch

            try:
                ckpt = torch.load(cb.ckpt_path, map_location="cpu", mmap=True, weights_only=False)
                what = f"the state of a stopped run at step {ckpt.get('global_step')} (run directory {ckpt.get(RUN_DIR_KEY)})"
            except Exception:  # noqa: BLE001 - an unreadable file is still someone's; name it
                what = "a file this run's InterruptCheckpoint would overwrite"
            raise ValueError(
                f"{cb.ckpt_path} holds {what}: this fit has no --ckpt_path, so it would start a new run and "
                f"overwrite that state. Resume it (the options are checked against it): "
                f"{resume_command(args, cb.ckpt_path)} ; or move that file away to start a new run"
            )


def check_max_steps(max_steps, ckpt_path: str | None) -> None:
    """Refuse a ``trainer.max_steps`` that trains nothing: 0, or (resuming) at or below the checkpoint's step.

    Args:
        max_steps: ``trainer.max_steps`` (-1 = no step limit: ``max_time`` or ``max_epochs`` ends the run).
        ckpt_path: the checkpoint a resumed fit continues from, or None.

    Raises:
        ValueError: naming the option, the checkpoint's step and the value that trains on.
    """
    if max_steps == 0:
        raise ValueError("trainer.max_steps 0 trains no step: give the optimizer steps to train (>= 1), or -1 to "
                         "let trainer.max_time or trainer.max_epochs end the run")
    step = _stored_step(ckpt_path) if ckpt_path and max_steps is not None and max_steps > 0 else None
    if step is not None and step >= max_steps:
        raise ValueError(f"--ckpt_path {ckpt_path} is at step {step} and trainer.max_steps {max_steps} ends there: "
                         f"nothing would train; give trainer.max_steps above {step} to train on")


def _stored_step(path: str) -> int | None:
    """The ``global_step`` stored in checkpoint ``path`` (None when it cannot be read)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("global_step"))
    except Exception:  # noqa: BLE001 - a missing or unreadable file is reported as "(none)"/no step
        return None


def with_step(path: str) -> str:
    """``path (step N)`` for the end-of-fit summary, ``(none)`` for no path."""
    if not path:
        return "(none)"
    step = _stored_step(path)
    return f"{path} (step {step})" if step is not None else path


def save_final_last(trainer, ckpt) -> str:
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
    elif stored is None:
        return ""  # no step trained, none saved (trainer.max_steps 0): the summary named a file that is not there
    return last


def remove_run_dir(created: list[str], trainer) -> None:
    """Remove the run directory :func:`claim_run_dir` created (config, hparams, event files, skip list), and
    the parents it created when they are empty, after a fit stopped before training started (global rank 0).

    Args:
        created: :func:`claim_run_dir`'s directories, deepest first (nothing is removed when empty).
        trainer: the fit's trainer.
    """
    import shutil

    if created and trainer.is_global_zero:
        shutil.rmtree(created[0], ignore_errors=True)
        for parent in created[1:]:
            try:
                os.rmdir(parent)
            except OSError:
                break  # another run wrote there meanwhile


def report_stop(trainer, run: RunStart, argv: list[str]) -> int:
    """Log where a stopped fit's state went and the command that resumes it (``argv``: the fit's
    arguments); return the exit code (130 after Ctrl-C, 143 after SIGTERM)."""
    written = [cb.ckpt_path for cb in trainer.callbacks if _writes_stopped_state(cb) and cb.written]
    written += [run.saved_last] if run.saved_last and run.saved_last not in written else []
    how = "Ctrl-C" if run.ctrl_c else "SIGTERM" if type(run.stopped).__name__ == "SIGTERMException" else \
        "an immediate interrupt (second Ctrl-C)"
    lines = [f"\ndraftkit fit stopped by {how} at optimizer step {trainer.global_step} "
             f"({trainer.global_step - run.step} in this run)."]
    if written:
        lines.append("  state written: " + ", ".join(with_step(p) for p in written))
        lines.append(f"  resume (the options are checked against it): {resume_command(argv, written[0])}")
    else:
        ckpt = trainer.checkpoint_callback
        last = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "") if ckpt else ""
        why = ("InterruptCheckpoint declined: its warning says why" if any(map(_writes_stopped_state,
               trainer.callbacks)) else "add draftkit.callbacks.interrupt.InterruptCheckpoint, or ModelCheckpoint "
               "save_last: true")
        lines.append(f"  no checkpoint written at the stop ({why}); latest checkpoint: " + with_step(last))
        if last:
            lines.append(f"  resume from it: {resume_command(argv, last)}")
    rank_zero_info("\n".join(lines))
    return 130 if run.ctrl_c or isinstance(run.stopped, KeyboardInterrupt) else 143
