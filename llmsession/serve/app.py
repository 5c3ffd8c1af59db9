"""The Starlette application of ``llmsession serve``: OpenAI's chat completions on a model.

Every request goes through the model's stateless routing (``Model.chat_stream``), so a client
that resends its history decodes only the new turn; its tenant is its API key and its ``user``,
with ``share_prefix=False``, so two tenants never share cells (one's timings tell nothing of
another's prompts). Each choice decodes in a thread of its own (``runner``): concurrent requests
are batched by the engine, and the event loop never waits for a decode. A client that goes away
cancels its exchange within a token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmsession.options import INT32_MAX
from llmsession.replies import Reply
from llmsession.serve import sse
from llmsession.serve.errors import RequestError, from_library, internal
from llmsession.serve.metrics import Metrics
from llmsession.serve.runner import Admission, Choices, Event
from llmsession.serve.schema import ChatRequest, chat_request, parse_json

if TYPE_CHECKING:
    from llmsession.api.model import Model
    from llmsession.runtime.stream import Stream

log = logging.getLogger("llmsession.serve")
MAX_BODY_BYTES = 8 << 20
PATHS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


class ClientGone(Exception):
    """The client closed the connection before the response began."""


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers())


class EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (a finished stream, a
    client gone, a server stopping), so the exchanges behind it never outlive it."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Counting:
    """ASGI middleware: every HTTP response counted by path and status (a failure as 500)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            path = scope.get("path", "")
            self.metrics.request(path if path in PATHS else "other", status)


