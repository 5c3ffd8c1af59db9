"""asyncio: ``Session.astream``, ``Model.achat_stream`` (and the server's choices) never block
the event loop. This is the package's one bridge between its threads and a loop.

A stream is made and iterated in a thread of its own (its ``Pump``), started by the first
``__anext__``; each snapshot is handed to the loop as it comes. By default the thread takes a
step only when the loop asks for the next snapshot (``ahead=0``), so cancelling the awaiting
task cancels the exchange within one token: the step in flight stops before its next token (or
mid-prefill, between graph nodes) and the reply is kept as far as it got, marked
``"cancelled"``. ``ahead=None`` lets the thread decode on without waiting for the loop (the
server's choices, whose snapshots are forwarded as they come). A stream dropped unfinished is
cancelled, and its thread ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from llmsession.replies import Reply, Snapshot
from llmsession.runtime.readers import Asking, reading_for


class Steps(Protocol):
    """A stream of either kind, as the bridge drives it (``face.Stream``)."""

    @property
    def reply(self) -> Reply | None: ...
    def __next__(self) -> Snapshot: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...


_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Pump:
    """The thread that makes and iterates one stream, and what it shares with the loop."""

    def __init__(self, start: Callable[[], Steps], ahead: int | None) -> None:
        self.start, self.ahead = start, ahead
        self.stream: Steps | None = None
        self.cancelled = self.done = False
        self.asked = 0  # snapshots the loop asked for (``ahead`` bounds the steps past them)
        self.taken = 0
        self.turn = threading.Condition()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.asking = Asking()  # the task that asked for the latest step
        self.queue: asyncio.Queue[object] | None = None
        self.ended: asyncio.Event | None = None

    def begin(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue, self.ended = asyncio.Queue(), asyncio.Event()
        context = contextvars.copy_context()  # (as asyncio.to_thread: the caller's context)
        context.run(reading_for, self.asking)  # (its steps are the asking task's: ``readers``)
        self.asking.now()  # (the stream is made before the first ask: this task's)
        pump = threading.Thread(target=context.run, args=(self.run,), name="llmsession-astream", daemon=True)
        try:
            pump.start()
        except BaseException:  # (no thread: nothing would end it, so nothing may wait for it)
            self.done = True
            self.queue.put_nowait(_END)
            self.ended.set()
            raise

    def ask(self) -> None:
        self.asking.now()  # (on the loop, in the task that asks)
        with self.turn:
            self.asked += 1
            self.turn.notify()

    def cancel(self) -> None:
        """Thread-safe and idempotent: the step in flight stops, a waiting thread goes on."""
        with self.turn:
            if self.done:
                return
            self.cancelled = True
            stream = self.stream
            self.turn.notify()
        if stream is not None:
            stream.cancel()

    def run(self) -> None:
        try:
            stream = self.start()
            with self.turn:
                self.stream = stream
                cancelled = self.cancelled
            if cancelled:
                stream.cancel()
            try:
                while True:
                    self.wait_for_demand()
                    try:
                        snapshot = next(stream)
                    except StopIteration:
                        break
                    self.send(snapshot)
            finally:
                stream.close()  # (in this thread: a stream's guard is one thread's at a time)
            self.send(_END)
        except BaseException as error:  # the loop raises it
            self.send(_Failed(error))
        finally:
            with self.turn:
                self.done = True  # (a cancel then has nothing to stop)
            self.call(self.ended.set if self.ended is not None else None)

    def wait_for_demand(self) -> None:
        """Until the next step may be taken: at once past a cancel (which ends the stream),
        else once the loop asked for it (``ahead`` steps early at most; None: no bound)."""
        with self.turn:
            while self.ahead is not None and not self.cancelled and self.taken >= self.asked + self.ahead:
                self.turn.wait()
            self.taken += 1

    def send(self, item: object) -> None:
        assert self.queue is not None
        if not self.call(self.queue.put_nowait, item):
            self.cancel()  # the loop is closed: nobody will read the rest

    def call(self, function: Callable[..., object] | None, *args: object) -> bool:
        if function is None or self.loop is None:
            return False
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:
            return False
        return True


class AsyncStream:
    """``async for snapshot in session.astream(...)``; ``reply`` once it ends."""

    def __init__(self, start: Callable[[], Steps], *, ahead: int | None = 0) -> None:
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise ValueError(f"ahead must be None or an int >= 0, got {ahead!r}")
        self._pump = Pump(start, ahead)
        self._started = False
        weakref.finalize(self, self._pump.cancel)  # dropped unfinished: its thread ends

    @property
    def reply(self) -> Reply | None:
        stream = self._pump.stream
        return stream.reply if stream is not None else None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Snapshot:
        pump = self._pump
        if not self._started:
            self._started = True
            if not pump.cancelled:  # (cancelled or closed before its first step: it never starts)
                pump.begin()
        if pump.queue is None:
            raise StopAsyncIteration
        pump.ask()
        try:
            item = await pump.queue.get()
        except asyncio.CancelledError:
            pump.cancel()
            await _through_cancels(self._finished())  # the step in flight ends first
            raise
        if item is _END or isinstance(item, _Failed):
            pump.queue.put_nowait(_END)  # (a later call ends too)
            if isinstance(item, _Failed):
                raise item.error
            raise StopAsyncIteration
        assert isinstance(item, Snapshot)
        return item

    def cancel(self) -> None:
        """Stop before the next token (or mid-prefill); thread-safe, and safe from the loop."""
        self._pump.cancel()

    async def aclose(self) -> None:
        """Cancel and finish the reply (what was generated is kept)."""
        self._pump.cancel()
        await _through_cancels(self._finished())

    async def _finished(self) -> None:
        if self._started and self._pump.ended is not None:
            await self._pump.ended.wait()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _through_cancels(finishing: Coroutine[Any, Any, None]) -> None:
    """Await ``finishing`` to its end however often the awaiting task is cancelled meanwhile
    (``asyncio.timeout`` inside a cancelled ``TaskGroup`` cancels twice): the session is free
    once this returns; the first cancel is raised again by the caller, a later one here."""
    task = asyncio.ensure_future(finishing)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def adrain(stream: AsyncStream) -> Reply:
    """Run an async stream to its end and return its reply (``arespond``, ``Model.achat``)."""
    async for _ in stream:
        pass
    assert stream.reply is not None
    return stream.reply
