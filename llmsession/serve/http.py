"""HTTP around the routes: one place a key is checked and errors are answered (``guarded``),
the counters of responses (``Counting``), and a refused request's body read and dropped before
its answer (``drain``). Every error a route raises becomes its response inside the route, in its
API's error body (``Style``), so the counters see the status the client gets, and it is logged
once. A request refused before its body was read (over the size limit, a wrong key) has the rest
of its body read and dropped first, within bounds, so a client that sends its whole body before
it reads gets its answer rather than a reset connection.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmsession.serve.chat import explain
from llmsession.serve.errors import ApiError
from llmsession.serve.metrics import Metrics

Handler = Callable[[Request], Awaitable[Response]]
DRAIN_BYTES = 64 << 20  # of a refused request's body, read and dropped before the answer
DRAIN_SECONDS = 10.0  # (and no longer: then the answer closes the connection)
PATHS = (
    "/",
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/api/ps",
    "/models/load",
    "/models/unload",
)
Style = Callable[[ApiError], dict[str, Any]]  # an API's error body


def openai_error(error: ApiError) -> dict[str, Any]:
    return error.body()


def error_response(error: ApiError, style: Style = openai_error) -> JSONResponse:
    return JSONResponse(style(error), error.status, headers=error.headers())


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
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    if path.startswith("/v1/models/"):
        return "/v1/models/{name}"
    return "/static/" if path.startswith("/static/") else "other"


def guarded(
    route: Handler, authorize: Callable[[Request], str | None] | None = None, style: Style = openai_error
) -> Handler:
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
            return await refuse(request, error, style)

    return answer


def refusing(prefixes: dict[str, Style]) -> Callable[[Request, Exception], Awaitable[Response]]:
    """``refuse`` for what no route answers (an unknown path, a method it does not take), in
    the error body of the API whose paths begin with one of ``prefixes`` (else OpenAI's)."""

    async def handle(request: Request, error: Exception) -> Response:
        root, path = request.scope.get("root_path", ""), request.url.path  # (an app mounted under root)
        path = path[len(root) :] if root and path.startswith(root) else path
        matched = (
            style for prefix, style in prefixes.items() if path == prefix or path.startswith(f"{prefix}/")
        )
        return await refuse(request, error, next(matched, openai_error))

    return handle


async def refuse(request: Request, error: Exception, style: Style = openai_error) -> Response:
    """An error raised in a route, as its API's error body (unexpected ones logged: ``explain``),
    once the rest of the request's body is read (``drain``); if it could not be, the answer
    closes the connection."""
    if isinstance(error, HTTPException):
        code = "not_found" if error.status_code == 404 else None
        response = error_response(ApiError(str(error.detail), None, code, error.status_code), style)
        response.headers.update(error.headers or {})  # a 405's Allow
    else:
        response = error_response(explain(error), style)
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
    ``DRAIN_BYTES`` and ``DRAIN_SECONDS``, and none of a body declared larger, one past its
    deadline already (its 408 comes at the deadline, not ``DRAIN_SECONDS`` after), or one whose
    client waits for 100 Continue before it sends (it is answered at once instead). False past
    those: the answer then closes the connection (uvicorn would drop the rest of the body for as
    long as it came, on a connection kept alive)."""
    if getattr(request.state, "body_read", False):
        return True
    waiting = request.headers.get("expect", "").lower() == "100-continue"
    if (
        getattr(request.state, "body_late", False)
        or declared(request) > DRAIN_BYTES
        or (waiting and not getattr(request.state, "body_asked", False))
    ):
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