class Server:
    """What the routes share: the model, its name, the keys, the counters and the admission."""

    def __init__(
        self,
        model: Model,
        *,
        api_keys: Sequence[str],
        model_name: str,
        max_body_bytes: int,
        queue: int,
        session_args: dict[str, Any],
    ) -> None:
        self.model, self.model_name = model, model_name
        self.keys = [key.encode() for key in api_keys]
        self.max_body_bytes, self.session_args = max_body_bytes, session_args
        self.metrics = Metrics()
        self.admission = Admission(model.memory().max_live_sessions, queue)
        self.created = int(time.time())

    def authorize(self, request: Request) -> str | None:
        """Who is calling: a digest of the key it presented (None without keys); else a 401.
        Every key is compared, in constant time."""
        if not self.keys:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        matched = [hmac.compare_digest(token, key) for key in self.keys]
        if not any(matched):
            raise RequestError("invalid or missing API key", None, "invalid_api_key", 401)
        return hashlib.sha256(self.keys[matched.index(True)]).hexdigest()[:16]

    async def body(self, request: Request) -> bytes:
        """The request body, refused (413) past the size limit before it is all read."""
        too_big = RequestError(
            f"the request body is over the limit of {self.max_body_bytes} bytes", None, None, 413
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise RequestError("the client went away", None, None, 499) from None
        return b"".join(chunks)

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.model.closed:
            return JSONResponse({"status": "closed"}, 503)
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model_card(self, request: Request) -> Response:
        self.authorize(request)
        if request.path_params["name"] != self.model_name:
            raise RequestError(
                f"no model {request.path_params['name']!r:.80}", "model", "model_not_found", 404
            )
        return JSONResponse(self.card())

    def card(self) -> dict[str, Any]:
        images = self.model.mmproj_path is not None
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "llmsession",
            "capabilities": {"images": images, "tools": True, "json_schema": True},
        }

    async def metrics_text(self, request: Request) -> Response:
        self.authorize(request)
        states: list[str] = []
        if not self.model.closed:
            report = await asyncio.to_thread(self.model.memory)  # (it waits for the engine's lock)
            states = [session.state for session in report.sessions]
        return PlainTextResponse(self.metrics.render(states), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        raise RequestError(
            "raw-prompt completions are not supported: llmsession answers chat messages through the "
            "model's chat template; use /v1/chat/completions",
            None,
            "unsupported_endpoint",
            404,
        )

    async def chat(self, request: Request) -> Response:
        tenant_key = self.authorize(request)
        asked = chat_request(parse_json(await self.body(request)), INT32_MAX)
        tenant = json.dumps([tenant_key, asked.user])
        weight = await self.admission.acquire(asked.n)
        self.metrics.flight(1)

        def released() -> None:
            self.admission.release(weight)
            self.metrics.flight(-1)

        try:
            choices = Choices(asked.n, lambda i: self.start(asked, i, tenant), self.metrics.reply, released)
        except BaseException:
            released()
            raise
        try:
            return await self.answer(request, asked, choices)
        except ClientGone:
            return Response(status_code=499)  # (nobody reads it)
        except BaseException:
            choices.cancel()
            raise

    def start(self, asked: ChatRequest, index: int, tenant: str) -> Stream:
        """Choice ``index``'s stream (in its thread): the request's options, its seed moved on
        by the index so the choices differ."""
        options = asked.options
        if index and options.seed is not None:
            options = dataclasses.replace(options, seed=(options.seed + index) % 0xFFFFFFFF)
        return self.model.chat_stream(
            asked.messages, options, tenant=tenant, share_prefix=False, **self.session_args
        )

    async def answer(self, request: Request, asked: ChatRequest, choices: Choices) -> Response:
        """The first event of every choice decides the status: an error before any token is
        the request's error; else the whole reply, or a stream of it."""
        first = await until(request, choices, whole=not asked.stream)
        failed = next((e.error for e in first if e.error is not None), None)
        if failed is not None:
            choices.cancel()
            raise self.explain(failed)
        completion = sse.Completion(self.model_name, asked.include_usage)
        if not asked.stream:
            replies = sorted((e for e in first if e.reply is not None), key=lambda e: e.index)
            return JSONResponse(completion.body([e.reply for e in replies if e.reply is not None]))
        return EventStream(self.events(choices, first, completion), choices.cancel)

    async def events(
        self, choices: Choices, first: list[Event], completion: sse.Completion
    ) -> AsyncIterator[bytes]:
        """The SSE body: every choice's role, then its pieces as they come, its finish, the
        usage if asked, ``[DONE]``. An error mid-stream is an error event (and is logged if it
        is the server's)."""
        replies: dict[int, Reply] = {}
        pending = list(first)
        try:
            for index in range(choices.n):
                yield sse.event(completion.opening(index))
            while len(replies) < choices.n:
                event = pending.pop(0) if pending else await choices.queue.get()
                if event.error is not None:
                    yield sse.event(self.explain(event.error).body())
                    break
                if event.snapshot is not None:
                    for chunk in completion.pieces(event.index, event.snapshot):
                        yield sse.event(chunk)
                elif event.reply is not None:
                    replies[event.index] = event.reply
                    yield sse.event(completion.finish(event.index, event.reply))
            else:
                if completion.include_usage:
                    yield sse.event(completion.usage_chunk([replies[i] for i in range(choices.n)]))
            yield sse.DONE
        finally:
            choices.cancel()

    @staticmethod
    def explain(error: BaseException) -> RequestError:
        """A library error as the client sees it; an unexpected one logged with its traceback."""
        known = from_library(error)
        if known is None:
            log.error("a request failed", exc_info=error)
            return internal()
        return known


async def until(request: Request, choices: Choices, *, whole: bool) -> list[Event]:
    """Events of ``choices`` until every choice sent its first (or, ``whole``, its last) or one
    failed; ``whole`` keeps only the last ones. A client that disconnects meanwhile cancels them
    (``ClientGone``)."""
    events: list[Event] = []
    heard: set[int] = set()
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while len(heard) < choices.n and not (events and events[-1].error is not None):
            get = asyncio.ensure_future(choices.queue.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                event = get.result()
                if event.last or not whole:
                    events.append(event)
                    heard.add(event.index)
            else:
                get.cancel()
            if gone in done:
                choices.cancel()
                raise ClientGone
    finally:
        gone.cancel()
    return events


async def disconnected(request: Request) -> None:
    """Returns once the client is gone (the body was read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def refuse(request: Request, error: Exception) -> Response:
    """Errors raised in a route, as OpenAI's error body."""
    if isinstance(error, HTTPException):
        code = "not_found" if error.status_code == 404 else None
        return error_response(RequestError(str(error.detail), None, code, error.status_code))
    return error_response(Server.explain(error))


def create_app(
    model: Model,
    *,
    api_key: str | Sequence[str] | None = None,
    model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    queue: int = 64,
    **session_args: Any,
) -> Starlette:
    """The server's ASGI app on ``model`` (which the caller opens and closes). ``api_key``: one
    key or several; with any, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``
    and each key is a tenant of its own. ``queue``: requests that may wait for room before a 503.
    ``session_args`` go to every stateless session (``context_size``, ...)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not isinstance(key, str) or not key for key in keys):
        raise ValueError("an API key must be a non-empty str")
    name = model_name or model.path.stem
    server = Server(
        model,
        api_keys=keys,
        model_name=name,
        max_body_bytes=max_body_bytes,
        queue=queue,
        session_args=session_args,
    )
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model_card, methods=["GET"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes, exception_handlers={RequestError: refuse, HTTPException: refuse, Exception: refuse}
    )
    app.add_middleware(Counting, metrics=server.metrics)
    app.state.server = server
    return app
