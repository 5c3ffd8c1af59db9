"""The two Ray Serve deployments of ``serve --replicas``: ``Front``, the HTTP ingress (one
light replica), and ``Engine``, the model replicas.

``Front`` reads a request's body (bounded), finds its conversation (``keys.conversation_key``),
and hands the request to an ``Engine`` replica through a handle whose ``session_id`` is that key,
so ``router.ConversationRouter`` chooses the replica; the replica's ASGI messages come back as a
stream and are relayed as they come. A replica that fails before its answer began is replaced
by the next one the router ranks (the request is retried there); after, the stream ends.

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
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError

from llmsession.cluster.handoff import Handoff
from llmsession.cluster.keys import PIN, routing, session_id
from llmsession.cluster.metrics import STALE_S, Arrivals, merged, replicas_gauge
from llmsession.cluster.moving import SharedSpill

log = logging.getLogger("llmsession.cluster")
REPLICA_HEADER = b"x-llmsession-replica"
CONVERSATION_HEADER = b"x-llmsession-conversation"  # the key, for the replica (``keys``)
INTERNAL_PREFIX = b"x-llmsession-"  # headers only the cluster sets: a client's are dropped
HELD_CONVERSATIONS = 4096  # the most recent conversations a replica reports holding
RETRIES = 1  # another replica tries a request whose replica died holding it, before answering
BODY_TIMEOUT_S = 60.0  # for a request's body to arrive (a slow upload holds the front)
ASK_S = 30.0  # for the replica that answered a conversation last to save it for another
SWEEP_S = 300.0  # how often a replica removes the shared folder's files nobody claimed

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@ray.remote(num_cpus=0, max_restarts=-1)
class Board:
    """Where replicas post their metrics' text, for the front's ``/metrics``."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def fresh(self) -> dict[str, str]:
        now = time.monotonic()
        return {replica: text for replica, (at, text) in self.texts.items() if now - at <= STALE_S}


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
    ) -> None:
        """``secret``: the cluster's (``moving.load_secret``), to move conversations through
        ``memory.disk_cache_dir``; ``drain_s``: how long a stopping replica saves them."""
        from llmsession.api.model import Model
        from llmsession.serve.app import create_app

        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.peers: tuple[str, str] = (context.deployment, context.app_name)
        self.model = Model(Path(path), config=config, memory=memory)
        self.app = create_app(self.model, **app_settings)
        self.board = board
        self.held: OrderedDict[str, None] = OrderedDict()
        self.arrivals = Arrivals()
        self.in_flight = 0  # (reported too: Ray's own queue lengths expire after 10 s)
        self.handoff: Handoff | None = None
        if secret is not None and memory.disk_cache_dir is not None:
            self.handoff = Handoff(self.model, SharedSpill(memory.disk_cache_dir, secret, self.name))
        self.drain_s = drain_s
        self._arriving: dict[str, asyncio.Lock] = {}
        self._handle: Any = None
        self._swept = 0.0
        self._drained = False

    async def answer(
        self, scope: Scope, body: bytes, key: str, previous: str | None = None
    ) -> AsyncIterator[Message]:
        """The app's ASGI messages for one request, as they are sent; the replica's name goes to
        the app (response ids carry it) and to the client (``x-llmsession-replica``).
        ``previous``: the replica that answered the conversation last, as the front knows."""
        held = key in self.held
        if self.handoff is not None and previous != self.name and (previous is not None or not held):
            await self._arrive(self.handoff, key, previous)
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
                    if message.get("status", 500) < 400:  # (a refused request holds nothing here)
                        self._hold(key, held)
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REPLICA_HEADER]
                    message = {**message, "headers": [*headers, (REPLICA_HEADER, self.name.encode())]}
                yield message
        finally:
            self.in_flight -= 1
            gone.set()  # (the app sees the client gone)
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _arrive(self, handoff: Handoff, key: str, previous: str | None) -> None:
        """Bring a conversation this replica did not answer last here with its state: from the
        replica that did (asked to save it and let it go), or from what a stopped one saved."""
        lock = self._arriving.setdefault(key, asyncio.Lock())
        async with lock:  # (one restore of a conversation at a time)
            try:
                if previous is not None:
                    await self._ask(key, previous)
                await asyncio.to_thread(handoff.restore, key)
            except Exception as error:  # (the turn goes on without it: a longer prefill)
                log.warning("a conversation could not be moved here: %r", error)
        if not lock.locked():
            self._arriving.pop(key, None)

    async def _ask(self, key: str, previous: str) -> None:
        """Ask the replica that answered ``key`` last to save it for this one (nothing if that
        replica is gone: Ray then routes the call elsewhere, which declines)."""
        if self._handle is None:
            self._handle = serve.get_deployment_handle(*self.peers)
        call = self._handle.options(session_id=f"{key}{PIN}{previous}").surrender.remote(key, previous)
        try:
            await asyncio.wait_for(_awaited(call), ASK_S)
        except (RayActorError, TimeoutError) as error:
            log.info("the replica that held a conversation did not hand it on: %r", error)

    async def surrender(self, key: str, replica: str) -> bool:
        """Another replica was given conversation ``key``: save it for that one and let it go
        here (if this is ``replica``, the one that answered it last, and keeps it)."""
        if replica != self.name or self.handoff is None:
            return False
        given = await asyncio.to_thread(self.handoff.give, key, "handed")
        if given:
            self.held.pop(key, None)
        return given

    def _hold(self, key: str, held: bool) -> None:
        self.arrivals.add(held)
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
        if self.handoff is not None:
            text += self.handoff.render()
            if time.monotonic() - self._swept > SWEEP_S:
                self._swept = time.monotonic()
                await asyncio.to_thread(self.handoff.spill.sweep)
        self.board.put.remote(self.name, text)
        return stats

    def __del__(self) -> None:
        """Stopping (Ray calls this once its requests are done): the conversations kept here
        saved for the other replicas, then the model closed."""
        model, handoff = getattr(self, "model", None), getattr(self, "handoff", None)
        if model is None or getattr(self, "_drained", False):
            return
        self._drained = True
        try:
            if handoff is not None and not model.closed:
                saved = handoff.drain(self.drain_s)
                log.info("a stopping replica saved %d conversations for the others", saved)
        finally:
            model.close()


