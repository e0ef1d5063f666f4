"""Tiny offline targets for recipes and tests: a seeded random Llama with a byte-level tokenizer.

``tiny:llama`` in a recipe's ``model.target`` builds (once, into the draftkit cache) a Llama with
vocab 320, hidden 64, 8 layers (default aux ids [2, 4, 5]), 4 heads, 2 KV heads, and a byte-level BPE
tokenizer with a ChatML template; nothing is downloaded. :data:`TINY_FAMILIES` holds the same kind of tiny random
target for other families (Qwen3-MoE, GPT-OSS, DeepSeek-V3, Gemma 2, Gemma 3 and 4 text), built from their transformers
configs with ``build_tiny_target(dest, family=...)``; ``tiny:<family>`` (any key of it) names one in a recipe.
"""

from __future__ import annotations

from pathlib import Path

from draftkit.jsonio import atomic_path

__all__ = ["HOST_READ_OPS", "TINY_FAMILIES", "TINY_LLAMA", "DeviceFactoryCheck", "HostReadCounter",
           "build_tiny_target", "tiny_family_config", "tiny_llama_config"]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_LLAMA = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False,
)


def tiny_llama_config(**overrides):
    """``LlamaConfig`` of the tiny target."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


_COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=8, max_position_embeddings=512,
               bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False)
# family -> (transformers config class, fields over _COMMON): 8 layers (default aux ids [2, 4, 5]), hidden 64,
# MoE with 4 experts top-2, MLA with small ranks, sliding-window layers with a window shorter than the tests'
# sequences (so the sliding path runs)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", {k: v for k, v in TINY_LLAMA.items() if k not in _COMMON}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)),
    "gpt_oss": ("GptOssConfig", dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
    "gemma2": ("Gemma2Config", dict(  # final-logit soft-cap 30.0 and attention soft-cap 50.0 (the defaults)
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8)),
    "gemma4_text": ("Gemma4TextConfig", dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        vocab_size_per_layer_input=320, hidden_size_per_layer_input=8)),
}


def tiny_family_config(family: str, **overrides):
    """The transformers config of the tiny random target of ``family`` (a key of :data:`TINY_FAMILIES`).

    Raises:
        ValueError: on an unknown family (names the known ones).
    """
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny target family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    name, fields = TINY_FAMILIES[family]
    return getattr(transformers, name)(**{**_COMMON, **fields, **overrides})


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<pad>"})
    fast.chat_template = CHATML
    return fast


def build_tiny_target(dest: str | Path, seed: int = 0, family: str = "llama", **overrides) -> Path:
    """Write a seeded tiny random causal LM of ``family`` (``tiny_family_config``) and the byte-level ChatML
    tokenizer to ``dest`` (atomic); return the path. An existing ``dest`` is returned as it is."""
    import torch
    from transformers import AutoModelForCausalLM

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    with atomic_path(dest, directory=True) as tmp:
        with torch.random.fork_rng():  # leave the caller's random state alone
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_family_config(family, **overrides))
        model.save_pretrained(tmp)
        _byte_tokenizer().save_pretrained(tmp)
    return dest


class DeviceFactoryCheck:
    """Records every tensor factory call made from draftkit's own code without a ``device``: on a GPU such a
    tensor lands on the CPU (a device mismatch, or a silent host copy), so CPU tests can catch it.

    A ``torch.overrides.TorchFunctionMode`` sees the factories (``torch.zeros``, ``arange``, ``full``, ``tensor``,
    ...) before they run; a call whose innermost caller frame lies below ``roots`` (default: the ``draftkit``
    package and the installed ``draftkit.callbacks``) and that passes no ``device`` is recorded as
    ``"file:line function"``. ``as_tensor``/``tensor`` of a tensor keep its device and are not recorded; the
    ``*_like`` and ``Tensor.new_*`` forms take their device from a tensor and are not factories here.

    Use::

        with DeviceFactoryCheck() as check:
            run_the_step()
        assert check.violations == []

    Attributes:
        violations: sorted, unique call sites.
    """

    FACTORIES = ("zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
                 "randperm", "eye", "linspace")

    def __init__(self, roots: tuple[str, ...] | None = None) -> None:
        import draftkit

        if roots is None:
            roots = (str(Path(draftkit.__file__).parent),)
            import importlib.util

            spec = importlib.util.find_spec("draftkit.callbacks")  # located, not imported (it sits above this floor)
            if spec is not None and spec.origin:
                roots += (str(Path(spec.origin).parent),)
        self.roots = tuple(roots)
        self.violations: list[str] = []
        self._mode = None

    def __enter__(self) -> DeviceFactoryCheck:
        import sys

        import torch
        from torch.overrides import TorchFunctionMode

        factories = {getattr(torch, name) for name in self.FACTORIES}
        check = self
        here = str(Path(__file__).resolve())

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in factories and kwargs.get("device") is None and not (
                        args and isinstance(args[0], torch.Tensor)):
                    frame = sys._getframe(1)
                    while frame is not None and frame.f_code.co_filename == here:
                        frame = frame.f_back
                    if frame is not None and frame.f_code.co_filename.startswith(check.roots):
                        site = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
                        if site not in check.violations:
                            check.violations.append(site)
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.violations.sort()


HOST_READ_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2")
"""Aten ops that copy a device value to the host or size a tensor by its data (``.item()``, ``int(t)``, ``float(t)``,
``bool(t)``, a 0-d tensor index, boolean indexing, ``.nonzero()``, ``unique``): on CUDA each one is a sync."""


class HostReadCounter:
    """Counts the :data:`HOST_READ_OPS` run while active, on any device (a ``TorchDispatchMode``), so CPU tests and
    benchmarks see the syncs a GPU would pay.

    Args:
        skip: package names (e.g. ``("transformers",)``) whose own reads are left out: a read is not counted when
            any frame of its call stack lies in a folder so named.

    Attributes:
        counts: ``collections.Counter``, op name -> calls.

    Use::

        with HostReadCounter() as reads:
            run_a_round()
        assert sum(reads.counts.values()) == 1
    """

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        import collections

        self.counts: collections.Counter = collections.Counter()
        self.skip = skip
        self._mode = None

    def __enter__(self) -> HostReadCounter:
        import os
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        folders = tuple(f"{os.sep}{name}{os.sep}" for name in self.skip)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in HOST_READ_OPS and not (folders and any(
                        f in frame.filename for frame in traceback.extract_stack() for f in folders)):
                    counter.counts[name] += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def end_process_group() -> None:
    """End a test rank's ``torch.distributed`` process group cleanly: collect what still holds its tensors and
    groups (DTensors, a device mesh: ``del`` them in the caller first), wait for every rank, then destroy the group.

    Without the collection and the barrier a gloo rank sometimes aborted at interpreter exit, after its work was
    done ("terminate called without an active exception", SIGABRT, about 1 run in 15 on 2 loaded cores): a gloo
    worker thread outlived the group it served."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
