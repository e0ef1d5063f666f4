"""The training module's guards: a run that cannot teach the head stops with an error that says why.

Two kinds, both raised by ``Eagle3Module`` at the hook where the problem first shows:

- non-finite numbers (:class:`NonFiniteTrainingError`): a NaN/inf loss (:func:`check_finite_loss`, its cause
  found by :func:`nonfinite_detail`), gradient (:func:`check_finite_grads`) or head weight
  (:func:`check_head_finite`) stops ``fit`` before the optimizer step or the checkpoint that would use it;
- no learning (a warning, :func:`warn_uniform_head`): past the warmup, a head whose validation loss is a uniform
  guess's over the draft vocab, or ten times worse (a learning rate that flattened or blew it up);
- no signal: an entropy filter that removes every position (:func:`check_filter_keeps_tokens`), training batches
  without a trainable token (:func:`no_signal`), a validation split with nothing to measure for a monitored
  ``val/tau_sim`` (:func:`nothing_to_measure`).

Shapes: B batch, T tokens, H_t target hidden, n aux layers, V target vocab.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

__all__ = [
    "LOW_DRAFT_COVERAGE", "NonFiniteTrainingError", "check_filter_for_target", "check_filter_keeps_tokens",
    "check_finite_grads", "check_finite_loss", "check_head_finite", "check_validation_measured", "head_is_finite",
    "no_signal", "nonfinite_detail", "nothing_to_measure", "warn_low_draft_coverage", "warn_uniform_head",
]

log = logging.getLogger(__name__)

UNIFORM_MARGIN = 1e-3
"""Nats: a step-0 validation loss within this of ln(V_d) is a uniform guess's (:func:`warn_uniform_head`)."""

BLOWN_UP = 10.0
"""A step-0 validation loss above this many times ln(V_d) is a blown-up head's (:func:`warn_uniform_head`)."""

LOW_DRAFT_COVERAGE = 0.5
"""``val/draft_coverage`` below this warns: most drafts are then rejected whatever the head learns."""


class NonFiniteTrainingError(ValueError):
    """A training or validation batch gave a NaN/inf loss or gradient: ``fit`` stops before the optimizer
    step (the weights stay finite) and before any metric or checkpoint is written from it. The message names
    the batch's source (the offline cache shard and sequence, or the records) and what to change."""


# -- non-finite numbers ------------------------------------------------------------------------------------
def check_finite_loss(total: torch.Tensor, stage: str, batch_idx: int, trainer, detail: Callable[[], str]) -> None:
    """Stop on a NaN/inf loss before anything uses it (backward, metrics, checkpoints): one ``isfinite`` per
    batch, summed over ranks under DDP so that every rank stops together.

    Args:
        total: the batch's scalar loss.
        stage: ``train`` or ``validation``.
        batch_idx: the batch's index in its loader.
        trainer: the Lightning trainer, or None outside one (one process, step 0).
        detail: called only on this rank's non-finite loss: why it is (:func:`nonfinite_detail`).

    Raises:
        NonFiniteTrainingError: naming the step, the batch and its source.
    """
    bad = ~torch.isfinite(total.detach())
    if trainer is not None and trainer.world_size > 1:
        bad = trainer.strategy.reduce(bad.float(), reduce_op="sum") > 0
    if not bool(bad):
        return
    step = trainer.global_step if trainer is not None else 0
    where = "another rank's batch (see that rank's error)" if bool(torch.isfinite(total.detach())) else detail()
    raise NonFiniteTrainingError(
        f"non-finite {stage} loss ({float(total)}) at optimizer step {step}, {stage} batch {batch_idx}: {where}"
        + ("; stopped before the optimizer step, the weights stay finite and no checkpoint is written from it"
           if stage == "train" else "; no accuracy or loss is reported for it")
    )


