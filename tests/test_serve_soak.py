"""A soak of ``llmsession serve``: 8 clients × 50 requests, mixing resent conversations, streams,
raw completions, ``n`` choices, clients that leave mid-stream or before any answer, and bad
requests. Nothing may be a 5xx, every stream must end, nothing may stay in flight, the server's
memory must stay bounded, and it must still answer and stop cleanly afterwards."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plain_http import HTTP
from serve_helpers import metric

CLIENTS, REQUESTS, WARM_UP = 8, 50, 6
KINDS = {"chat": 30, "stream": 15, "leave": 12, "vanish": 8, "bad": 25, "raw": 5, "n": 5}
# Past the warm-up: parked states are held to 32 MiB, the rest is noise, and without flash attention
# (the default on the CPU) the compute buffer's KQ matrices, as wide as the cells in use, are
# touched as they fill: 9 heads x 512 x 4,096 cells x 4 bytes = 75 MB for SmolLM2. Measured
# 2026-12-02 over 7 rounds of this soak on one server: with flash attention 28, 31, 33 MB; without,
# 125, 148, 170, 176, 172, 174, 185 MB (levelling off: buffers touched, not leaked).
RSS_GROWTH = (128 + 80) << 20
BAD: list[Any] = [
    b"{not json",
    b"[]",
    b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}',
    {"messages": "hi"},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": "x"}], "n": 99},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
    {"messages": [{"role": "user", "content": "word " * 10000}]},  # (past the 8,192 positions)
    {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}
        ]
    },
    # Issue 39: numbers no double holds, and lone surrogates in UTF-16 and UTF-32 bodies (500s).
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}",
    b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -' + b"9" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1e400}',
    ("/v1/completions", b'{"prompt": "x", "presence_penalty": -1' + b"0" * 400 + b"}"),
    '{"messages": [{"role": "user", "content": "a\ud800b"}]}'.encode("utf-16", "surrogatepass"),
    '{"messages": [{"role": "user", "content": "x"}], "stop": "\udc00"}'.encode("utf-16-be", "surrogatepass"),
    ("/v1/completions", '{"prompt": "a\ud800b"}'.encode("utf-32", "surrogatepass")),
    # Bodies over the server's 8 MiB limit, through urllib (which reset before: it sends its whole
    # body before it reads, and asks for the connection to be closed after).
    "oversized",
    "oversized chunked",
]
OVERSIZED = json.dumps({"messages": [{"role": "user", "content": "x" * (9 << 20)}]}).encode()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Client:
    """One client's requests, a conversation it resends, and what it saw go wrong."""

    def __init__(self, url: str, index: int) -> None:
        self.url, self.index = url, index
        self.random = random.Random(index)
        self.http = httpx.Client(base_url=url, timeout=60)
        self.history: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.seen: Counter[str] = Counter()

    def run(self, count: int) -> None:
        kinds, weights = zip(*KINDS.items(), strict=True)
        for _ in range(count):
            kind = self.random.choices(kinds, weights)[0]
            try:
                getattr(self, kind)()
                self.seen[kind] += 1
            except Exception as error:  # (each one is a finding)
                self.problems.append(f"client {self.index} {kind}: {type(error).__name__}: {error}")

    def chat(self) -> None:
        if len(self.history) >= 8:
            self.history = []
        turn = f"Question {len(self.history) // 2 + 1} from client {self.index}: say something short."
        self.history.append({"role": "user", "content": turn})
        response = self.http.post("/v1/chat/completions", json=self.body(self.history))
        self.expect(response, 200)
        self.history.append(response.json()["choices"][0]["message"])

    def stream(self) -> None:
        body = {**self.body([{"role": "user", "content": "Tell me a fact."}]), "stream": True}
        body["stream_options"] = {"include_usage": True}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            self.expect(response, 200)
            lines = [line for line in response.iter_lines() if line]
        if lines[-1] != "data: [DONE]" or json.loads(lines[-2][6:])["usage"] is None:
            self.problems.append(f"client {self.index}: a stream ended without its usage and [DONE]")

    def leave(self) -> None:
        body = {**self.body([{"role": "user", "content": "Write a long story."}]), "stream": True}
        body["max_tokens"] = 300
        with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            self.expect(response, 200)
            lines = response.iter_lines()
            for _ in range(self.random.randint(1, 4)):
                next(lines)
        # (closing the response mid-stream drops the connection)

    def vanish(self) -> None:
        """Send a request and hang up before any answer (queued, or prefilling)."""
        payload = json.dumps({**self.body([{"role": "user", "content": "Hello there."}]), "max_tokens": 64})
        host, port = self.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            request = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n{payload}"
            )
            sock.sendall(request.encode())
            time.sleep(self.random.uniform(0, 0.05))

    def bad(self) -> None:
        body = self.random.choice(BAD)
        path, body = body if isinstance(body, tuple) else ("/v1/chat/completions", body)
        if isinstance(body, str):  # (oversized)
            status, text = self.urllib_post(path, OVERSIZED if body == "oversized" else chunks(OVERSIZED))
        else:
            response = self.http.post(
                path, **({"content": body} if isinstance(body, bytes) else {"json": body})
            )
            status, text = response.status_code, response.content
        if not 400 <= status < 500 or "error" not in json.loads(text):
            self.problems.append(f"client {self.index}: {body!r:.60} gave {status}")

    def urllib_post(self, path: str, data: Any) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def raw(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 3, "user": f"client-{self.index}"}
        self.expect(self.http.post("/v1/completions", json=body), 200)

    def n(self) -> None:
        body = {**self.body([{"role": "user", "content": "Pick a number."}]), "n": 2, "temperature": 0.8}
        response = self.http.post("/v1/chat/completions", json=body)
        self.expect(response, 200)
        if len(response.json()["choices"]) != 2:
            self.problems.append(f"client {self.index}: n=2 gave other than two choices")

    def body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        tokens = self.random.randint(1, 6)
        return {"messages": messages, "max_tokens": tokens, "temperature": 0, "user": f"client-{self.index}"}

    def expect(self, response: httpx.Response, status: int) -> None:
        if response.status_code != status:
            response.read()
            raise AssertionError(f"{response.status_code} {response.text:.200}")


