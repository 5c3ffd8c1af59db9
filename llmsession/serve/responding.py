"""The routes of OpenAI's Responses API: ``POST /v1/responses`` on the engine's sessions, and
``GET`` / ``DELETE /v1/responses/{id}`` on the responses kept (``store``).

A response with ``store: true`` is known from its start: while it runs, ``GET`` returns it
``in_progress`` (as its ``response.created`` event showed it), ``DELETE`` forgets it (it is
not kept when it ends) and a ``previous_response_id`` naming it is refused (400: there is no
reply to continue yet). However it ends (finished, failed, its client gone), it stops being in
progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmsession.replies import Reply, assistant_message
from llmsession.serve.body import parse_json
from llmsession.serve.chat import Door, EventStream
from llmsession.serve.doors import ResponsesDoor
from llmsession.serve.errors import ApiError
from llmsession.serve.hosts import ManyModels, OneModel
from llmsession.serve.rendering import rendered
from llmsession.serve.responses import ResponsesAsk, responses_ask, responses_request
from llmsession.serve.responses_sse import ResponseObject, response_id
from llmsession.serve.schema import ChatRequest
from llmsession.serve.store import ResponseStore, Stored, sized_transcript
from llmsession.serve.translation import Volatile

log = logging.getLogger("llmsession.serve")
PIECE = 1 << 16  # a stored body is sent this much at a time (``in_pieces``)


class Serving(Protocol):
    """What these routes use of the server (``app.Server``)."""

    hosts: OneModel | ManyModels
    store: ResponseStore
    volatile: Volatile

    def parsed_body(
        self, request: Request, limit: int | None = None
    ) -> contextlib.AbstractAsyncContextManager[bytes]: ...
    def front_named(self, request: Request) -> tuple[str | None, str | None]: ...
    async def answer(self, request: Request, asked: ChatRequest, door: Door) -> Response: ...


def not_found(kind: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(f"no {kind} with id {ident!r:.80}", param, "not_found", 404)


def unknown_previous(ident: str) -> ApiError:
    """A ``previous_response_id`` nothing is stored under (or another tenant's), as OpenAI says
    it: a 400 with ``previous_response_not_found``, the code clients and proxies read to send
    the whole transcript again instead (a 404 is for retrieving one)."""
    message = f"Previous response with id {ident!r:.80} not found."
    return ApiError(message, "previous_response_id", "previous_response_not_found", 400)


def continued(
    history: list[dict[str, Any]], fresh: list[dict[str, Any]], after: Stored | None
) -> tuple[list[dict[str, Any]], tuple[int, int]]:
    """The transcript a response keeps: its predecessor's (``after``'s) own messages (the same
    objects: a chain of N responses holds each message once, as the store sizes it) and the new
    ones, else the checked transcript's copy, sized whole; and its size (``sized_transcript``)."""
    n = len(history)
    if fresh[:n] == history:
        transcript = [*history, *fresh[n:]]
        return transcript, sized_transcript(transcript, after)
    return fresh, sized_transcript(fresh, None)


def _read(server: Serving, body: bytes) -> ResponsesAsk:
    """A body, checked, its outputs' images as the model it names takes them (one without
    images reads each as a line of text)."""
    parsed = parse_json(body)
    named = parsed.get("model") if isinstance(parsed, dict) else None
    return responses_ask(parsed, images=server.hosts.images(named if isinstance(named, str) else None))


async def create(server: Serving, request: Request) -> Response:
    """``POST /v1/responses``: a ``previous_response_id`` continues that response's transcript
    (the stateless sessions hold its state: only the new input is decoded); ``store`` keeps the
    response for retrieval and continuation."""
    key: str | None = request.state.key
    store = server.store
    async with server.parsed_body(request) as body:  # (a few parsed at once, off the loop)
        ask = await asyncio.to_thread(_read, server, body)
        history: list[dict[str, Any]] = []
        stored = None
        if ask.previous is not None:
            stored = store.get(ask.previous, key)
            if stored is None:
                if store.running(ask.previous, key) is not None:
                    raise ApiError(
                        f"response {ask.previous!r:.80} is still in progress: continue it once it ended",
                        "previous_response_id",
                    )
                raise unknown_previous(ask.previous)
            history = stored.transcript
        asked = await asyncio.to_thread(responses_request, ask, history)
        start = 1 if ask.instructions else 0  # (the checked transcript's copy, made off the event loop)
        transcript, sized = await asyncio.to_thread(
            lambda: continued(history, asked.messages.messages()[start:], stored)
        )
        dropped = await asyncio.to_thread(server.volatile.dropped, asked.messages)
    asked = dataclasses.replace(asked, messages=dropped)
    ident = response_id(*server.front_named(request))
    response = ResponseObject(server.hosts.served(asked.model), ask.echo, ask.previous, ask.store, ident)
    response.logprobs = asked.options.logprobs is not None
    if not ask.store:
        return await server.answer(request, asked, ResponsesDoor(response))

    def keep(body: dict[str, Any], reply: Reply, text: bytes | None) -> None:
        whole = [*transcript, assistant_message(reply)]
        if not store.put(key, body, whole, sized=sized, text=text):
            body["store"] = False  # (what the response not streamed says; a stream's is sent)
            log.warning(
                "response %s was not stored: larger than the store takes, or than its key may hold", ident
            )

    store.begin(ident, key, await asyncio.to_thread(rendered, response.body("in_progress", [], None)))
    try:
        answered = await server.answer(request, asked, ResponsesDoor(response, keep))
    except BaseException:
        store.end(ident)
        raise
    if isinstance(answered, EventStream):  # (it runs on: it ends however the stream ends)
        answered.also(lambda: store.end(ident))
    else:
        store.end(ident)
    return answered


async def stored(server: Serving, request: Request) -> Response:
    """``GET`` / ``DELETE /v1/responses/{id}``: a kept response (or one still in progress) of
    the caller's key; another key's is unknown."""
    ident, key = request.path_params["id"], request.state.key
    kept = server.store.get(ident, key)
    running = server.store.running(ident, key) if kept is None else None
    if kept is None and running is None:
        raise not_found("response", ident)
    if request.method == "DELETE":
        server.store.delete(ident, key)
        return JSONResponse({"id": ident, "object": "response", "deleted": True})
    return in_pieces(
        kept.rendered if kept is not None else running or b""
    )  # (as rendered when kept, or begun)


def in_pieces(data: bytes) -> Response:
    """A JSON body sent ``PIECE`` bytes at a time: the server waits for its client between
    pieces, so one that does not read holds a piece in its connection's buffer, not a copy of
    it all (a stored response of 17 MB, asked for by many connections that never read)."""

    async def pieces() -> AsyncIterator[bytes]:
        for at in range(0, len(data), PIECE):
            yield data[at : at + PIECE]

    length = {"content-length": str(len(data))}
    return StreamingResponse(pieces(), media_type="application/json", headers=length)