def nonfinite_detail(batch: dict, head: torch.nn.Module, target, target_dtype: str, sharded: bool) -> str:
    """Why a batch's loss is non-finite, for the error: the rows with NaN/inf cached states (naming their
    shard and sequence), else the target's own non-finite outputs (online, :func:`nonfinite_target_outputs`),
    else non-finite head weights, else the batch's sources and the options to change.

    Args:
        batch: ``input_ids`` (B, T) and ``attention_mask``; offline also ``aux_hidden_states`` (B, T, n*H_t) and
            ``last_hidden_state`` (B, T, H_t); optionally ``source`` (B names).
        head: the draft head.
        target: the module's ``FrozenTarget`` (online) or ``TargetLMHead`` (offline).
        target_dtype: the dtype the target runs in (named in the error).
        sharded: whether the target is sharded across ranks (its forward then needs every rank: not rerun here).
    """
    sources = batch.get("source")
    n = batch["input_ids"].shape[0]
    name = (lambda i: sources[i]) if sources else (lambda i: f"batch row {i}")
    if "aux_hidden_states" in batch:
        rows = []
        for i in range(n):
            counts = [f"{int((~torch.isfinite(batch[key][i])).sum())} NaN/inf values in {key}"
                      for key in ("aux_hidden_states", "last_hidden_state")
                      if not bool(torch.isfinite(batch[key][i]).all())]
            if counts:
                rows.append(f"{name(i)} has {' and '.join(counts)}")
        if rows:
            return ("; ".join(rows) + "; delete that shard file and rerun `python -m draftkit cache-hidden-states` "
                    "with the same recipe and --output to rewrite it")
    elif hasattr(target, "lm_logits") and not sharded:
        # online: the target's own outputs, recomputed on this error path (not for a sharded target, whose
        # forward needs every rank while only this one is here)
        outputs = nonfinite_target_outputs(batch, target, target_dtype)
        if outputs:
            return outputs
    bad = [k for k, p in head.named_parameters() if not bool(torch.isfinite(p).all())]
    listed = ", ".join(name(i) for i in range(n)) if sources else "its records are not named"
    if bad:
        return f"the head's {', '.join(bad)} are already NaN/inf (batch: {listed})"
    return (f"its inputs are finite ({listed}), the loss overflowed: lower model.optim.lr, set "
            "trainer.gradient_clip_val or train in trainer.precision 32-true")


def nonfinite_target_outputs(batch: dict, target, target_dtype: str) -> str | None:
    """The error detail when the frozen target's own outputs on ``batch`` (aux and last hidden states, logits,
    at the real tokens) hold NaN/inf, e.g. a target that overflows in float16; None when they are finite."""
    mask = batch["attention_mask"].bool()  # (B, T)
    out = target(batch["input_ids"], attention_mask=batch["attention_mask"], compute_logits=False)
    parts = {"aux hidden states": out.aux_hidden_states[mask], "last hidden state": out.last_hidden_state[mask]}
    with torch.no_grad():
        parts["logits"] = target.lm_logits(parts["last hidden state"])  # (n, V)
    counts = [f"{int((~torch.isfinite(t)).sum())} NaN/inf values in its {what}" for what, t in parts.items()
              if not bool(torch.isfinite(t).all())]
    if not counts:
        return None
    return (f"the target's own outputs are non-finite ({', '.join(counts)}) with model.target_dtype="
            f"{target_dtype}: the target overflows in that dtype, whatever the head or the learning "
            "rate; set model.target_dtype to float32 (or bfloat16, whose range is float32's)")


def check_finite_grads(head: torch.nn.Module, step: int, batch_idx: int, sources: list[str] | None) -> None:
    """Refuse NaN/inf gradients before the optimizer step (one ``isfinite`` per parameter, one sync), so that
    the weights stay finite.

    Args:
        head: the draft head after backward.
        step: the optimizer step about to be taken (``trainer.global_step``).
        batch_idx, sources: the last training batch's index and record names (None: not named).

    Raises:
        NonFiniteTrainingError: naming the parameters, the step and the last batch's source.
    """
    named = [(k, p.grad) for k, p in head.named_parameters() if p.grad is not None]
    if not named or bool(torch.stack([torch.isfinite(g).all() for _, g in named]).all()):
        return
    bad = [k for k, g in named if not bool(torch.isfinite(g).all())]
    raise NonFiniteTrainingError(
        f"non-finite gradients of {', '.join(bad)} at optimizer step {step}, train batch "
        f"{batch_idx} ({', '.join(sources) if sources else 'its records are not named'}); stopped before the "
        "optimizer step, the weights stay finite; lower model.optim.lr or set trainer.gradient_clip_val"
    )


