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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

from llmsession.replies import Reply, Snapshot, Usage
from llmsession.serve.errors import busy

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


class Run:
    """One choice: ``start()`` (which makes the stream: rendering, tokenizing) and every step of
    the stream run in a daemon thread; its events go to ``queue`` on ``loop``. ``cancel`` from
    the loop stops the exchange within a token (a prefill within a batch)."""

    def __init__(
        self,
        index: int,
        start: Callable[[], Stream],
        queue: asyncio.Queue[Event],
        ended: Callable[[Reply], None],
        released: Callable[[], None],
    ) -> None:
        """``ended`` is called with the reply in the run's thread, and ``released`` on the loop
        once the thread is done with the model (its stream closed: what it frees is free)."""
        self.index, self._start, self._queue = index, start, queue
        self._ended, self._released = ended, released
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._stream: Stream | None = None
        self._cancelled = False
        self._finished = False  # its stream ended: nothing left to cancel
        threading.Thread(target=self._run, name=f"llmsession-serve-{index}", daemon=True).start()

    def cancel(self) -> None:
        """Thread-safe and idempotent; a run not started yet stops before it decodes."""
        with self._lock:
            self._cancelled = True
            if self._stream is not None and not self._finished:
                self._stream.cancel()

    def _run(self) -> None:
        try:
            last = Event(self.index, reply=self._decode())
        except BaseException as error:  # reported to the request (a 4xx, or a logged 500)
            last = Event(self.index, error=error)
        self._send(last)

    def _decode(self) -> Reply:
        stream = self._start()
        with self._lock:
            self._stream = stream
            if self._cancelled:
                stream.cancel()
        try:
            for snapshot in stream:
                if snapshot.delta or snapshot.tool_calls:
                    self._send(Event(self.index, snapshot=snapshot))
        finally:
            with self._lock:
                self._finished = True
            stream.close()  # (in this thread: the stream's guard is one thread's at a time)
            if stream.reply is not None:
                self._ended(stream.reply)
        if stream.reply is None:  # (a stream ends with its reply, or raises)
            raise RuntimeError("a stream ended without a reply")
        return stream.reply

    def _send(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop is closed: nobody will read the rest
            self.cancel()

    def _deliver(self, event: Event) -> None:
        self._queue.put_nowait(event)
        if event.last:
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
        self.n, self.queue, self.forks = n, asyncio.Queue[Event](), forks
        self.finished = asyncio.Event()
        self._left, self._released = n, released
        self.runs = [Run(i, partial(start, i), self.queue, ended, self._one_done) for i in range(n)]

    def _one_done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._released()
            self.finished.set()

    def cancel(self) -> None:
        for run in self.runs:  # (the forks' prefill stops once every choice is cancelled)
            run.cancel()


class Admission:
    """At most ``limit`` choices decode at once, at most ``queue`` requests wait for room (first
    come, first served); a request past that is refused with a 503 and ``Retry-After``. Used on
    the event loop's thread only."""

    def __init__(self, limit: int, queue: int) -> None:
        self.limit, self.queue = limit, queue
        self.used = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, count: int, *, behind: bool = False) -> int:
        """Wait for room for ``count`` choices (at most ``limit``); the weight to ``release``.
        ``behind``: wait for a release by a request running now (a retry after the memory
        budget was full: room in sequences is not room in KV cells), 503 if none runs."""
        count = min(count, self.limit)
        if behind and self.used == 0:
            raise busy("its memory is in use")
        if not behind and not self._waiting and self.used + count <= self.limit:
            self.used += count
            return count
        if len(self._waiting) >= self.queue:
            raise busy("too many requests are waiting")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (count, future)
        self._waiting.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif future.done() and not future.cancelled():
                self.release(count)  # granted just as the request went away
            raise
        return count

    def release(self, count: int) -> None:
        self.used -= count
        while self._waiting and self.used + self._waiting[0][0] <= self.limit:
            count, future = self._waiting.popleft()
            if not future.done():
                self.used += count
                future.set_result(None)
