"""asyncio: ``Session.astream`` and ``Session.arespond`` never block the event loop.

Each step of the exchange (making the prompt, then each token) runs in a worker thread through
``asyncio.to_thread``; the loop only awaits it. Cancelling the awaiting task cancels the exchange
as ``Stream.cancel()`` does: the step in flight stops before its next token (or mid-prefill, between
graph nodes) and the reply is kept as far as it got, marked ``"cancelled"``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Protocol

from llmsession.replies import Reply, Snapshot


class Steps(Protocol):
    """A stream of either kind, as the bridge drives it (``face.Stream``)."""

    @property
    def reply(self) -> Reply | None: ...
    def __next__(self) -> Snapshot: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...


_END = object()


class AsyncStream:
    """``async for snapshot in session.astream(...)``; ``reply`` once it ends."""

    def __init__(self, start: Callable[[], Steps]) -> None:
        self._start = start
        self._stream: Steps | None = None
        self._step = threading.Lock()  # one step at a time: a close waits for the step in flight
        self._cancelled = False

    @property
    def reply(self) -> Reply | None:
        return self._stream.reply if self._stream is not None else None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Snapshot:
        try:
            item = await asyncio.to_thread(self._next)
        except asyncio.CancelledError:
            self.cancel()
            await asyncio.shield(asyncio.to_thread(self._close))  # the step in flight ends first
            raise
        if item is _END:
            raise StopAsyncIteration
        assert isinstance(item, Snapshot)
        return item

    def cancel(self) -> None:
        """Stop before the next token (or mid-prefill); thread-safe, and safe from the loop."""
        self._cancelled = True
        if self._stream is not None:
            self._stream.cancel()

    async def aclose(self) -> None:
        """Cancel and finish the reply (what was generated is kept)."""
        self.cancel()
        await asyncio.to_thread(self._close)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _next(self) -> object:
        with self._step:
            if self._stream is None:
                self._stream = self._start()
                if self._cancelled:
                    self._stream.cancel()
            return next(self._stream, _END)

    def _close(self) -> None:
        with self._step:
            if self._stream is not None:
                self._stream.close()


async def adrain(stream: AsyncStream) -> Reply:
    """Run an async stream to its end and return its reply (``arespond``, ``Model.achat``)."""
    async for _ in stream:
        pass
    assert stream.reply is not None
    return stream.reply
