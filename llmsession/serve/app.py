"""The Starlette application of ``llmsession serve``: OpenAI's chat completions on a model.

Each route's key is checked in one place (``guarded``); a route reads and checks a request
(``schema``, in a worker thread, a few at a time: a large body is neither parsed on the event
loop nor held by many requests at once), then hands it to ``chat.Call``. Every error a route
raises becomes its response inside the route, so the counters (``Counting``) see the status the
client gets, and it is logged once. A request refused before its body was read (over the size
limit, a wrong key) has the rest of its body read and dropped first, within bounds (``drain``),
so a client that sends its whole body before it reads gets its answer rather than a reset
connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmsession.config import SessionConfig
from llmsession.options import INT32_MAX
from llmsession.serve.body import parse_json
from llmsession.serve.chat import Call, Host, explain
from llmsession.serve.errors import ApiError
from llmsession.serve.metrics import Metrics
from llmsession.serve.page import routes as page_routes
from llmsession.serve.runner import Admission
from llmsession.serve.schema import ChatRequest, chat_request, completion_request

if TYPE_CHECKING:
    from llmsession.api.model import Model

MAX_BODY_BYTES = 8 << 20
DRAIN_BYTES = 64 << 20  # of a refused request's body, read and dropped before the answer
DRAIN_SECONDS = 10.0  # (and no longer: then the answer closes the connection)
PARSERS = 4  # requests reading or checking their body at once
PATHS = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")
Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers())


def digest(*parts: str | None) -> str:
    """A tenant's name: a sha256 of its key's digest and its ``user`` (bounded, whatever the
    user sent; the library keeps records by tenant)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


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
            self.metrics.request(counted_path(scope.get("path", "")), status)


def counted_path(path: str) -> str:
    """A request's path as ``/metrics`` labels it: a known one, the page's files as one, or
    "other" (a label per unknown path would let any client grow the counters without bound)."""
    if path in PATHS:
        return path
    return "/static/" if path.startswith("/static/") else "other"


