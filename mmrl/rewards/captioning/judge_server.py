"""A small OpenAI-compatible judge server (stdlib `http.server`) for tests, benchmarks and CPU demos.

It serves `/v1/chat/completions` (one prompt) and `/v1/completions` (a list of prompts), reads
each prompt back into a `JudgeItem` (the layout of `mmrl.rewards.captioning.judges.format_prompt`) and answers with
the lexical judge. Failure modes for tests: `delay` seconds before each reply, `behaviour`
"malformed" (a reply with no option letter), "broken_json" (a body that is not JSON), "flaky"
(HTTP 503 for the first `flaky_failures` requests).

    python -m mmrl.rewards.captioning.judge_server --port 8000
    # then in a config: judge: {name: http, base_url: http://127.0.0.1:8000/v1}
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from mmrl.rewards.captioning.judges import JudgeItem, LexicalJudge

BEHAVIOURS = ("lexical", "malformed", "broken_json", "flaky")
_PROMPT_RE = re.compile(r"^Caption: (?P<caption>.*?)\n\nAnswer the question using only the caption\.\n"
                        r"Question: (?P<question>.*?)\n(?P<options>(?:[A-Z]\. .*\n)+)Answer with", re.DOTALL)


def item_from_prompt(prompt: str) -> JudgeItem | None:
    m = _PROMPT_RE.match(prompt)
    if not m:
        return None
    options = [line[3:] for line in m.group("options").splitlines()]
    return JudgeItem(m.group("caption"), m.group("question"), options)


class JudgeServer:
    """A running server on 127.0.0.1 (port 0: a free one); `url` is the OpenAI base URL (…/v1)."""

    def __init__(self, port: int = 0, delay: float = 0.0, behaviour: str = "lexical", flaky_failures: int = 1):
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"judge server: unknown behaviour {behaviour!r}; valid: {', '.join(BEHAVIOURS)}")
        self.delay, self.behaviour, self.flaky_left = delay, behaviour, flaky_failures
        self.requests = 0
        self.prompts = 0
        self.lock = threading.Lock()
        self.judge = LexicalJudge()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, prompt: str) -> str:
        if self.behaviour == "malformed":
            return "I am not sure."
        item = item_from_prompt(prompt)
        if item is None:
            return "I cannot read this prompt."
        return self.judge.judge([item])[0].raw

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with server.lock:
                    server.requests += 1
                    fail = server.behaviour == "flaky" and server.flaky_left > 0
                    server.flaky_left -= int(fail)
                if server.delay:
                    time.sleep(server.delay)
                if fail:
                    return self._send(503, b'{"error": "overloaded"}')
                if server.behaviour == "broken_json":
                    return self._send(200, b"<html>not json")
                if self.path.endswith("/chat/completions"):
                    text = server.answer(payload["messages"][-1]["content"])
                    with server.lock:
                        server.prompts += 1
                    body = {"object": "chat.completion", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
                elif self.path.endswith("/completions"):
                    prompts = payload["prompt"] if isinstance(payload["prompt"], list) else [payload["prompt"]]
                    with server.lock:
                        server.prompts += len(prompts)
                    body = {"object": "text_completion", "choices": [
                        {"index": i, "text": server.answer(p), "finish_reason": "stop"} for i, p in enumerate(prompts)]}
                else:
                    return self._send(404, b'{"error": "not found"}')
                self._send(200, json.dumps(body).encode())

        return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="judge_server", description="OpenAI-compatible lexical judge on loopback")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--delay", type=float, default=0.0)
    a = p.parse_args(argv)
    with JudgeServer(a.port, a.delay) as srv:
        print(f"serving {srv.url}", flush=True)
        srv.thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