def _nonfinite_tensors(head: torch.nn.Module) -> list[str]:
    """Names of the head's floating-point tensors (parameters and buffers) holding NaN/inf."""
    return [k for k, t in head.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def head_is_finite(head: torch.nn.Module | None) -> bool:
    """True when every floating-point tensor of the head is finite (one ``isfinite().all()`` per tensor), or
    there is no head yet."""
    return head is None or not _nonfinite_tensors(head)


def check_head_finite(head: torch.nn.Module | None, step: int | str) -> None:
    """Refuse to save a checkpoint of a head with NaN/inf tensors (``ModelCheckpoint``'s best/last, an interrupt
    checkpoint): it would resume, evaluate and export into garbage.

    Args:
        head: the draft head (None: nothing to check).
        step: the optimizer step named in the error (``?`` outside a trainer).

    Raises:
        NonFiniteTrainingError: naming the non-finite tensors.
    """
    bad = [] if head is None else _nonfinite_tensors(head)
    if bad:
        raise NonFiniteTrainingError(
            f"not saving a checkpoint at step {step}: the head's {', '.join(bad)} hold NaN/inf; lower "
            "model.optim.lr or set trainer.gradient_clip_val"
        )


# -- no signal -------------------------------------------------------------------------------------------
def check_filter_keeps_tokens(entropy_filter, vocab_size: int) -> None:
    """Refuse an entropy filter that removes every position: entropy is at most ln V nats, so a ``drop``
    threshold above it (or ``downweight: 0``) leaves no trainable token.

    Args:
        entropy_filter: the module's ``EntropyFilterConfig``.
        vocab_size: V, the target's vocabulary.

    Raises:
        ValueError: naming the threshold, ln V and the options to change.
    """
    cfg = entropy_filter
    removes = cfg.mode == "drop" or (cfg.mode == "downweight" and cfg.downweight == 0)
    if removes and cfg.threshold is not None and cfg.threshold > math.log(vocab_size):
        raise ValueError(
            f"no trainable tokens: model.entropy_filter.threshold={cfg.threshold} nats exceeds ln V = "
            f"{math.log(vocab_size):.3f} nats, the largest entropy a {vocab_size}-token distribution can have, "
            f"so mode={cfg.mode} removes every position; lower the threshold or use model.entropy_filter.quantile"
        )


def check_filter_for_target(entropy_filter, target: str) -> None:
    """:func:`check_filter_keeps_tokens` against the vocabulary of ``target``'s config (only the config is read:
    run before Lightning writes anything); nothing is read with the filter off.

    Args:
        entropy_filter: the module's ``EntropyFilterConfig``.
        target: ``model.target``.
    """
    if entropy_filter.mode == "off":
        return
    from transformers import AutoConfig

    from draftkit.artifacts import resolve_model_dir

    config = AutoConfig.from_pretrained(resolve_model_dir(target, "model.target"))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    check_filter_keeps_tokens(entropy_filter, text.vocab_size)


def no_signal(entropy_filter, draft_vocab_size: int, where: str) -> RuntimeError:
    """The error for a run whose batches carry no trainable token.

    Args:
        entropy_filter: the module's ``EntropyFilterConfig``.
        draft_vocab_size: V_d (``model.draft_vocab_size``).
        where: which batches, e.g. ``every one of the 4 training batches of epoch 0``.
    """
    cfg = entropy_filter
    filt = "off" if cfg.mode == "off" else f"{cfg.mode} (threshold {cfg.threshold}, quantile {cfg.quantile})"
    return RuntimeError(
        f"no trainable tokens: {where} had no supervised position after the assistant mask, the entropy filter "
        f"(model.entropy_filter: {filt}) and the draft-vocab mask (the target's top token must be among the "
        f"model.draft_vocab_size={draft_vocab_size} draft ids); the head received no update"
    )


def nothing_to_measure(trainer, draft_vocab_size: int, empty: list[int], monitors: list[str]) -> ValueError:
    """The error for a validation split without a supervised row at some TTT step while a callback
    (``ModelCheckpoint``, ``EarlyStopping``) monitors ``val/tau_sim``, which then can never be logged.

    Args:
        trainer: the Lightning trainer (its datamodule's ``val_set`` and ``hparams`` are named).
        draft_vocab_size: V_d (``model.draft_vocab_size``).
        empty: the TTT steps without a supervised row.
        monitors: the monitored ``val/tau_sim*`` names.
    """
    dm = trainer.datamodule
    hp = getattr(dm, "hparams", {})
    n = len(dm.val_set) if getattr(dm, "val_set", None) is not None else "?"
    return ValueError(
        f"validation has nothing to measure: its {n} sequence(s) (data.val_size={hp.get('val_size')} held out "
        f"from data.path={hp.get('path')}; trainer.limit_val_batches={trainer.limit_val_batches}) have no "
        f"supervised row at TTT step(s) {empty} (step k supervises row p when token p+2+k is an assistant token "
        f"and the target's top token after p+1+k is one of the model.draft_vocab_size="
        f"{draft_vocab_size} draft ids), so {', '.join(monitors)}, which a callback monitors, "
        "is never logged; raise data.val_size (or hold out conversations with longer assistant turns), raise "
        "model.draft_vocab_size or lower model.ttt.steps; "
        + ("stopped at the sanity check, before the first optimizer step" if trainer.sanity_checking
           else f"stopped at optimizer step {trainer.global_step}")
        + ", no checkpoint written"
    )


def check_validation_measured(trainer, empty: list[int], draft_vocab_size: int) -> None:
    """After a validation in which TTT steps ``empty`` had no supervised row (``val/tau_sim`` not logged): raise
    :func:`nothing_to_measure` during fit when a callback monitors ``val/tau_sim``, at the sanity check when it
    saw every validation batch (the rows depend only on the data, the target and the draft vocab, not on the
    head's weights: it already knows, before the first optimizer step), else at the first validation; warn
    otherwise.

    Raises:
        ValueError: :func:`nothing_to_measure`.
    """
    monitors = sorted({str(cb.monitor) for cb in trainer.callbacks
                       if str(getattr(cb, "monitor", None) or "").startswith("val/tau_sim")})
    complete = not trainer.sanity_checking or trainer.num_sanity_val_batches == trainer.num_val_batches
    if monitors and complete and trainer.state.fn == "fit":
        raise nothing_to_measure(trainer, draft_vocab_size, empty, monitors)
    log.warning("val/tau_sim not logged: TTT steps %s had no supervised row in validation", empty)


def warn_low_draft_coverage(coverage: float, draft_vocab_size: int) -> bool:
    """Warn when ``val/draft_coverage`` (the fraction of scored validation rows whose target top token is a draft
    id) is below :data:`LOW_DRAFT_COVERAGE`; return whether it warned."""
    if coverage >= LOW_DRAFT_COVERAGE:
        return False
    log.warning(
        "validation: the target's top token is a draft id at only %.1f%% of the scored positions; "
        "val/acc_k and val/tau_sim count the others as misses (as decoding rejects them): raise "
        "model.draft_vocab_size (now %d) or train on data the target answers like", 100 * coverage,
        draft_vocab_size)
    return True


def warn_uniform_head(loss_0: float, acc_0: float, draft_vocab_size: int, step: int, lr: float) -> bool:
    """Warn when the head, past its warmup, is flat (a uniform distribution over the draft vocab) or blown up;
    return whether it warned.

    The step-0 loss is the soft cross-entropy against the target's distribution over the ``V_d`` draft ids
    (``draftkit.models.ttt.soft_ce``), so a uniform draft distribution scores exactly ln(V_d) nats whatever the
    target: within :data:`UNIFORM_MARGIN` of it the head is flat, above :data:`BLOWN_UP` x ln(V_d) it is blown up.
    A learning rate far too high does either: ``model.optim.lr`` 1e6 flattens the tiny recipe's head to exactly
    ln 64 = 4.1589 nats (val/acc_0 0.0), 1e2 blows it up to millions of nats, while 1e-3 passes 4.188 at step 4 and
    reaches 4.1488 at step 40 on the same (nearly uniform) tiny target. A learning head may score above ln(V_d)
    early, so only the two extremes warn.

    Args:
        loss_0: ``val/loss_0``, nats per supervised row.
        acc_0: ``val/acc_0`` (fraction).
        draft_vocab_size: V_d.
        step: the optimizer step of the validation.
        lr: ``model.optim.lr`` (named in the warning).
    """
    uniform = math.log(draft_vocab_size)
    if abs(loss_0 - uniform) <= UNIFORM_MARGIN:
        what = "is a uniform guess's over the %d draft ids (ln %d = %.4f)" % ((draft_vocab_size,) * 2 + (uniform,))
    elif loss_0 > BLOWN_UP * uniform:
        what = "is over %g times a uniform guess's over the %d draft ids (ln %d = %.4f)" % (
            BLOWN_UP, draft_vocab_size, draft_vocab_size, uniform)
    else:
        return False
    log.warning(
        "validation at step %d: the head's step-0 loss %.4g nats %s, val/acc_0 %.3f: the head is not learning. A "
        "learning rate far too high flattens or blows up a head: model.optim.lr is %g (the recipes train at 1e-4 with "
        "AdamW, 2e-3 with Muon); lower it and start the run again (its checkpoints hold the broken head)",
        step, loss_0, what, acc_0, lr)
    return True
