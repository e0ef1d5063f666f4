"""AcceptanceLengthMonitor: real speculative decoding on held-out prompts during ``fit``.

Unlike ``val/tau_sim`` (an estimate from per-step TTT accuracies, eagle3-format.md §8.3), this runs the
chain speculative decoder of ``draftkit.decoding`` with the head being trained against the frozen target
and logs the measured acceptance length (bonus token counted) and per-position acceptance:
``val/accept_len``, ``val/accept_rate_pos{i}`` (alpha_i, i = 1..k), ``val/acceptance_rate`` and
``val/kl_pos{i}`` (KL on the draft vocab, target renormalised over it), ``val/outside_mass_pos{i}`` (target
mass outside the draft vocab) and ``val/expected_accept_pos{i}`` (sum min(p, q) = 1 - TV(p, q)); see
``draftkit.decoding.metrics``. With ``tree`` set it also decodes that tree (EAGLE-2's dynamic tree, what SGLang and
TensorRT-LLM serve) on the same prompts and logs ``val/tree_accept_len`` and ``val/tree_accept_rate_pos{i}``.

Shapes: none (scalars only).
"""

from __future__ import annotations

import logging

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from draftkit.data.prompts import load_prompts
from draftkit.decoding.harness import Topology, evaluate_drafter
from draftkit.decoding.tree import Eagle3TreeDrafter, TreeConfig
from draftkit.heads.checkpoint import check_head_matches_target
from draftkit.decoding.metrics import DISTRIBUTION_METRICS
from draftkit.decoding.drafters import Eagle3Drafter
from draftkit.target.frozen import FrozenTarget
from draftkit.target.lm_head import TargetLMHead
from draftkit.target.sharding import target_mesh

__all__ = ["AcceptanceLengthMonitor"]

log = logging.getLogger(__name__)


