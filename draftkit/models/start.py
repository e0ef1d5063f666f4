"""The head a training run starts from: its draft vocab and its first weights (``Eagle3Module.build``).

The draft vocab is the data's most frequent assistant tokens (``VocabMap.from_counts``), the identity when
V_d = V, or a trained head's map (``model.init_head``, whose ``lm_head`` rows are its ids). The head's shape comes
from the target's config; its weights start random, or from the target (``model.init_from_target``: ``lm_head``
rows and final norm; ``model.init_decoder_from_target_layer``: a decoder layer), or from a trained head
(``draftkit.models.init_head``).

Shapes: V target vocab, V_d draft vocab, H draft hidden, H_t target hidden.
"""

from __future__ import annotations

import logging

import torch

from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.selection.vocab import VocabMap

__all__ = ["check_start_options", "draft_vocab", "read_init", "start_head"]

log = logging.getLogger(__name__)


def check_start_options(init_from_target: bool, freeze_lm_head: bool, init_head: str | None,
                        init_decoder_from_target_layer: int | None) -> None:
    """Refuse start options that contradict each other (``Eagle3Module.__init__``, before anything loads).

    Raises:
        ValueError: ``freeze_lm_head`` without ``init_from_target`` (a frozen random ``lm_head`` never learns), or
            both ``init_head`` and ``init_decoder_from_target_layer`` (both start the draft decoder layer).
    """
    if freeze_lm_head and not init_from_target:
        raise ValueError(
            "model.freeze_lm_head: true keeps lm_head at the target's rows, so it needs model.init_from_target: "
            "true (a frozen random lm_head would never learn); set both, or leave freeze_lm_head false"
        )
    if init_head is not None and init_decoder_from_target_layer is not None:
        raise ValueError(
            "model.init_head and model.init_decoder_from_target_layer both start the draft decoder layer: set one "
            "(init_head continues a trained head; init_decoder_from_target_layer starts a new one from a target layer)"
        )


def read_init(hp, aux_layer_ids: list[int], resuming: str | None):
    """The ``model.init_head`` head to start from (``init_head.read_init_head``) and the longest sequence it was
    trained on (tokens; 0 when not recorded), or (None, 0): without the option, and when resuming (``fit
    --ckpt_path``: the checkpoint holds the weights, d2t/t2d and trained length; the file may be gone).

    Args:
        hp: the module's hyperparameters (``init_head``, ``target``, ``draft_vocab_size``).
        aux_layer_ids: this run's resolved aux layer ids.
        resuming: the checkpoint a resumed run continues from, or None.

    Raises:
        FileNotFoundError, ValueError: as ``read_init_head``.
    """
    if not hp.init_head:
        return None, 0
    if resuming:
        log.info("model.init_head %s: not read, resuming from %s", hp.init_head, resuming)
        return None, 0
    from draftkit.models.init_head import read_init_head

    head, meta = read_init_head(hp.init_head, hp.target, aux_layer_ids, hp.draft_vocab_size)
    return head, int(meta.get("trained_length") or 0)


def draft_vocab(vocab_size: int, draft_vocab_size: int, counts: torch.Tensor | None, init=None,
                init_head: str | None = None) -> VocabMap:
    """The run's draft vocab map (d2t/t2d), validated.

    Args:
        vocab_size: V, the target's vocabulary.
        draft_vocab_size: V_d (``model.draft_vocab_size``).
        counts: (V,) int64 counts of target ids at the training split's assistant positions, or None (no
            datamodule).
        init: the ``model.init_head`` head (``read_init_head``), whose map replaces the counted one; or None.
        init_head: ``model.init_head`` as configured (a resumed run does not read it: the identity then stands in
            until the checkpoint's d2t/t2d are loaded).

    Raises:
        ValueError: when V_d < V without counts or an init head, or the map is invalid (``VocabMap.validate``).
    """
    if counts is not None:
        vocab = VocabMap.from_counts(counts, draft_vocab_size)
    elif draft_vocab_size == vocab_size or init_head:
        vocab = VocabMap.from_ids(torch.arange(vocab_size), vocab_size)
    else:
        raise ValueError("a draft vocab smaller than the target's needs a datamodule to count tokens")
    if init is not None:  # a trained head's map replaces the counted one (its lm_head rows are its ids)
        vocab = VocabMap(d2t=init.d2t.clone(), t2d=init.t2d.clone())
    vocab.validate()
    return vocab


def start_head(target, vocab: VocabMap, hp, init=None) -> Eagle3LlamaHead:
    """Build the head for ``target`` and set its first weights.

    Args:
        target: the run's ``FrozenTarget`` or ``TargetLMHead`` (``config``, ``aux_layer_ids``,
            ``input_embeddings()``, ``lm_head_weight()``, ``final_norm_weight()``, ``decoder_layer_state(i)``).
        vocab: the draft vocab map (:func:`draft_vocab`).
        hp: the module's hyperparameters: ``draft_vocab_size``, the head options (``norm_before_residual``,
            ``norm_before_fc``, ``fc_norm``, ``norm_output``), ``init_from_target``, ``freeze_lm_head``,
            ``init_decoder_from_target_layer`` and ``init_head`` (named in messages).
        init: the ``model.init_head`` head to copy the weights of, or None.

    Returns:
        The head (float32, train mode) with the vocab map and the target's input embedding loaded, ``lm_head``
        frozen under ``freeze_lm_head``.

    Raises:
        ValueError: when the init head's shape differs (``check_same_head_shape``), or the target layer of
            ``init_decoder_from_target_layer`` does not fit the head, naming the option.
    """
    cfg = Eagle3Config.from_target_config(
        target.config, target.aux_layer_ids, hp.draft_vocab_size,
        norm_before_residual=hp.norm_before_residual, norm_before_fc=hp.norm_before_fc,
        fc_norm=hp.fc_norm, norm_output=hp.norm_output,
    )
    head = Eagle3LlamaHead(cfg)
    head.set_vocab(vocab.d2t, vocab.t2d)
    head.load_embedding(target.input_embeddings())  # copy_ converts: no float32 copy of the table on its device
    if hp.init_from_target:
        norm = target.final_norm_weight()
        head.init_from_target(target.lm_head_weight(), norm)  # copy_ converts: no float32 (V, H) copy on its device
    if init is not None:
        from draftkit.models.init_head import check_same_head_shape, load_into

        check_same_head_shape(init.config, cfg, hp.init_head)
        load_into(head, init)
        log.info("model.init_head: starting from the weights and draft vocab of %s", hp.init_head)
    head.lm_head.weight.requires_grad_(not hp.freeze_lm_head)
    layer = hp.init_decoder_from_target_layer
    if layer is not None:
        try:
            head.init_decoder_from_target_layer(target.decoder_layer_state(layer), target.config)
        except ValueError as e:
            raise ValueError(f"model.init_decoder_from_target_layer={layer}: {e}; choose another layer or set "
                             f"it to null (random)") from e
    return head
