"""One chat completion request on the engine (``Call``), from its admission to its last byte.

Every request goes through the model's stateless routing (``Model.chat_stream``), so a client
that resends its history decodes only the new turn; its tenant is a digest of its API key and its
``user``, with ``share_prefix=False``, so two tenants never share cells (one's timings tell nothing
of another's prompts). Each choice decodes in a thread of its own (``runner``): concurrent
requests are batched by the engine, and the event loop never waits for a decode. ``n`` choices
fork one prefill (``Model.chat_choices``). A client that goes away, even while it waits for room,
cancels its exchange within a token and leaves the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from llmsession.config import SessionConfig
from llmsession.errors import (
    BackendError,
    MemoryBudgetError,
    ModelClosedError,
    ModelOutputError,
    UnavailableError,
)
from llmsession.replies import Reply, Usage
from llmsession.serve.errors import ApiError, as_asked, from_library, internal
from llmsession.serve.metrics import Metrics
from llmsession.serve.rendering import rendered
from llmsession.serve.runner import Admission, Choices, Event, Relay
from llmsession.serve.schema import ChatRequest

if TYPE_CHECKING:
    from llmsession import Stream
    from llmsession.api.model import Model

log = logging.getLogger("llmsession.serve")
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response began."""


def explain(error: BaseException) -> ApiError:
    """An error as the client sees it; an unexpected one logged with its traceback, a full
    memory budget with its detail (which tells of other tenants: the client never sees it)."""
    known = from_library(error)
    if known is None:
        log.error("a request failed", exc_info=error)
        return internal()
    if isinstance(error, MemoryBudgetError):
        log.warning("a request found the memory budget full: %s", error)
    elif isinstance(error, UnavailableError) and not isinstance(error, ModelClosedError):
        log.warning("a request found the model busy", exc_info=error)  # (the server's own doing)
    elif isinstance(error, BackendError):
        log.error("the model's worker process failed", exc_info=error)
    elif isinstance(error, ModelOutputError):  # (the operator's to know: the file is broken)
        log.error("the model computed what no answer can hold: %s", error)
    return known


class Caller(NamedTuple):
    """Whose request this is: its tenant, and the conversation a cluster's front named (a
    label its session takes, for handing it on: ``Model.take_conversation``)."""

    tenant: str
    conversation: str | None = None


@dataclass
class Host:
    """What every call shares: the model, its name in the API, its sessions' settings, the
    admission and the counters."""

    model: Model
    name: str
    settings: SessionConfig  # every stateless session's (``create_app(session=...)``)
    admission: Admission
    metrics: Metrics = field(default_factory=Metrics)

    def choices(self, asked: ChatRequest, caller: Caller, released: Callable[[], None]) -> Choices:
        """A request's choices, started: one stateless call, or the library's ``n`` choices of
        one prefill (``Model.chat_choices``), kept apart by tenant."""
        kept = session_settings(self.settings, asked)
        whose: dict[str, Any] = {"tenant": caller.tenant, "conversation": caller.conversation, "config": kept}
        if asked.n == 1:

            def call(index: int) -> Stream:
                if asked.prompt is not None:
                    return self.model.complete_stream(asked.prompt, asked.options, **whose)
                return self.model.chat_stream(asked.messages, asked.options, **whose)

            return Choices(1, call, self.metrics.reply, released)
        if asked.prompt is not None:
            forks = self.model.complete_choices(asked.prompt, asked.options, n=asked.n, **whose)
        else:
            forks = self.model.chat_choices(asked.messages, asked.options, n=asked.n, **whose)
        counted = False  # (the shared prompt: with the first reply)

        def ended(reply: Reply) -> None:  # (each fork's usage counts the shared prompt as reused)
            nonlocal counted
            shared = forks.prompt  # (None: separate calls, a model in a worker process)
            self.metrics.reply(reply, forked=shared is not None, prompt=None if counted else shared)
            counted = True

        return Choices(asked.n, forks.__getitem__, ended, released, forks)