class AcceptanceLengthMonitor(Callback):
    """Measures acceptance length tau by speculative decoding on a few prompts every N validations.

    Reads from the LightningModule only: ``head`` (an ``Eagle3LlamaHead``), ``target`` (a
    ``FrozenTarget``), the tokenizer (``load_target_model()[1]`` or a ``tokenizer`` attribute) and
    ``chat_template`` (None = the tokenizer's). In offline mode (``target`` is the LM-head-only
    ``TargetLMHead`` of a hidden-state-cache run) the monitor builds its own ``FrozenTarget`` from
    ``load_target_model()[0]`` once, on the module's device, since decoding needs every target layer.
    Decoding runs under ``torch.no_grad`` with the head in eval mode; its training mode is restored afterwards.
    Single-stream, on the global rank 0 only; under ``trainer.strategy fsdp_target`` (the target sharded across
    the ranks, no rank holds it whole) every rank decodes the same prompts in lockstep, since each target forward
    gathers its layers from all ranks: rank 0's first token and each round's accepted drafts and next token are
    broadcast and applied on every rank (``decoding.verify.Sync``), so that a rank whose greedy picks differ
    (non-deterministic GPU reductions) cannot stop early or run another number of forwards and hang the others;
    rank 0's values are reported.
    Measured at a validation, the values go through ``pl_module.log`` (all ranks log rank 0's values, so
    ``ModelCheckpoint(monitor="val/accept_len")`` works); measured at a training step, they are written to
    the trainer's loggers at that step.

    Args:
        every_n_validations: measure at the end of every N-th validation run (the sanity check excluded).
        every_n_train_steps: measure every this many optimizer steps instead (None = by validations).
        num_prompts: first prompts of ``prompts`` decoded per measurement.
        k: draft tokens per round (chain).
        max_new_tokens: tokens generated per prompt.
        temperature: 0 = greedy (the acceptance of a greedy chain).
        prompts: ``mt-bench`` or a JSONL/JSON prompt file (see ``draftkit.data.prompts.load_prompts``).
        seed: sampling seed (temperature > 0).
        tree: also decode this tree, ``DEPTH,TOPK,N`` as ``draftkit evaluate --tree`` takes it (e.g. ``5,4,16``),
            optionally with a prompt-lookup hybrid suffix (``+lookup=8``); None: the chain only.

    Raises:
        ValueError: if every_n_validations, every_n_train_steps, num_prompts, k or max_new_tokens is smaller
            than 1, the temperature is negative, or ``tree`` is no tree shape (naming it).
    """

    def __init__(
        self,
        every_n_validations: int = 1,
        every_n_train_steps: int | None = None,
        num_prompts: int = 8,
        k: int = 5,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        prompts: str = "mt-bench",
        seed: int = 0,
        tree: str | None = None,
    ) -> None:
        for name, value in (("every_n_validations", every_n_validations), ("num_prompts", num_prompts), ("k", k),
                            ("max_new_tokens", max_new_tokens), ("every_n_train_steps", every_n_train_steps)):
            if value is not None and value < 1:
                raise ValueError(f"AcceptanceLengthMonitor {name} must be >= 1, got {value}")
        if not temperature >= 0:
            raise ValueError(f"AcceptanceLengthMonitor temperature must be >= 0 (0 = greedy), got {temperature}")
        self.every_n_validations = every_n_validations
        self.every_n_train_steps = every_n_train_steps
        self.num_prompts = num_prompts
        self.k = k
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.prompts = prompts
        self.seed = seed
        self.tree = tree
        self._sweep = [] if tree is None else [Topology.of(TreeConfig.parse(tree, "AcceptanceLengthMonitor tree",
                                                                            auto=False))]
        self._prompts = None
        self._offline_target = None
        self._validations = 0
        self._last_step = -1
        self.last_report: dict | None = None
        self.history: list[tuple[int, float]] = []  # (global step, tau)

    # -- hooks ----------------------------------------------------------------------------------------------
    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.every_n_train_steps is not None:
            return
        self._validations += 1
        if self._validations % self.every_n_validations == 0:
            self._measure(trainer, pl_module, from_validation=True)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        n, step = self.every_n_train_steps, trainer.global_step
        if n is not None and step > 0 and step % n == 0 and step != self._last_step:
            self._measure(trainer, pl_module, from_validation=False)

    # -- measurement ----------------------------------------------------------------------------------------
    def build_drafter(self, pl_module: LightningModule):
        """The drafter to measure; override to measure another drafter in the same report shape."""
        check_head_matches_target(pl_module.head, self._target(pl_module))
        return Eagle3TreeDrafter(pl_module.head) if self._sweep else Eagle3Drafter(pl_module.head)

    def _target(self, pl_module: LightningModule):
        """The module's ``FrozenTarget``; in offline mode one built here from the full target, loaded once."""
        target = pl_module.target
        if not isinstance(target, TargetLMHead):
            return target
        if self._offline_target is None:
            log.info("offline mode: loading the full target once for speculative decoding")
            model = pl_module.load_target_model()[0].to(pl_module.device)
            self._offline_target = FrozenTarget(model, target.aux_layer_ids)
        return self._offline_target

    @staticmethod
    def _tokenizer(pl_module: LightningModule):
        if hasattr(pl_module, "load_target_model"):
            return pl_module.load_target_model()[1]
        return pl_module.tokenizer

    def _measure(self, trainer: Trainer, pl_module: LightningModule, from_validation: bool) -> None:
        self._last_step = trainer.global_step
        # a target sharded across the ranks (trainer.strategy fsdp_target) gathers each layer from all of them:
        # every rank decodes the same prompts and applies rank 0's picks, so their forwards run in lockstep
        everyone = target_mesh(trainer) is not None
        sync = (lambda value: trainer.strategy.broadcast(value, src=0)) if everyone else None
        metrics = self._decode(trainer, pl_module, sync) if trainer.global_rank == 0 or everyone else None
        if trainer.global_rank != 0:
            metrics = None  # rank 0's values are the ones reported
        if from_validation:
            # every rank logs rank 0's values, so that ModelCheckpoint can monitor val/accept_len
            metrics = trainer.strategy.broadcast(metrics, src=0)
            for name, value in metrics.items():
                pl_module.log(name, value)
        elif metrics is not None:
            # on_step logging would be thinned by log_every_n_steps; write this step's values directly
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _decode(self, trainer: Trainer, pl_module: LightningModule, sync=None) -> dict[str, float]:
        if self._prompts is None:
            self._prompts = load_prompts(self.prompts, self.num_prompts)
        head = pl_module.head
        was_training = head.training
        head.eval()
        try:
            report = evaluate_drafter(
                self.build_drafter(pl_module), self._target(pl_module), self._tokenizer(pl_module), self._prompts,
                k=self.k, temperature=self.temperature, max_new_tokens=self.max_new_tokens, seed=self.seed,
                chat_template=getattr(pl_module, "chat_template", None), baseline=False, prompt_lookup=False,
                warmup=False, sync=sync, sweep=self._sweep or None,
            )
        finally:
            head.train(was_training)
        self.last_report = report
        self.history.append((trainer.global_step, report["tau"]))
        metrics = {"val/accept_len": report["tau"], "val/acceptance_rate": report["acceptance_rate"]}
        for i, a in enumerate(report["acceptance_per_position"], 1):
            metrics[f"val/accept_rate_pos{i}"] = a
        for name in DISTRIBUTION_METRICS:
            for i, x in enumerate(report[f"{name}_per_position"] or [], 1):
                if x is not None:
                    metrics[f"val/{name}_pos{i}"] = x
        tree = (report["sweep"] or [None, None])[1]
        if tree is not None:
            metrics["val/tree_accept_len"] = tree["tau"]
            for i, a in enumerate(tree["acceptance_per_position"], 1):
                metrics[f"val/tree_accept_rate_pos{i}"] = a
        log.info("step %d: accept_len %.3f over %d prompts (chain k=%d)%s", trainer.global_step, report["tau"],
                 report["num_prompts"], self.k, f"; tree {self.tree}: {tree['tau']:.3f}" if tree is not None else "")
        return {name: float(value) for name, value in metrics.items()}
