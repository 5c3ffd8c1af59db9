"""Exchanges run off the event loop: each choice of a request iterates its stream in a thread of
its own, so streams of concurrent requests step at once and the engine decodes them in one batch
(``engine.batching`` batches the steps of streams iterated from several threads), and the loop
only forwards their snapshots (``n`` choices that share a prefill are the library's:
``Model.chat_choices``).
``Admission`` bounds how many run at once (the model's live sessions) and how many wait; past that
a request is a 503 the client may retry."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

from llmsession import AsyncStream, MemoryBudgetError
from llmsession.replies import Reply, Snapshot, Usage
from llmsession.serve.errors import ApiError, busy

if TYPE_CHECKING:
    from llmsession import Stream


@dataclass(frozen=True)
class Event:
    """What a choice's thread reports: a snapshot, then its reply or the error that ended it."""

    index: int
    snapshot: Snapshot | None = None
    reply: Reply | None = None
    error: BaseException | None = None

    @property
    def last(self) -> bool:
        return self.snapshot is None


class Forked(Protocol):
    """The library's ``Choices``, as the server reads them: the prompt's usage, counted once."""

    @property
    def prompt(self) -> Usage | None: ...


RUNNING: set[asyncio.Future[None]] = set()  # every run's task, until it ends
# Events a choice's client may leave unread (past what the sockets hold) before the request's
# choices are cut, ending in an error: a stream whose client stops reading (its connection open;
# uvicorn's send has no deadline) queued every token's event while the decode ran on, ~5 KB a
# token with 20 top logprobs, held for as long as the client stayed.
MAX_BACKLOG = 4096
MAX_WAITING_BYTES = 96 << 20  # bodies of the requests waiting for room, in all (``Admission``)


def cut(reply: Reply | None) -> bool:
    """Whether a reply ended by the cut (one that ended first, or an error, is what it is)."""
    return reply is None or reply.finish_reason == "cancelled"


def dropped_unread(queue: asyncio.Queue[Event]) -> set[int]:
    """A cut for an unread backlog: the events its client left unread go (they held the memory
    for as long as the client kept its connection open), but every choice's last, and every
    event of a choice that had ended (its reply whole, not cut short before a natural end).
    The choices whose events went."""
    events = [queue.get_nowait() for _ in range(queue.qsize())]
    ended = {event.index for event in events if event.last}
    dropped = set()
    for event in events:
        if event.last or event.index in ended:
            queue.put_nowait(event)
        else:
            dropped.add(event.index)
    return dropped


class Backlog:
    """The queue a request's choices share, and whether they were cut for an unread backlog:
    past ``MAX_BACKLOG`` events a choice, every choice is cancelled (``cut``) and the unread
    events go."""

    def __init__(self, n: int) -> None:
        self.n, self.queue, self.cut = n, asyncio.Queue[Event](), False
        self.cancels: list[Callable[[], None]] = []  # each choice's
        self._dropped: set[int] = set()  # the choices whose unread events the cut dropped

    def put(self, event: Event) -> None:
        self.queue.put_nowait(event)
        if self.queue.qsize() >= MAX_BACKLOG * self.n and not self.cut:
            self.cut = True  # (its client reads nothing: every choice ends here)
            for cancel in self.cancels:
                cancel()
            self._dropped = dropped_unread(self.queue)

    def lost(self, index: int, reply: Reply | None) -> bool:
        """Whether choice ``index``, ending with ``reply``, reaches its client cut: ended by the
        cut, or with events of it dropped (a decode that had ended on its own as the cut came:
        its reply said whole, text missing from the stream)."""
        return self.cut and (cut(reply) or index in self._dropped)


def overrun(index: int, n: int) -> Event:
    """The last event of a choice cut because its client read nothing (a 4xx: a client's fault)."""
    said = f"the client left over {MAX_BACKLOG * n} events unread: the reply was cut"
    return Event(index, error=ApiError(said, None, "client_too_slow", 408))