class Server:
    """What the routes share: the host of the calls (model, admission, counters), the keys'
    digests, the body limit."""

    def __init__(
        self,
        model: Model,
        *,
        api_keys: Sequence[str],
        model_name: str,
        max_body_bytes: int,
        queue: int,
        settings: SessionConfig,
        draft: str | None = None,
    ) -> None:
        admission = Admission(model.memory().max_live_sessions, queue)
        self.draft = draft  # every request's drafted tokens (the API has no field for them)
        self.host = Host(model, model_name, settings, admission)
        self.model, self.model_name, self.metrics = model, model_name, self.host.metrics
        self.keys = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self.max_body_bytes = max_body_bytes
        self.parsing = asyncio.Semaphore(PARSERS)
        self.created = int(time.time())

    @property
    def admission(self) -> Admission:
        return self.host.admission

    def authorize(self, request: Request) -> str | None:
        """Who is calling: its key's digest (None without keys); else a 401. Digests are
        compared, so the time taken says nothing of a key's length; every key is compared."""
        if not self.keys:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        presented = hashlib.sha256(token).digest()
        matched = [hmac.compare_digest(presented, key) for key in self.keys]
        if not any(matched):
            raise ApiError("invalid or missing API key", None, "invalid_api_key", 401)
        return self.keys[matched.index(True)].hex()

    async def body(self, request: Request) -> bytes:
        """The request body, refused (413) past the size limit before it is all read."""
        too_big = ApiError(
            f"the request body is over the limit of {self.max_body_bytes} bytes", None, None, 413
        )
        if declared(request) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        request.state.body_asked = True  # (a client waiting for 100 Continue is now sending)
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError("the client went away", None, None, 499) from None
        request.state.body_read = True  # (``drain`` reads no further)
        return b"".join(chunks)

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.model.closed:
            return JSONResponse({"status": "closed"}, 503)
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model_card(self, request: Request) -> Response:
        if request.path_params["name"] != self.model_name:
            raise ApiError(f"no model {request.path_params['name']!r:.80}", "model", "model_not_found", 404)
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
        """The counters: the whole server's, whichever key asks (``README``)."""
        states: list[str] = []
        if not self.model.closed:
            report = await asyncio.to_thread(self.model.memory)  # (it waits for the engine's lock)
            states = [session.state for session in report.sessions]
        return PlainTextResponse(self.metrics.render(states), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        """A raw prompt continued without the chat template (``Model.complete_stream``)."""
        return await self.answer(request, lambda body: completion_request(parse_json(body)))

    async def chat(self, request: Request) -> Response:
        return await self.answer(request, self.checked)

    async def answer(self, request: Request, checked: Callable[[bytes], ChatRequest]) -> Response:
        key: str | None = request.state.key  # (``guarded`` asked ``authorize``)
        async with self.parsing:  # (a few bodies in memory at once; parsed off the event loop)
            body = await self.body(request)
            asked = await asyncio.to_thread(checked, body)
        if self.draft is not None:  # (the exchange leaves them out where they are unsound)
            asked = dataclasses.replace(asked, options=dataclasses.replace(asked.options, draft=self.draft))
        limit = self.admission.limit
        if asked.n > limit:
            raise ApiError(f"n: at most {limit} choices on this server (max_live_sessions)", "n")
        return await Call(self.host, request, asked, digest(key, asked.user)).respond()

    @staticmethod
    def checked(body: bytes) -> ChatRequest:
        return chat_request(parse_json(body), INT32_MAX)


def guarded(route: Handler, authorize: Callable[[Request], str | None] | None = None) -> Handler:
    """``route`` behind ``authorize`` (the one place a key is checked: its digest goes to
    ``request.state.key``), answering any error itself, so the counting middleware sees the
    status the client gets and nothing else logs it again (Starlette's handler for
    ``Exception`` runs outside every middleware, and re-raises to the server, which logs it a
    second time)."""

    @functools.wraps(route)
    async def answer(request: Request) -> Response:
        try:
            if authorize is not None:
                request.state.key = authorize(request)
            return await route(request)
        except Exception as error:
            return await refuse(request, error)

    return answer


async def refuse(request: Request, error: Exception) -> Response:
    """An error raised in a route, as OpenAI's error body (unexpected ones logged: ``explain``),
    once the rest of the request's body is read (``drain``); if it could not be, the answer
    closes the connection."""
    if isinstance(error, HTTPException):
        code = "not_found" if error.status_code == 404 else None
        response = error_response(ApiError(str(error.detail), None, code, error.status_code))
    else:
        response = error_response(explain(error))
    if not await drain(request):
        response.headers["Connection"] = "close"
    return response


def declared(request: Request) -> int:
    """The body's size as its Content-Length says (0 without one; a 40-digit one is read as
    past every bound, not converted)."""
    length = request.headers.get("content-length", "")
    if not length.isdigit():
        return 0
    return int(length) if len(length) <= 18 else 1 << 62


async def drain(request: Request) -> bool:
    """Read and drop what is left of a refused request's body; True once it has all come, so
    the connection may serve another request. A client that sends its whole body before it
    reads (urllib, which also asks for the connection to be closed after) would otherwise have
    it closed with its body unread, which the kernel answers with a reset: the client never
    reads its answer (issue 39). Bounded as nginx bounds its lingering close: at most
    ``DRAIN_BYTES`` and ``DRAIN_SECONDS``, and none of a body declared larger, or one whose
    client waits for 100 Continue before it sends (it is answered at once instead). False past
    those: the answer then closes the connection (uvicorn would drop the rest of the body for as
    long as it came, on a connection kept alive)."""
    if getattr(request.state, "body_read", False):
        return True
    waiting = request.headers.get("expect", "").lower() == "100-continue"
    if declared(request) > DRAIN_BYTES or (waiting and not getattr(request.state, "body_asked", False)):
        return False
    receive = request.receive

    async def drop() -> bool:
        dropped = 0
        while dropped <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":  # (the client went away)
                return False
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    try:
        return await asyncio.wait_for(drop(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        return False


def create_app(
    model: Model,
    *,
    api_key: str | Sequence[str] | None = None,
    model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    queue: int = 64,
    cors_origins: Sequence[str] = (),
    draft: str | None = None,
    session: SessionConfig | None = None,
) -> Starlette:
    """The server's ASGI app on ``model`` (which the caller opens and closes). ``api_key``: one
    key or several; with any, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``
    and each key is a tenant of its own. ``queue``: requests that may wait for room before a 503.
    ``cors_origins``: the web origins whose pages may call the API (none by default: a page
    elsewhere cannot read its answers). ``draft``: drafted tokens for every request
    (``GenerationOptions.draft``).
    ``session``: every stateless session's settings (``context_size``, ...; its ``system``
    must be None: a request's system prompt is in its messages)."""
    settings = session or SessionConfig()
    if not isinstance(settings, SessionConfig):
        raise TypeError(f"session must be a SessionConfig, got {type(settings).__name__}")
    if settings.system is not None:
        raise ValueError("a request's system prompt is in its messages: session.system must be None")
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
        settings=settings,
        draft=draft,
    )
    keyed = server.authorize
    routes = [
        *page_routes(),  # the chat page at / (no data in it: no key needed)
        Route("/health", guarded(server.health), methods=["GET"]),  # (open: a load balancer's probe)
        Route("/metrics", guarded(server.metrics_text, keyed), methods=["GET"]),
        Route("/v1/models", guarded(server.models, keyed), methods=["GET"]),
        Route("/v1/models/{name:path}", guarded(server.model_card, keyed), methods=["GET"]),
        Route("/v1/chat/completions", guarded(server.chat, keyed), methods=["POST"]),
        Route("/v1/completions", guarded(server.completions, keyed), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: refuse, HTTPException: refuse})
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(Counting, metrics=server.metrics)
    app.state.server = server
    return app
