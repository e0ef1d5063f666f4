"""Export trained EAGLE3 heads for serving engines: vLLM, speculators (vLLM), SGLang, TensorRT-LLM, llama.cpp.

This package is the only place where aux-layer ids leave draftkit's HF ``hidden_states`` convention: each
engine module has one conversion function that states its rule. Engines are a registry, :data:`ENGINES`
(name -> module); a new engine is one module with the names below, added with :func:`register_engine`, and
``draftkit export --to``, ``ExportOnCheckpoint``, the exporter and the loader offer it without another edit:

- ``ENGINE`` (its name), ``ENGINE_VERSION``, ``LAYER_PREFIX`` (``midlayer.`` or ``layers.0.``), optional
  ``EXPORT_DIR`` (its sub-directory under a run's ``export/``; default ``ENGINE``);
- ``build_files(source, out_dir, dtype_name, k, options) -> {"config", "engine_aux_layer_ids"[, "text_files",
  "engine_version", "sidecar", "speculation"]}``; ``options["tree"]`` is the ``TreeConfig`` of a tree export
  (k is then its depth) and ``speculation`` the engine's settings for it, recorded in the sidecar;
- ``read_view(directory, config, sidecar) -> (layer fields, EAGLE fields, written aux ids)``;
- ``from_engine_ids(written, num_layers, sidecar) -> HF ids``;
- ``launch_command(source, out_dir, k[, tree]) -> str``; an engine without the ``tree`` keyword exports chains
  only.

An engine with its own weight file (llama.cpp's one GGUF) also has ``read_files(directory, sidecar) -> (config
view, tensors by draftkit name)``, returns ``config`` None, ``write_weights(tensors, tmp_dir)`` and ``launch`` from
``build_files``, and may add ``EXTRA_DTYPES`` (``q8_0``) and ``round_weights(state, dtype)`` (what the export
self-check compares against).

``speculation`` holds the speculation shape (chain k, or tree depth/top-k/N, by hand or from an evaluate
report) that ``draftkit export --tree`` / ``--from_report`` give the exporter.

``load`` holds the reference loader and a plain reference forward (eagle3-format.md §3).

Shapes: H draft hidden, H_t target hidden, V target vocab, V_d draft vocab, N target layers.
"""

from types import ModuleType

from draftkit.export import llamacpp, sglang, speculators, trtllm, vllm
from draftkit.export.common import EXPORT_DTYPES

ENGINES: dict[str, ModuleType] = {m.ENGINE: m for m in (vllm, speculators, sglang, trtllm, llamacpp)}
"""The engine registry: name -> engine module."""


def register_engine(module: ModuleType) -> ModuleType:
    """Add an engine module to :data:`ENGINES` under its ``ENGINE`` name.

    Raises:
        ValueError: if the module lacks a name of the protocol (listed in this package's docstring).
    """
    missing = [n for n in ("ENGINE", "ENGINE_VERSION", "LAYER_PREFIX", "build_files", "read_view",
                           "from_engine_ids", "launch_command") if not hasattr(module, n)]
    if missing:
        raise ValueError(f"engine module {module.__name__} lacks {missing}; see draftkit.export's docstring")
    ENGINES[module.ENGINE] = module
    return module


from draftkit.export.exporter import export_checkpoint, verify_export  # noqa: E402  (engines first)
from draftkit.export.load import load_exported_head, load_head, reference_forward  # noqa: E402
from draftkit.export.speculation import Speculation  # noqa: E402
from draftkit.heads.checkpoint import HeadSource, read_checkpoint  # noqa: E402

__all__ = [
    "EXPORT_DTYPES",
    "ENGINES",
    "HeadSource",
    "Speculation",
    "export_checkpoint",
    "load_exported_head",
    "load_head",
    "read_checkpoint",
    "reference_forward",
    "register_engine",
    "verify_export",
]