class Run:
    """One choice: its stream, made by ``start()`` (rendering, tokenizing) and iterated off the
    loop by the library's one bridge (``AsyncStream``, decoding on without waiting for the
    loop); its events go to ``queue``. ``cancel`` stops the exchange within a token (a prefill
    within a batch)."""

    def __init__(
        self,
        index: int,
        start: Callable[[], Stream],
        backlog: Backlog,
        ended: Callable[[Reply], None],
        released: Callable[[], None],
    ) -> None:
        """``ended`` is called with the reply, and ``released`` once the stream's thread is
        done with the model (its stream closed: what it frees is free), both on the loop;
        ``backlog``, the queue the request's choices share."""
        self.index, self._backlog, self._ended, self._released = index, backlog, ended, released
        self._stream = AsyncStream(start, ahead=None)
        backlog.cancels.append(self._stream.cancel)
        task = asyncio.ensure_future(self._run())
        RUNNING.add(task)  # (the loop holds tasks weakly: a request that went away drops its runs)
        task.add_done_callback(RUNNING.discard)

    def cancel(self) -> None:
        """Thread-safe and idempotent; a run not started yet stops before it decodes."""
        self._stream.cancel()

    async def _run(self) -> None:
        """Every snapshot, then the last event and ``released()``, on every path."""
        last = Event(self.index, error=RuntimeError("a stream ended without a reply"))
        try:
            async for snapshot in self._stream:
                if snapshot.delta or snapshot.tool_calls or snapshot.reasoning_delta or snapshot.usage:
                    # Queued without the text so far (no door reads it): a client that reads
                    # nothing left a copy of the whole reply per token queued, T**2 bytes.
                    self._backlog.put(Event(self.index, snapshot=dataclasses.replace(snapshot, text="")))
            if self._backlog.lost(self.index, self._stream.reply):
                last = overrun(self.index, self._backlog.n)
            elif self._stream.reply is not None:  # (a stream ends with its reply, or raises)
                last = Event(self.index, reply=self._stream.reply)
        except BaseException as error:  # reported to the request (a 4xx, or a logged 500)
            last = Event(self.index, error=error)
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            try:
                if self._stream.reply is not None:
                    self._ended(self._stream.reply)  # (counted, as far as it got)
            finally:
                self._backlog.queue.put_nowait(last)  # (never cut: every choice's last is read)
                self._released()


class Choices:
    """A request's choices, each a ``Run`` of ``start(index)`` (the library's ``forks`` if
    ``n`` share a prefill: their ``prompt`` usage is the request's); their events in one queue.
    ``released`` is called on the loop once every run's thread is done with the model, and
    ``finished`` is set then."""

    def __init__(
        self,
        n: int,
        start: Callable[[int], Stream],
        ended: Callable[[Reply], None],
        released: Callable[[], None],
        forks: Forked | None = None,
    ) -> None:
        backlog = Backlog(n)
        self.n, self.queue, self.forks = n, backlog.queue, forks
        self.finished = asyncio.Event()
        self._left, self._released = n, released
        self.runs = [Run(i, partial(start, i), backlog, ended, self._one_done) for i in range(n)]

    def _one_done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._released()
            self.finished.set()

    def cancel(self) -> None:
        for run in self.runs:  # (the forks' prefill stops once every choice is cancelled)
            run.cancel()


class Relay:
    """A stream's choices that found the memory budget full after the stream began (a slow
    prompt's stream opens before its first token) and before anything reached its client: run
    once more, within the same stream, on ``again()``'s choices (which wait behind the requests
    running then); an error ``again()`` raises ends the stream as the failure would have. The
    request's model is held (``hold``, ``drop``) while it may still run again. The doors read it
    as they read ``Choices``: ``queue``, ``cancel()``."""

    def __init__(
        self,
        choices: Choices,
        again: Callable[[], Awaitable[Choices]],
        hold: Callable[[], None],
        drop: Callable[[], None],
    ) -> None:
        self.n, self.forks = choices.n, choices.forks
        self._backlog = Backlog(self.n)  # (its client may read nothing: as ``Run``'s)
        self._backlog.cancels.append(lambda: self._choices.cancel())
        self.queue = self._backlog.queue
        self._choices, self._again, self._drop = choices, again, drop
        hold()
        self._holding = True
        self._pump = asyncio.ensure_future(self._forward())

    def cancel(self) -> None:
        """Idempotent: the choices running now stop, and no others start."""
        self._pump.cancel()
        self._choices.cancel()
        self._let_go()

    def _let_go(self) -> None:
        if self._holding:
            self._holding = False
            self._drop()

    async def _forward(self) -> None:
        choices = self._choices
        while True:
            event = await choices.queue.get()
            if self._holding and isinstance(event.error, MemoryBudgetError):
                choices.cancel()
                await choices.finished.wait()  # (its own runs give their room back first)
                try:
                    choices = self._choices = await self._again()
                except Exception as error:  # (a 503: nobody runs to wait behind)
                    self.queue.put_nowait(Event(event.index, error=error))
                    return
                finally:
                    self._let_go()  # (the new choices hold the model themselves)
                continue
            self._let_go()  # (something reached the stream: no running again)
            if event.error is None and event.last and self._backlog.lost(event.index, event.reply):
                event = overrun(event.index, self.n)  # (cut, as ``Run`` ends one)
            self._backlog.put(event)