async def _awaited(call: Any) -> Any:
    return await call


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


class Front:
    """The ingress: routes each request to its conversation's replica and relays the answer."""

    def __init__(self, engine: Any, max_body_bytes: int, board: Any) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.board = board
        self.last: OrderedDict[str, str] = OrderedDict()  # key -> the replica that answered it last

    def __serve_build_asgi_app__(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:  # (a function: ASGI 3)
            await self.asgi(scope, receive, send)

        return app

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # (websockets: none served)
        try:
            body = await asyncio.wait_for(_body(receive, self.max_body_bytes), BODY_TIMEOUT_S)
        except TimeoutError:
            await _error(send, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")
            return
        if body is None:
            await _error(send, 413, f"the request body is larger than {self.max_body_bytes} bytes")
            return
        if body is GONE:
            return
        forwarded = _forwarded(scope)
        headers: dict[str, str] = {}
        for name, value in forwarded["headers"]:  # (the first of a repeated header, as the server reads it)
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        path = scope.get("path", "/")
        key, pinned = await asyncio.to_thread(routing, path, headers, body)  # (a large body's parse)
        forwarded["headers"].append((CONVERSATION_HEADER, key.encode()))
        session = session_id(key, pinned, self.last.get(key))
        for attempt in range(RETRIES + 1):
            previous = self.last.get(key)
            handle = self.engine.options(stream=True, session_id=session)
            stream = handle.answer.remote(forwarded, body, key, previous)
            try:
                first = await stream.__anext__()
            except RayActorError:  # (died while it held the request, before answering)
                if attempt == RETRIES:
                    await _error(send, 503, "no replica could answer the request; try again")
                    return
                continue  # (it had not begun: another replica answers)
            self._answered(key, first)
            if path == "/metrics" and first.get("status") == 200 and await self._metrics(send, first):
                stream.cancel()  # (its own text is not needed: the board had every replica's)
                return
            await send(first)
            try:
                async for message in stream:
                    await send(message)
            except RayActorError:  # (the replica died mid-answer: the connection is cut, so the
                log.warning("a replica died while answering %s", path)  # client sees it unfinished)
                raise
            return

    def _answered(self, key: str, first: Message) -> None:
        """Remember which replica answered ``key`` (and so holds its state)."""
        names = [v for k, v in first.get("headers", []) if k.lower() == REPLICA_HEADER]
        if first.get("status", 500) < 400 and names:
            self.last[key] = names[-1].decode("latin-1")
            self.last.move_to_end(key)
            while len(self.last) > HELD_CONVERSATIONS * 16:
                self.last.popitem(last=False)

    async def _metrics(self, send: Send, first: Message) -> bool:
        """The cluster's metrics, for a request a replica authorized: every fresh replica's; False
        (nothing sent: the replica's own answer is relayed) when the board cannot be read."""
        try:
            texts = await self.board.fresh.remote()
        except RayActorError:
            log.warning("the metrics board is gone: /metrics shows one replica's")
            return False
        body = (merged(texts) + replicas_gauge(len(texts))).encode()
        headers = [(k, v) for k, v in first.get("headers", []) if k.lower() != b"content-length"]
        await send({**first, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return True


async def _lifespan(receive: Receive, send: Send) -> None:
    """Nothing to start or stop: each replica's model is the engine deployment's."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


GONE = b"(the client left)"  # (compared by identity)


async def _body(receive: Receive, limit: int) -> bytes | None:
    """The request's body, None past ``limit`` bytes, or ``GONE`` if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _forwarded(scope: Scope) -> dict[str, Any]:
    """The parts of an ASGI scope a replica's app reads, picklable, without the cluster's own
    headers as a client may have sent them."""
    headers = [
        (bytes(k), bytes(v))
        for k, v in scope.get("headers", [])
        if not bytes(k).lower().startswith(INTERNAL_PREFIX)
    ]
    client = scope.get("client")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": scope.get("http_version", "1.1"),
        "method": scope.get("method", "GET"),
        "scheme": scope.get("scheme", "http"),
        "path": scope.get("path", "/"),
        "raw_path": scope.get("raw_path"),
        "query_string": scope.get("query_string", b""),
        "root_path": "",
        "headers": headers,
        "client": tuple(client) if client else None,
        "server": tuple(scope["server"]) if scope.get("server") else None,
    }


async def _error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "server_error", "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
