"""``llmsession serve``'s connections: a request's head must arrive in time and within a size,
else the connection is closed (uvicorn bounds neither before a connection's first response: a
client could hold thousands of connections open, a header byte a minute each). Over real
sockets, on uvicorn with the protocol ``serve`` gives it; the app answers ``ok``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from llmsession.commands import serve_http


@contextlib.contextmanager
def served(http: str) -> Iterator[int]:
    async def ok(_: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def slow(_: object) -> PlainTextResponse:
        await asyncio.sleep(2)
        return PlainTextResponse("slow")

    app = Starlette(routes=[Route("/", ok), Route("/slow", slow)])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", http=serve_http.bounded_protocol(http))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def closed_within(client: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes ``client`` within ``seconds`` (sending ``trickle`` a byte at a time)."""
    client.settimeout(0.1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if trickle:
                client.send(trickle[:1])
                trickle = trickle[1:] or trickle
            if client.recv(1024) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:  # (reset)
            return True
    return False


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_head_that_does_not_come_in_time_or_in_size_closes_its_connection(
    monkeypatch: pytest.MonkeyPatch, http: str
) -> None:
    monkeypatch.setattr(serve_http, "HEAD_SECONDS", 1.0)
    with served(http) as port:
        silent, trickling = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
        began = time.monotonic()
        assert closed_within(silent, 5) and closed_within(trickling, 5, b"GET / HTTP/1.1\r\nX-A: aaaaaaaaaaa")
        assert time.monotonic() - began < 5
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # (a whole head: answered, and kept alive)
        time.sleep(0.3)
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # (the next one on it, in time)
        time.sleep(0.3)
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        pipelined = socket.create_connection(("127.0.0.1", port))  # (two heads at once: the second's
        heads = b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
        pipelined.sendall(heads)  # is whole as the first ends; its answer takes past the head's time)
        time.sleep(2.5)
        assert pipelined.recv(4096).count(b"HTTP/1.1 200") == 2
        pipelined.close()
        huge = socket.create_connection(("127.0.0.1", port))
        huge.sendall(b"GET / HTTP/1.1\r\nX-A: ")
        with contextlib.suppress(OSError):
            for _ in range(40):  # (2.5 MiB of one header, past the bound)
                huge.sendall(b"a" * (1 << 16))
        assert closed_within(huge, 3)
        for each in (silent, trickling, kept, huge):
            each.close()