def chunks(data: bytes) -> Iterator[bytes]:
    """``data`` as urllib sends an iterable: chunked."""
    return (data[i : i + (1 << 16)] for i in range(0, len(data), 1 << 16))


def soak(url: str, count: int, first: int = 0) -> tuple[list[str], Counter[str]]:
    clients = [Client(url, first + i) for i in range(CLIENTS)]
    threads = [threading.Thread(target=c.run, args=(count,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
        assert not thread.is_alive(), "a client is stuck"
    for client in clients:
        client.http.close()
    return [p for c in clients for p in c.problems], sum((c.seen for c in clients), Counter())


@pytest.fixture
def server(smollm2_path: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "llmsession", "serve", "--model", str(smollm2_path), "--port", str(port)]
    command += ["--threads", "2", "--host-cache-bytes", str(32 << 20), "--shutdown-timeout", "2"]
    command += ["--kv-tokens", "4096"]  # (the KQ matrices above; and more sessions park, as a soak wants)
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if HTTP.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    try:
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_eight_clients_fifty_requests_each(server: tuple[subprocess.Popen[str], str], tmp_path: Path) -> None:
    process, url = server
    problems, _ = soak(url, WARM_UP, first=100)
    assert problems == [], "\n".join(problems)
    warm = rss(process.pid)
    problems, seen = soak(url, REQUESTS)
    assert problems == [], "\n".join(problems)
    assert all(seen[kind] > 0 for kind in KINDS), seen
    text = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # (a client that left is noticed within a token)
        text = HTTP.get(f"{url}/metrics", timeout=10).text
        if metric(text, "llmsession_requests_in_flight") == 0:
            break
        time.sleep(0.1)
    assert metric(text, "llmsession_requests_in_flight") == 0, "requests stuck in flight"
    statuses = [line for line in text.splitlines() if line.startswith("llmsession_requests_total")]
    assert not [s for s in statuses if 'status="5' in s], statuses
    assert rss(process.pid) - warm < RSS_GROWTH, (warm, rss(process.pid))
    body = {"messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 4}
    assert HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    said = (tmp_path / "server.log").read_text()
    assert "Traceback" not in said, said[-3000:]