class Held:
    """A model held for one request: once by the request, once more by each run of its choices
    (``chat.Call``); ``release`` runs once the last is dropped. Thread-safe (runs end on their
    decode threads)."""

    def __init__(self, release: Callable[[], None] | None = None) -> None:
        self._release = release
        self._count = 1
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            if self._count <= 0:
                raise RuntimeError("a request's model was held after it was released")
            self._count += 1

    def drop(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last and self._release is not None:
            self._release()


class Door(Protocol):
    """How one API answers a request that ran: its whole body, or its stream of events (which
    begins once every choice sent its first event, or after ``patience`` seconds: a stream
    whose first events are late then begins without them, and keeps its client waiting with
    its API's keep-alive events)."""

    patience: float | None

    def whole(self, replies: list[Reply], prompt: Usage | None) -> dict[str, Any]:
        """The whole body (made off the event loop)."""

    def settle(self, body: dict[str, Any], replies: list[Reply], text: bytes) -> bool:
        """What the door does with a whole body (and ``text``, its rendering) before it is
        sent, on the event loop (a stored response is kept in the loop's store); True if it
        changed ``body`` (rendered again)."""

    def stream(self, choices: Choices | Relay, first: list[Event]) -> AsyncIterator[bytes]: ...


def session_settings(settings: SessionConfig, asked: ChatRequest) -> SessionConfig:
    """A request's stateless session settings: the server's, kept apart by tenant, thinking as
    the request asks if it does."""
    thinking = settings.thinking if asked.thinking is None else asked.thinking
    return dataclasses.replace(settings, share_prefix=False, thinking=thinking)


SEND_SECONDS = 60.0  # the longest one write of a stream may wait for its client to read


class Unread(Exception):
    """A stream's client read nothing for ``SEND_SECONDS``, its connection open."""


class EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (a finished stream, a
    client gone, a server stopping, a client that reads nothing for ``SEND_SECONDS``: uvicorn's
    send has no deadline, so its stream, its model's hold and its store entry stayed for as long
    as the client kept the connection open), so the exchanges behind it never outlive it."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.closing = [on_close]

    def also(self, on_close: Callable[[], None]) -> None:
        """Run ``on_close`` too once the response ended (after those given before)."""
        self.closing.append(on_close)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), SEND_SECONDS)
            except asyncio.TimeoutError:  # (on 3.10, not the builtin)
                raise Unread from None

        try:
            await super().__call__(scope, receive, timed)
        except Unread:  # (uvicorn closes the connection of a response left unfinished)
            log.warning("a stream's client read nothing for %s s: the stream ended", SEND_SECONDS)
        finally:
            failed: list[BaseException] = []
            for on_close in self.closing:  # (each runs, whatever the one before raised)
                try:
                    on_close()
                except BaseException as error:
                    failed.append(error)
            if failed:
                raise failed[0]


