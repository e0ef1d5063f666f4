"""A stand-in for llama.cpp's ``llama-server`` (stdlib only), run as a process by the generate tests.

It takes llama-server's command line, answers ``--version`` like build 11434, serves ``GET /health`` and
``POST /completion`` on ``--host``/``--port``, and logs its command line and every request body as JSON lines to
``$FAKE_LLAMA_LOG``. Answers, as llama.cpp b11434's ``/completion`` with ``return_tokens`` gives them:

- with ``$FAKE_LLAMA_TABLE`` (a JSON file ``{"1,2,3": [new token ids], ...}``): the ids listed for the prompt
  (a prompt not listed gets HTTP 404);
- else: ``k = len(prompt) % 5 + 1`` tokens ``32 + (7 * sum(prompt) + 13 * j) % 200`` then the first id of
  ``$FAKE_LLAMA_EOG`` (default 257);
- cut at ``n_predict`` (``stop_type`` ``limit``) or after an id of ``$FAKE_LLAMA_EOG`` (``eos``);
- ``$FAKE_LLAMA_DIE_AFTER`` = n: the process exits while answering request n + 1.

``GET /metrics`` gives ``llamacpp:n_decode_total``, a counter that moves every 10 ms (a busy server), except
with ``$FAKE_LLAMA_STUCK`` = 1, where it stays and no ``/completion`` is ever answered (a stuck server).
``$FAKE_LLAMA_SLOW_FIRST`` = s: the first ``/completion`` request is answered only after s seconds (a slow one).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
EOG = [int(x) for x in os.environ.get("FAKE_LLAMA_EOG", "257").split(",")]
TABLE = json.loads(open(os.environ["FAKE_LLAMA_TABLE"]).read()) if os.environ.get("FAKE_LLAMA_TABLE") else None
DIE_AFTER = int(os.environ.get("FAKE_LLAMA_DIE_AFTER", "-1"))
STUCK = os.environ.get("FAKE_LLAMA_STUCK") == "1"
SLOW_FIRST = float(os.environ.get("FAKE_LLAMA_SLOW_FIRST", "0"))
START = time.monotonic()
served = 0


def log(record: dict) -> None:
    if os.environ.get("FAKE_LLAMA_LOG"):
        with LOCK, open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
            f.write(json.dumps(record) + "\n")


def answer(body: dict) -> list[int] | None:
    prompt = body["prompt"]
    if TABLE is not None:
        return TABLE.get(",".join(str(t) for t in prompt))
    k = len(prompt) % 5 + 1
    return [32 + (7 * sum(prompt) + 13 * j) % 200 for j in range(k)] + [EOG[0]]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/metrics":
            calls = 0 if STUCK else int((time.monotonic() - START) * 100)
            data = f"# TYPE llamacpp:n_decode_total counter\nllamacpp:n_decode_total {calls}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        global served
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log({"path": self.path, "body": body})
        with LOCK:
            served += 1
            if served == DIE_AFTER + 1:
                sys.stderr.write("fake llama-server: dying on request (FAKE_LLAMA_DIE_AFTER)\n")
                sys.stderr.flush()
                os._exit(3)
            first = served == 1
        if STUCK or (first and SLOW_FIRST):
            time.sleep(3600 if STUCK else SLOW_FIRST)
        tokens = answer(body)
        if self.path != "/completion" or tokens is None:
            self.reply(404, {"error": "unknown prompt"})
            return
        stop = "limit"
        for i, t in enumerate(tokens):
            if t in EOG:
                tokens, stop = tokens[: i + 1], "eos"
                break
        if len(tokens) >= body["n_predict"]:
            tokens, stop = tokens[: body["n_predict"]], "limit"
        self.reply(200, {"content": "", "tokens": tokens if body.get("return_tokens") else [], "stop_type": stop,
                         "truncated": False, "id_slot": body.get("id_slot", -1)})


def main(argv: list[str]) -> int:
    if "--version" in argv:
        print("version: 11434 (fake)\nbuilt with a test", file=sys.stderr)
        return 0
    args = dict(zip(argv, argv[1:]))
    log({"argv": argv, "pid": os.getpid()})
    ThreadingHTTPServer((args["--host"], int(args["--port"])), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
