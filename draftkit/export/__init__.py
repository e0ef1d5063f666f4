"""Export trained EAGLE3 heads for serving engines: vLLM, speculators (vLLM), SGLang, TensorRT-LLM.

This package is the only place where aux-layer ids leave draftkit's HF ``hidden_states`` convention: each
engine module (``vllm``, ``speculators``, ``sglang``, ``trtllm``) has one conversion function that states its
rule. ``load`` holds the reference loader and a plain reference forward (eagle3-format.md §3); ``cli.main`` is
the ``python -m draftkit export`` command.

Shapes: H draft hidden, H_t target hidden, V target vocab, V_d draft vocab, N target layers.
"""

from draftkit.export.cli import main
from draftkit.export.common import DTYPES, ENGINES
from draftkit.export.exporter import export_checkpoint, verify_export
from draftkit.export.load import load_exported_head, reference_forward
from draftkit.heads.checkpoint import HeadSource, read_checkpoint

__all__ = [
    "DTYPES",
    "ENGINES",
    "HeadSource",
    "export_checkpoint",
    "load_exported_head",
    "main",
    "read_checkpoint",
    "reference_forward",
    "verify_export",
]