class Admission:
    """At most ``limit`` choices decode at once, at most ``queue`` requests wait for room; a
    request past that is refused with a 503 and ``Retry-After``. Shared fairly between callers
    (their keys): room goes to the waiting request whose caller runs the least now, then was
    served longest ago (the earliest among equals: turn by turn), and a full queue takes a
    caller's request by refusing the newest of the caller with the most waiting, if that is
    another with more (one key's flood held every place in the queue, and every other key
    waited behind it all or was refused). The bodies of the requests waiting are at most
    ``max_bytes`` in all, as if the queue were full past them (each is held parsed, up to nine
    times its size: 64 bodies of 8 MiB held 4.5 GB). Used on the event loop's thread only."""

    def __init__(self, limit: int, queue: int, max_bytes: int = MAX_WAITING_BYTES) -> None:
        self.limit, self.queue, self.max_bytes = limit, queue, max_bytes
        self.used = 0
        self._waiting: list[_Waiting] = []  # oldest first
        self._running: collections.Counter[str | None] = collections.Counter()  # weight per caller
        self._served: dict[str | None, int] = {}  # each caller's latest grant (of those present)
        self._grants = self._releases = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(
        self, count: int, *, behind: bool = False, caller: str | None = None, size: int = 0
    ) -> int:
        """Wait for room for ``count`` choices (at most ``limit``); the weight to ``release``.
        ``behind``: wait for a release by a request running now (a retry after the memory
        budget was full: room in sequences is not room in KV cells), 503 if none runs.
        ``size``: its body's bytes (``max_bytes``)."""
        count = min(count, self.limit)
        if behind and self.used == 0:
            raise busy("its memory is in use")
        ready = any(w.behind is None or w.behind < self._releases for w in self._waiting)
        if not behind and not ready and self.used + count <= self.limit:  # (behind retries' waits
            self._grant(count, caller)  # for memory only: places free are taken at once)
            return count
        self._make_room(caller, size)
        future = asyncio.get_running_loop().create_future()
        entry = _Waiting(count, caller, future, self._grants, self._releases if behind else None, size)
        self._waiting.append(entry)
        try:
            await entry.future
        except asyncio.CancelledError:
            if entry.granted:
                self.release(count, caller)  # granted just as the request went away
            else:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                self._dispatch()  # (it may have been the one whose turn it was)
            raise
        return count

    def release(self, count: int, caller: str | None = None) -> None:
        self._releases += 1
        self.used -= count
        self._running[caller] -= count
        if self._running[caller] <= 0:
            del self._running[caller]
        self._dispatch()

    def _dispatch(self) -> None:
        """Room to the waiting requests, turn by turn, while the one whose turn it is fits."""
        self._waiting = [w for w in self._waiting if not w.future.done()]  # (cancelled: gone)
        while True:
            ready = [w for w in self._waiting if w.behind is None or w.behind < self._releases]
            if not ready:  # (a retry waits for a release by a request running when it came)
                break
            entry = min(ready, key=self._turn)  # (the earliest of its turn)
            if self.used + entry.count > self.limit:
                break
            self._waiting.remove(entry)
            self._grant(entry.count, entry.caller)
            entry.granted = True
            entry.future.set_result(None)
        present = {w.caller for w in self._waiting} | set(self._running)
        self._served = {c: n for c, n in self._served.items() if c in present}  # (callers come and go)

    def _turn(self, entry: _Waiting) -> tuple[int, float]:
        """Whose turn it is: the caller running the least now, then the one served longest ago."""
        return self._running[entry.caller], self._served.get(entry.caller, entry.since - 0.5)

    def _grant(self, count: int, caller: str | None) -> None:
        self.used += count
        self._running[caller] += count
        self._grants += 1
        self._served[caller] = self._grants

    def _make_room(self, caller: str | None, size: int) -> None:
        """A place in the queue for a request of ``caller`` with a body of ``size`` bytes, where
        it is full (or its bodies would pass ``max_bytes``): the newest request of the caller
        with the most waiting is refused, while that caller has more waiting than ``caller``;
        else 503."""
        self._waiting = [w for w in self._waiting if not w.future.done()]  # (cancelled: gone)
        held = sum(w.size for w in self._waiting)
        while len(self._waiting) >= self.queue or (self._waiting and held + size > self.max_bytes):
            waiting = collections.Counter(w.caller for w in self._waiting)
            most = max(waiting, key=lambda c: (waiting[c], self._running[c]), default=None)
            if not waiting or waiting[most] <= waiting[caller] + 1:
                raise busy("too many requests are waiting")
            newest = next(w for w in reversed(self._waiting) if w.caller == most)
            self._waiting.remove(newest)
            held -= newest.size
            newest.future.set_exception(busy("too many requests of one caller are waiting"))


@dataclass(eq=False)
class _Waiting:
    count: int
    caller: str | None
    future: asyncio.Future[None]
    since: int  # grants made when it came (a caller not served lately: as if served just before)
    behind: int | None  # a retry's: the releases made when it came (it waits for one more)
    size: int = 0  # its body's bytes
    granted: bool = False  # (its room is counted: released by whoever holds it)
