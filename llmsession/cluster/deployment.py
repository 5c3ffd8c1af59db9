"""The engine deployment of ``serve --replicas`` (``front`` is its ingress): the model replicas,
and the board their metrics go to.

``Engine`` is a ``Model`` with the server's app (``serve.create_app``), run in-process on each
request's ASGI scope. It names itself in every response (``x-llmsession-replica``) and reports
the conversations it answered, most recent last, as its routing stats. With a disk cache folder
(shared by every replica) conversations move with their state (``handoff``): a replica given a
conversation that another answered last asks that one for it (which saves it there and lets it
go) and restores it, or restores what a replica that stopped left there; a stopping replica
saves the conversations it keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from starlette.requests import Request

from llmsession.cluster.handoff import Handoff, Tenant
from llmsession.cluster.keys import conversational, user_of
from llmsession.cluster.metrics import STALE_S, Arrivals
from llmsession.cluster.moving import SharedSpill
from llmsession.cluster.peers import Mover
from llmsession.serve.errors import ApiError
from llmsession.serve.naming import tenant_name

log = logging.getLogger("llmsession.cluster")
REPLICA_HEADER = b"x-llmsession-replica"
CONVERSATION_HEADER = b"x-llmsession-conversation"  # the key, for the replica (``keys``)
HELD_CONVERSATIONS = 4096  # the most recent conversations a replica reports holding
MOVED_HEADER = b"x-llmsession-moved"  # the conversation came here with its state (``peers``)
SWEEP_S = 300.0  # how often a replica removes the shared folder's files nobody claimed

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Boarded:
    """Where replicas post their metrics' text, for the front's ``/metrics`` (``Board``, the
    actor); a replica that stopped posting is forgotten (autoscaling starts new ones for ever)."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        now = time.monotonic()
        for gone in [r for r, (at, _) in self.texts.items() if now - at > STALE_S]:
            del self.texts[gone]
        self.texts[replica] = (now, text)

    def fresh(self) -> dict[str, str]:
        now = time.monotonic()
        return {replica: text for replica, (at, text) in self.texts.items() if now - at <= STALE_S}


Board = ray.remote(num_cpus=0, max_restarts=-1)(Boarded)


@dataclass(frozen=True)
class Text:
    """A request's text, where Ray's prefix-cache router looks for it (an argument's
    ``prompt``)."""

    prompt: str