class Call:
    """One request: admitted (or queued, or a 503), its choices started, their first events
    deciding the status. A full memory budget before any token is retried once, behind the
    requests running then (admission counts sequences, not KV cells). The client's disconnect
    is raced against every wait."""

    def __init__(
        self, host: Host, request: Request, asked: ChatRequest, caller: Caller, door: Door, held: Held
    ) -> None:
        self.host, self.request, self.asked, self.caller, self.door = host, request, asked, caller, door
        self.held = held  # (its model, held until it answered and its last run ended)
        self._key: str | None = getattr(request.state, "key", None)  # (its caller's: a fair share)

    async def respond(self) -> Response:
        gone = asyncio.ensure_future(disconnected(self.request))
        try:
            return await self._respond(gone)
        except ClientGone:
            return Response(status_code=499)  # (nobody reads it)
        finally:
            gone.cancel()
            self.held.drop()

    async def _respond(self, gone: asyncio.Future[None]) -> Response:
        asked, admission = self.asked, self.host.admission
        for retry in (False, True):
            size = getattr(self.request.state, "body_bytes", 0)  # (a body waiting is held parsed)
            granted = admission.acquire(asked.n, behind=retry, caller=self._key, size=size)
            weight = await race(gone, granted, lambda weight: admission.release(weight, self._key))
            if gone.done():  # (gone as it was admitted, in one turn of the loop: nothing starts)
                admission.release(weight, self._key)
                raise ClientGone
            choices = self._start(weight)
            try:
                patience = self.door.patience if asked.stream else None
                first = await until(gone, choices, whole=not asked.stream, patience=patience)
            except BaseException:
                choices.cancel()
                raise
            failed = next((e.error for e in first if e.error is not None), None)
            if failed is None:
                return await self._answer(choices, first, retried=retry)
            choices.cancel()
            if retry or not isinstance(failed, MemoryBudgetError):
                raise as_asked(explain(failed), asked.options)
            log.info("a request found the memory budget full; it waits for a running one: %s", failed)
            await race(gone, choices.finished.wait())  # (its own runs give their room back first)
        raise AssertionError("unreachable")

    def _start(self, weight: int) -> Choices:
        host, held = self.host, self.held
        host.metrics.flight(1)
        held.hold()

        def released() -> None:
            host.admission.release(weight, self._key)
            host.metrics.flight(-1)
            held.drop()

        try:
            return host.choices(self.asked, self.caller, released)
        except BaseException:
            released()
            raise

    async def _answer(self, choices: Choices, first: list[Event], *, retried: bool) -> Response:
        """The whole reply, or a stream of it from the first events on (one begun before any,
        past the door's patience, may still find the memory budget full: ``Relay``). A whole
        body is made and rendered off the event loop, in slices (``rendering``), then settled on
        it (``Door.settle``: a stored response keeps that rendering)."""
        if not self.asked.stream:
            ended = sorted((e for e in first if e.reply is not None), key=lambda e: e.index)
            replies = [e.reply for e in ended if e.reply is not None]
            prompt = choices.forks.prompt if choices.forks is not None else None
            body = await asyncio.to_thread(self.door.whole, replies, prompt)
            text = await asyncio.to_thread(rendered, body)
            if self.door.settle(body, replies, text):  # (it says it was not stored: rare)
                text = await asyncio.to_thread(rendered, body)
            return Response(text, media_type="application/json")
        flow: Choices | Relay = choices
        if not first and not retried:
            flow = Relay(choices, self._again, self.held.hold, self.held.drop)
        return EventStream(self.door.stream(flow, first), flow.cancel)

    async def _again(self) -> Choices:
        """The request's choices once more, behind the requests running now (its stream has
        begun: its client's going away cancels this through the stream's ``cancel``)."""
        log.info("a stream found the memory budget full before its first token; it waits for a running one")
        size = getattr(self.request.state, "body_bytes", 0)
        weight = await self.host.admission.acquire(self.asked.n, behind=True, caller=self._key, size=size)
        return self._start(weight)


async def until(
    gone: asyncio.Future[None], choices: Choices, *, whole: bool, patience: float | None = None
) -> list[Event]:
    """Events of ``choices`` until every choice sent its first (or, ``whole``, its last) or one
    failed, or ``patience`` seconds passed; ``whole`` keeps only the last ones. ``ClientGone``
    if the client leaves first."""
    events: list[Event] = []
    heard: set[int] = set()
    loop = asyncio.get_running_loop()
    deadline = None if patience is None else loop.time() + patience
    while len(heard) < choices.n and not (events and events[-1].error is not None):
        if deadline is None:
            event = await race(gone, choices.queue.get())
        else:
            try:
                event = await race(gone, asyncio.wait_for(choices.queue.get(), deadline - loop.time()))
            except asyncio.TimeoutError:  # (on 3.10, not the builtin)
                break
        if event.last or not whole:
            events.append(event)
            heard.add(event.index)
    return events


async def race(
    gone: asyncio.Future[None], work: Awaitable[T], lost: Callable[[T], object] | None = None
) -> T:
    """``work``'s result, unless the client goes away first: then ``work`` is cancelled (a
    place in the queue is given up) and ``ClientGone`` raised. A result that came as the caller
    itself was cancelled (a replica's request stopped, the server shutting down) is given to
    ``lost`` (what it holds given back: it was lost, and a place with it, for good)."""
    task = asyncio.ensure_future(work)
    watched: set[asyncio.Future[Any]] = {task, gone}
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        if not task.done():
            task.cancel()  # (``Admission.acquire`` leaves the queue, or gives back what it got)
        elif lost is not None and not task.cancelled() and task.exception() is None:
            lost(task.result())
        raise
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        return task.result()
    raise ClientGone


async def unless_gone(request: Request, work: Awaitable[T], lost: Callable[[T], object] | None = None) -> T:
    """``work``'s result, unless the client goes away first (``race``, ``lost`` as there): a
    request that waits for its model to load waits no longer for nobody."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        return await race(gone, work, lost)
    finally:
        gone.cancel()


def dropped(got: tuple[Any, Held]) -> None:
    """A ``Hosts.held`` result's hold given back (``race``'s ``lost``)."""
    got[1].drop()


async def disconnected(request: Request) -> None:
    """Returns once the client is gone (the body was read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
