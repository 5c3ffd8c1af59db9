"""What an operator asks of a server of several models (``hosts.ManyModels``), behind the API
key: ``GET /api/ps`` (Ollama's: the models loaded now, what each holds and when it unloads),
``POST /models/load`` and ``POST /models/unload`` with ``{"model": NAME}``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmsession.serve.body import parse_json
from llmsession.serve.errors import ApiError, too_large
from llmsession.serve.hosts import ManyModels, not_found
from llmsession.serve.http import declared
from llmsession.serve.tally import Tally

if TYPE_CHECKING:
    from llmsession.api.modelfiles import ModelStatus
    from llmsession.serve.hosts import OneModel


class Server(Protocol):
    """What these routes need of ``app.Server``."""

    hosts: OneModel | ManyModels
    embedding: asyncio.Semaphore  # embedding runs at once
    waiting: Tally  # requests waiting for one
    max_body_bytes: int  # the server's bound on a body

    def parsed_body(
        self, request: Request, limit: int | None = None
    ) -> contextlib.AbstractAsyncContextManager[bytes]: ...


def several(server: Server) -> ManyModels:
    if not isinstance(server.hosts, ManyModels):
        raise ApiError("this server has one model: it neither loads nor unloads models", None, None, 400)
    return server.hosts


MAX_OPERATOR_BODY = 64 << 10  # {"model": NAME} and little else


async def named(server: Server, request: Request) -> tuple[ManyModels, str]:
    """The models and the name an operator's body asks for, read as a chat's body is (a few at
    once, parsed off the event loop: JSON of megabytes takes seconds) and bounded far tighter."""
    hosts = several(server)
    limit = min(MAX_OPERATOR_BODY, server.max_body_bytes)  # (the bound ``Server.body`` keeps)
    if declared(request) > limit:  # (refused at once, not after a parser slot)
        raise too_large(limit)
    async with server.parsed_body(request, MAX_OPERATOR_BODY) as raw:  # (a few at once)
        body = await asyncio.to_thread(parse_json, raw)
    name = body.get("model")
    if not isinstance(name, str) or name not in hosts.models:
        raise not_found(name if isinstance(name, str) else None, hosts.names)
    return hosts, name


def loaded_entry(status: ModelStatus, context: int | None) -> dict[str, Any]:
    """A loaded model as Ollama's ``/api/ps`` lists it, and what llmsession knows besides."""
    expires = None
    if status.unloads_in is not None:
        at = datetime.fromtimestamp(time.time() + status.unloads_in, timezone.utc)
        expires = at.isoformat(timespec="seconds").replace("+00:00", "Z")
    return {
        "name": status.name,
        "model": status.name,
        "size": status.resident_bytes,
        "size_vram": 0,
        "context_length": context,
        "expires_at": expires,
        "in_use": status.users,
        "images": status.images,
    }


async def ps(server: Server, request: Request) -> Response:
    hosts = several(server)
    statuses = await asyncio.to_thread(hosts.models.status)
    return JSONResponse({"models": [loaded_entry(s, hosts.context_size(s)) for s in statuses if s.loaded]})


async def load(server: Server, request: Request) -> Response:
    hosts, name = await named(server, request)
    _, held = await hosts.held(name, None)  # (its loader thread, as a request's)
    held.drop()
    return JSONResponse({"model": name, "status": "loaded"})


async def unload(server: Server, request: Request) -> Response:
    hosts, name = await named(server, request)
    if not await asyncio.to_thread(hosts.models.unload, name):
        raise ApiError(f"model {name!r} is in use (or loading): not unloaded", "model", "model_in_use", 409)
    return JSONResponse({"model": name, "status": "unloaded"})


ROUTES = (("/api/ps", ps, "GET"), ("/models/load", load, "POST"), ("/models/unload", unload, "POST"))