class Engine:
    """One replica: the model and the server's app over it."""

    def __init__(
        self,
        path: str,
        config: Any,
        memory: Any,
        app_settings: dict[str, Any],
        board: Any,
        secret: bytes | None = None,
        drain_s: float = 10.0,
        asks: bool = True,
    ) -> None:
        """``secret``: the cluster's (``moving.load_secret``), to move conversations through
        ``memory.disk_cache_dir``; ``drain_s``: how long a stopping replica saves them;
        ``asks``: whether a replica asks the one that answered a conversation last for it."""
        from llmsession.api.model import Model
        from llmsession.serve.app import create_app

        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.model = Model(Path(path), config=config, memory=memory)
        self.app = create_app(self.model, **app_settings)
        self.app.state.server.fronted = True  # (the front names each request's conversation)
        self.board = board
        self.held: OrderedDict[str, None] = OrderedDict()
        self.arrivals = Arrivals()
        self.in_flight = 0  # (reported too: Ray's own queue lengths expire after 10 s)
        self.mover: Mover | None = None
        if secret is not None and memory.disk_cache_dir is not None:
            spill = SharedSpill(memory.disk_cache_dir, secret, self.name)
            peers = (context.deployment, context.app_name)
            self.mover = Mover(Handoff(self.model, spill), self.name, peers, asks)
        self.drain_s = drain_s
        self._maintained = time.monotonic()
        self._maintaining: asyncio.Future[None] | None = None
        self._drained = False

    async def answer(
        self, scope: Scope, body: bytes, key: str, previous: str | None = None, text: Text | None = None
    ) -> AsyncIterator[Message]:
        """The app's ASGI messages for one request, as they are sent; the replica's name goes to
        the app (response ids carry it) and to the client (``x-llmsession-replica``).
        ``previous``: the replica that answered the conversation last, as the front knows;
        ``text``: the request's, for Ray's prefix router (read by it, not here)."""
        held, moved = key in self.held, False
        if self.mover is not None and self.mover.wants(scope, previous, held):
            tenant = await asyncio.to_thread(self._tenant, scope, body)  # (it parses the body)
            moved = tenant is not None and await self.mover.arrive(
                key, previous, tenant, lambda: self._remember(key)
            )
            if moved:  # (held here now, whatever the answer: the front is told so)
                self._remember(key)
        sent: asyncio.Queue[Message] = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await sent.put(message)

        named = {**scope, "headers": [*scope["headers"], (REPLICA_HEADER, self.name.encode())]}
        task = asyncio.ensure_future(self.app(named, receive, send))
        self.in_flight += 1
        try:
            async for message in _messages(sent, task):
                if message["type"] == "http.response.start":
                    if message.get("status", 500) < 400 and conversational(scope):  # (else nothing held)
                        self._hold(key, held)
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REPLICA_HEADER]
                    headers.append((REPLICA_HEADER, self.name.encode()))
                    message = {**message, "headers": [*headers, *([(MOVED_HEADER, b"1")] if moved else [])]}
                yield message
        finally:
            self.in_flight -= 1
            gone.set()  # (the app sees the client gone)
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def _tenant(self, scope: Scope, body: bytes) -> Tenant | None:
        """The tenant this request is the server's (its key's and its user's), or None if the
        server does not let its caller in: a conversation moves for no one else."""
        try:
            key = self.app.state.server.authorize(Request(scope))
        except ApiError:
            return None
        return Tenant(tenant_name(key, user_of(scope.get("path", "/"), body)))

    async def surrender(self, key: str, replica: str, asker: str, until: float, tenant: Tenant) -> bool:
        """``asker`` was given conversation ``key`` by a request of ``tenant`` (``peers.Mover``):
        saved for it and let go here, if this replica holds it for that tenant (however the call
        ends: a cancelled ask does not stop it)."""
        if self.mover is None:
            return False
        surrender = self.mover.surrender
        giving = asyncio.ensure_future(asyncio.to_thread(surrender, key, replica, asker, until, tenant))

        def given(done: asyncio.Future[bool]) -> None:
            if not done.cancelled() and done.exception() is None and done.result():
                self.held.pop(key, None)

        giving.add_done_callback(given)
        return await asyncio.shield(giving)

    def _hold(self, key: str, held: bool) -> None:
        self.arrivals.add(held)
        self._remember(key)

    def _remember(self, key: str) -> None:
        self.held[key] = None
        self.held.move_to_end(key)
        while len(self.held) > HELD_CONVERSATIONS:
            self.held.popitem(last=False)

    async def record_routing_stats(self) -> dict[str, Any]:
        """What Ray's router reads (every ``run.STATS_PERIOD_S``): the conversations held. The
        metrics' text is posted to the board at the same beat."""
        stats = {"conversations": list(self.held), "in_flight": self.in_flight}
        if self.model.closed:  # (the replica is stopping)
            return stats
        report = await asyncio.to_thread(self.model.memory)  # (it waits for the engine's lock)
        text = self.app.state.server.metrics.render([session.state for session in report.sessions])
        text += self.arrivals.render()
        if self.mover is not None:
            text += self.mover.handoff.render()
            if time.monotonic() - self._maintained > SWEEP_S:  # (in the background: a slow folder)
                self._maintained = time.monotonic()
                self._maintaining = asyncio.ensure_future(asyncio.to_thread(self.mover.maintain))
                self._maintaining.add_done_callback(_logged)
        self.board.put.remote(self.name, text)
        return stats

    def __del__(self) -> None:
        """Stopping (Ray calls this once its requests are done): the conversations kept here
        saved for the other replicas, then the model closed."""
        model, mover = getattr(self, "model", None), getattr(self, "mover", None)
        if model is None or getattr(self, "_drained", False):
            return
        self._drained = True
        try:
            if mover is not None and not model.closed:
                saved = mover.handoff.drain(self.drain_s)
                log.info("a stopping replica saved %d conversations for the others", saved)
        finally:
            model.close()


def _logged(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("the shared folder could not be swept: %r", done.exception())


async def _messages(sent: asyncio.Queue[Message], task: asyncio.Future[Any]) -> AsyncIterator[Message]:
    """What the app sends, until it returns (its error raised after what it sent)."""
    while True:
        getting = asyncio.ensure_future(sent.get())
        try:
            await asyncio.wait({getting, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            got = getting.done()
            if not got:
                getting.cancel()  # (the app ended, or the stream was closed; no item is lost)
        if got:
            yield getting.result()
            continue
        while not sent.empty():
            yield sent.get_nowait()
        task.result()  # (raises what the app raised)
        return
