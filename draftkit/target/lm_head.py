"""``TargetLMHead``: the few target weights that offline training needs, loaded without the target.

Offline training (``draftkit.data.hidden_cache``) reads the aux and last hidden states from a cache, so of the
target it needs only its config (to size the head), its input embedding (copied into the head once) and its
LM head (teacher logits z = W_lm · last_hidden_state, soft-capped as the target's forward does). Both tensors are read by name from the target's
safetensors files; the model itself is only instantiated on the ``meta`` device to learn those names. One decoder
layer's tensors are read the same way on demand (``decoder_layer_state``: ``model.init_decoder_from_target_layer``).

Shapes: B batch, T tokens, H_t target hidden, V target vocab.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from draftkit.target.frozen import (
    TargetFacts, check_decoder_layer, load_target, rms_norm_scale, target_logits, text_config,
)
from draftkit.selection.layers import validate_aux_layer_ids

__all__ = ["TargetLMHead", "load_target_lm_head"]

log = logging.getLogger(__name__)


class TargetLMHead(TargetFacts):
    """Frozen target LM head plus the target facts ``Eagle3Module.build`` reads (``FrozenTarget``'s API
    without the decoder layers).

    Args:
        config: the target's (text) ``PretrainedConfig``.
        embed_weight: (V, H_t) input embedding.
        lm_head_weight: (V, H_t) output projection, in the target dtype.
        aux_layer_ids: HF ``hidden_states`` indices, or None for [2, N//2, N-3].
        final_norm_weight: (H_t,) float32 scale of the final RMSNorm (``rms_norm_scale``: the weight for Llama,
            1 + weight for Gemma), or None if the checkpoint has none.
        layer_reader: index -> that decoder layer's tensors by name within the layer, read on demand by
            :meth:`decoder_layer_state` (the draft layer's initialisation); None = no layer can be read.

    Raises:
        ValueError: on invalid aux ids or weights whose shapes do not match the config.
    """

    def __init__(
        self, config, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, aux_layer_ids=None,
        final_norm_weight: torch.Tensor | None = None,
        layer_reader: Callable[[int], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, self.num_layers)
        shape = (config.vocab_size, config.hidden_size)
        if tuple(embed_weight.shape) != shape or tuple(lm_head_weight.shape) != shape:
            raise ValueError(
                f"target weights {tuple(embed_weight.shape)}, {tuple(lm_head_weight.shape)} do not match its "
                f"config (vocab {shape[0]}, hidden {shape[1]})"
            )
        self._embed = embed_weight  # not a module tensor: only copied into the head once
        self._final_norm = final_norm_weight
        self._layer_reader = layer_reader
        # a frozen parameter, not a buffer: DDP would broadcast buffers on every forward
        self.lm_head = nn.Parameter(lm_head_weight, requires_grad=False)

    def input_embeddings(self) -> torch.Tensor:
        """(V, H_t) input embedding weight."""
        return self._embed

    def lm_head_weight(self) -> torch.Tensor:
        """(V, H_t) output projection weight."""
        return self.lm_head

    def final_norm_weight(self) -> torch.Tensor | None:
        """(H_t,) float32 scale of the target's final RMSNorm (``rms_norm_scale``), or None."""
        return self._final_norm

    def decoder_layer_state(self, index: int) -> dict[str, torch.Tensor]:
        """The tensors of decoder layer ``index`` (:func:`~draftkit.target.frozen.check_decoder_layer`) by their
        names within the layer, in the target dtype, read from the target's files now (the decoder layers are
        not kept).

        Raises:
            ValueError: when ``index`` is not a layer of the target, or this instance has no ``layer_reader``.
        """
        check_decoder_layer(index, self.num_layers)
        if self._layer_reader is None:
            raise ValueError("this TargetLMHead was built without a layer_reader: it cannot read a decoder layer")
        return self._layer_reader(index)

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "offline mode: only the target's LM head is loaded, not its decoder layers; code that runs the target "
            "(e.g. an acceptance-length callback) needs online mode or its own target (load_target)"
        )

    @torch.no_grad()
    def logits(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """Teacher logits z = last_hidden_state @ W_lm^T in the target dtype, soft-capped where the target's
        config sets ``final_logit_softcapping`` (:func:`~draftkit.target.frozen.target_logits`).

        Args:
            last_hidden_state: (B, T, H_t) ``hidden_states[N]`` after the final norm (bf16 from a cache).

        Returns:
            (B, T, V) logits.
        """
        return target_logits(self.lm_head, last_hidden_state, self.config)  # (B, T, V)


def _decoder_layer_from_files(path: Path, dtype: torch.dtype, index: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``index``'s tensors, named within the layer, read by name from the safetensors at ``path``.

    Raises:
        ValueError: when one of the layer's tensors is missing from the files (names them).
    """
    from transformers import AutoConfig

    from draftkit.artifacts import safetensors_weight_map

    model = _meta_model(AutoConfig.from_pretrained(path))
    layer = model.get_decoder().layers[index]
    prefix = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}[id(layer)]
    names = {f"{prefix}.{k}": k for k in layer.state_dict()}
    tensors = _read_tensors(safetensors_weight_map(path) or {}, list(names))
    lost = sorted(set(names) - set(tensors))
    if lost:
        raise ValueError(f"no tensors {lost} of decoder layer {index} in {path}")
    return {k: tensors[n].to(dtype) for n, k in names.items()}


def _decoder_layer_from_model(ref: str, dtype: torch.dtype, index: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``index``'s tensors from the whole target loaded again (targets without local safetensors)."""
    model, _ = load_target(ref, dtype)
    return {k: v.clone() for k, v in model.get_decoder().layers[index].state_dict().items()}


def _meta_model(config) -> nn.Module:
    """The target's ``*ForCausalLM`` instantiated on the ``meta`` device (names and shapes, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _weight_names(config) -> tuple[str, str, str | None, nn.Module | None]:
    """Checkpoint names of the input embedding, LM head and final norm weights (from a meta-device instance),
    and that meta instance's final norm module; the last two are None when the base model has no ``norm``."""
    model = _meta_model(config)
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    norm = getattr(model.get_decoder(), "norm", None)
    norm_name = f"{names[id(norm)]}.weight" if norm is not None else None
    return f"{names[id(emb)]}.weight", f"{names[id(out)]}.weight", norm_name, norm


def _read_tensors(weight_map: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors (those present) through ``weight_map`` (``draftkit.artifacts.safetensors_weight_map``)."""
    from safetensors import safe_open

    out = {}
    for name in names:
        if name in weight_map:
            with safe_open(str(weight_map[name]), framework="pt") as f:
                out[name] = f.get_tensor(name)
    return out


def load_target_lm_head(ref: str, dtype: str | torch.dtype = "auto", aux_layer_ids=None) -> TargetLMHead:
    """Load a target's config, input embedding and LM head (not the decoder layers).

    Falls back to loading the whole target when its weights are not local safetensors (a hub id, ``.bin``).

    Args:
        ref: target reference (see ``draftkit.artifacts.resolve_model_dir``).
        dtype: the target dtype the teacher logits are computed in (``auto``: ``draftkit.precision``).
        aux_layer_ids: HF ``hidden_states`` indices, or None for the default.

    Returns:
        :class:`TargetLMHead`.

    Raises:
        ValueError: when the LM head is missing and the embeddings are not tied.
    """
    from transformers import AutoConfig

    from draftkit.artifacts import resolve_model_dir, safetensors_weight_map
    from draftkit.precision import as_torch_dtype, default_device

    torch_dtype = as_torch_dtype(dtype, default_device(), "target dtype")
    path = Path(resolve_model_dir(ref))
    weight_map = safetensors_weight_map(path)
    if weight_map is None:
        log.info("target %s has no local safetensors; loading the whole target for its LM head", ref)
        model, _ = load_target(ref, torch_dtype)
        cfg = text_config(model.config)
        norm = getattr(model.get_decoder(), "norm", None)
        return TargetLMHead(cfg, model.get_input_embeddings().weight.detach(),
                            model.get_output_embeddings().weight.detach(), aux_layer_ids,
                            rms_norm_scale(norm) if norm is not None else None,
                            functools.partial(_decoder_layer_from_model, ref, torch_dtype))
    config = AutoConfig.from_pretrained(path)
    text_cfg = text_config(config)
    emb_name, head_name, norm_name, norm = _weight_names(config)
    tensors = _read_tensors(weight_map, [n for n in (emb_name, head_name, norm_name) if n is not None])
    if emb_name not in tensors:
        raise ValueError(f"target {ref}: no tensor {emb_name!r} in {path}")
    head = tensors.get(head_name)
    if head is None:
        if not getattr(text_cfg, "tie_word_embeddings", False):
            raise ValueError(f"target {ref}: no tensor {head_name!r} in {path} and the embeddings are not tied")
        head = tensors[emb_name]
    log.info("offline mode: loaded %s and %s of %s (not the decoder layers)", emb_name, head_name, ref)
    norm_weight = tensors.get(norm_name)
    return TargetLMHead(text_cfg, tensors[emb_name].to(torch_dtype), head.to(torch_dtype).clone(), aux_layer_ids,
                        None if norm_weight is None else rms_norm_scale(norm, norm_weight),
                        functools.partial(_decoder_layer_from_files, path, torch_dtype))
