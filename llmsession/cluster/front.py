"""The ingress deployment of ``serve --replicas``: ``Front`` (one light replica).

It reads a request's body (bounded; kept only for a keyed caller), finds its conversation
(``keys.routing``), and hands the request to an ``Engine`` replica (``deployment``) through a
handle whose ``session_id`` names it, so the request router (``router.ConversationRouter``)
chooses the replica; the replica's ASGI messages come back as a stream and are relayed as they
come. A replica that fails before its answer began is replaced by the next one the router
ranks (the request is retried there); after, the client's connection is cut. ``/metrics`` is
the board's, every replica's merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from ray.exceptions import ActorDiedError, RayActorError

from llmsession.cluster.deployment import (
    CONVERSATION_HEADER,
    HELD_CONVERSATIONS,
    MOVED_HEADER,
    REPLICA_HEADER,
    Text,
)
from llmsession.cluster.keys import conversational, prompt_text, routing, session_id
from llmsession.cluster.metrics import front_metrics, merged
from llmsession.serve.access import Access

log = logging.getLogger("llmsession.cluster")
INTERNAL_PREFIX = b"x-llmsession-"  # headers only the cluster sets: a client's are dropped
RETRIES = 1  # another replica tries a request whose replica died holding it, before answering
BODY_TIMEOUT_S = 60.0  # for a request's body to arrive (a slow upload holds the front)
UNKEYED_BODY_S = 5.0  # for the body of a caller without a key, read only to be dropped
PARSERS = 4  # bodies the front reads for their conversation at once (a thread each)
# Keyless bodies read (to drop) at once, beside the requests a replica is asked: past them one is
# not read (its 401 at once). Ray's slots for the front are the answers', these and a margin.
UNKEYED_READERS = 256
FRONT_MARGIN = 64

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Front:
    """The ingress: routes each request to its conversation's replica and relays the answer."""

    def __init__(
        self,
        engine: Any,
        max_body_bytes: int,
        board: Any,
        router: str = "conversation",
        access: Access | None = None,
        answers: int = 64,
    ) -> None:
        """``router``: ours (``conversation``: the session id names the replica a request must
        reach or answered last, ``keys.session_id``), else one of Ray's, for comparison: the
        session id is the conversation's key alone, and the prefix router gets its text.
        ``access``: the servers' keys; a request that presents none of them is passed on
        without its body (dropped as it is read: the replica answers its 401 in its door's
        words), so that no caller without a key has the front hold, parse or ship a body.
        ``answers``: the requests replicas are asked at once (a keyed one's body is held from
        before it is read); a keyless body is read beside them (``UNKEYED_READERS``), so that
        slow keyless uploads never hold the places keyed requests need (128 of them did)."""
        self.engine = engine
        self.access = access
        self.max_body_bytes = max_body_bytes
        self.board = board
        self.hints = router == "conversation"
        self.by_text = router == "prefix-affinity"
        self.last: OrderedDict[str, str] = OrderedDict()  # key -> the replica that answered it last
        self.parsing = asyncio.Semaphore(PARSERS)
        self.answering = asyncio.Semaphore(answers)
        self.unkeyed = asyncio.Semaphore(UNKEYED_READERS)

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
        forwarded = _forwarded(scope)
        headers: dict[str, str] = {}
        for name, value in forwarded["headers"]:  # (the first of a repeated header, as the server reads it)
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        if self.access is None or self.access.admits(headers):
            async with self.answering:  # (its body held: as many as replicas are asked)
                body = await self._read(receive, send, keyed=True)
                if body is not None:
                    await _unless_gone(receive, self._answer(scope, forwarded, headers, body, send))
            return
        if await self._read(receive, send, keyed=False) is not None:
            async with self.answering:
                await _unless_gone(receive, self._answer(scope, forwarded, headers, b"", send))

    async def _answer(
        self, scope: Scope, forwarded: dict[str, Any], headers: Mapping[str, str], body: bytes, send: Send
    ) -> None:
        """Find the request's conversation and relay a replica's answer to it."""
        path = scope.get("path", "/")
        async with self.parsing:  # (a large body's parse, a few at once: 128 could run together)
            key, pinned = await asyncio.to_thread(routing, path, headers, body)
            text = Text(await asyncio.to_thread(prompt_text, path, body)) if self.by_text else None
        forwarded["headers"].append((CONVERSATION_HEADER, key.encode()))
        session = session_id(key, pinned, self.last.get(key)) if self.hints else key
        for attempt in range(RETRIES + 1):
            previous = self.last.get(key)
            handle = self.engine.options(stream=True, session_id=session)
            stream = handle.answer.remote(forwarded, body, key, previous, text)
            try:
                if await self._relay(stream, scope, key, send, last=attempt == RETRIES):
                    return
            finally:  # (however it ended: a client gone mid-answer stops the replica's run)
                stream.cancel()

    async def _relay(self, stream: Any, scope: Scope, key: str, send: Send, *, last: bool) -> bool:
        """The replica's answer, relayed; False if the replica died before it began and another
        may answer (not ``last``). Ray does not cancel a replica's generator for a client that
        left: the caller cancels ``stream`` however this ends."""
        path = scope.get("path", "/")
        try:
            first = await stream.__anext__()
        except RayActorError as error:  # (died while it held the request, before answering)
            # Only a replica that died is asked again of another: one unreachable for a moment
            # (``ActorUnavailableError``) may be answering still (twice is worse).
            if last or not isinstance(error, ActorDiedError):
                await _error(send, 503, "no replica could answer the request; try again")
                return True
            return False  # (it had not begun: another replica answers)
        except Exception as error:  # (Ray's own: no replica yet, a task's failure): in JSON,
            log.warning("no replica answered %s: %r", path, error)  # not Ray's bare text
            await _error(send, 503, "no replica could answer the request; try again")
            return True
        if conversational(scope):  # (a probe or a listing holds no conversation)
            self._answered(key, first)
        first = {
            **first,
            "headers": [(k, v) for k, v in first.get("headers", []) if k.lower() != MOVED_HEADER],
        }
        if path == "/metrics" and first.get("status") == 200 and await self._metrics(send, first):
            return True  # (its own text is not needed: the board had every replica's)
        await send(first)
        try:
            async for message in stream:
                await send(message)
        except RayActorError:  # (the replica died mid-answer: the connection is cut, so the
            log.warning("a replica died while answering %s", path)  # client sees it unfinished)
            raise
        return True

    async def _read(self, receive: Receive, send: Send, *, keyed: bool) -> bytes | None:
        """The request's body, bounded in size and time; None once the request is answered
        (408, 413) or its client has left. A caller who presents none of the servers' keys has
        its body read and dropped, never kept or parsed, and b"" passed on to the replica (its
        401, or what it answers without a key: a probe, a 404), past the size or the time too
        (``UNKEYED_BODY_S``: a trickle of bytes held one of the front's places for a minute).
        (Read, not left: Ray's proxy queues what the app has not read, unbounded, and a client
        that asked for the connection to close would be reset before it read its 401.) Past
        ``UNKEYED_READERS`` keyless bodies being read, one is not read at all."""
        if not keyed and self.unkeyed.locked():
            return b""
        waits = BODY_TIMEOUT_S if keyed else UNKEYED_BODY_S  # (a trickle without a key: not a minute)
        try:
            async with contextlib.nullcontext() if keyed else self.unkeyed:
                body = await asyncio.wait_for(_body(receive, self.max_body_bytes, keep=keyed), waits)
        except asyncio.TimeoutError:  # (on 3.10, not the builtin)
            if not keyed:
                return b""
            await _error(send, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")
            return None
        if body is None and not keyed:
            return b""
        if body is None:
            await _error(send, 413, f"the request body is larger than {self.max_body_bytes} bytes")
        return None if body is None or body is GONE else body

    def _answered(self, key: str, first: Message) -> None:
        """Remember which replica answered ``key`` (and so holds its state)."""
        headers = first.get("headers", [])
        names = [v for k, v in headers if k.lower() == REPLICA_HEADER]
        moved = any(k.lower() == MOVED_HEADER for k, _ in headers)  # (its state is there now)
        if (first.get("status", 500) < 400 or moved) and names:
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
        body = (merged(texts) + front_metrics(len(texts))).encode()
        headers = [(k, v) for k, v in first.get("headers", []) if k.lower() != b"content-length"]
        await send({**first, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return True


async def _unless_gone(receive: Receive, answering: Awaitable[None]) -> None:
    """Run ``answering`` until it ends or the client leaves (then it is cancelled, the replica's
    stream with it). Ray's proxy cancels the front for a client that left unless the client's
    request said not to (its ``x-request-disconnect-disabled`` header, read before the front
    sees it): then a reply decoded on to the end for nobody. (Past the body, ASGI's ``receive``
    says only a disconnect; anything else ends the watch, never the answer.)"""
    task, left = asyncio.ensure_future(answering), asyncio.ensure_future(receive())
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
        gone = left.done() and not left.cancelled() and left.exception() is None
        if gone and left.result().get("type") == "http.disconnect" and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        await task
    finally:  # (cancelled itself, it waits for the answer to unwind: its stream cancelled)
        left.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


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


async def _body(receive: Receive, limit: int, keep: bool = True) -> bytes | None:
    """The request's body (b"" if not ``keep``: read and dropped), None past ``limit`` bytes,
    or ``GONE`` if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        if keep:
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
