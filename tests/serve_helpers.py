"""What the server's tests share: a real uvicorn on a free port, and clients of it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from tool_helpers import WEATHER

from llmsession import Model, Models
from llmsession.serve.app import Server, create_app

KEY, OTHER_KEY = "sk-alpha", "sk-beta"
__all__ = ["KEY", "OTHER_KEY", "WEATHER", "Served", "metric", "running", "serving", "three_models"]


@dataclass
class Served:
    model: Model
    url: str  # .../v1
    name: str
    server: Server
    key: str | None = KEY

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=60)

    def http(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url.removesuffix("/v1"), headers=headers, timeout=60)

    def metrics(self) -> str:
        with self.http(self.key) as http:
            response = http.get("/metrics")
        assert response.status_code == 200
        return response.text

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])


def metric(text: str, name: str) -> float:
    """A sample's value (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def running(app: Any) -> Iterator[str]:
    """``app`` on uvicorn on a free port, in a thread: its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def three_models(smol: Path, gemma: Path, bert: Path, **app: Any) -> Iterator[tuple[Models, str]]:
    """Two chat models and an embedding model behind one server (``create_app(**app)``), one
    loaded at a time: the models, and the server's base URL."""
    models = Models({"smol": smol, "gemma": gemma, "bert": bert}, max_loaded=1, threads=2)
    with models, running(create_app(models, **app)) as url:
        yield models, url


@contextlib.contextmanager
def serving(model_path: Path) -> Iterator[Served]:
    """One model (a thread) behind a real server with the two keys."""
    with Model(model_path, threads=1) as model:
        app = create_app(model, api_key=[KEY, OTHER_KEY])
        with running(app) as url:
            yield Served(model, url, app.state.server.model_name, app.state.server)
