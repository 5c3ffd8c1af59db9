"""A request's body as the server reads it: bounded in size, time and number, a few parsed at
once. Bodies are read before a parser's slot is taken (four clients sending a byte now and then
held all four, and every other request waited), ``READERS`` at once, ``READERS_PER_KEY`` of them
one key's, each counted until a parser takes it: what bodies hold in memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect, Request

from llmsession.serve.errors import ApiError, too_large
from llmsession.serve.http import declared
from llmsession.serve.tally import Tally, keys_share

PARSERS = 4  # requests checking their body at once (read before: a slow sender holds no slot)
BODY_SECONDS = 60  # the most a request's body may take to arrive (then a 408)
READERS = 64  # bodies being read at once (each up to --max-body-bytes in memory)
READERS_PER_KEY = READERS // 4  # of them one key's (its 64 slow senders held every place for all)


class Bodies:
    """The server's bodies being read and parsed. Used on the event loop's thread only."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.parsing = asyncio.Semaphore(PARSERS)
        self.reading = asyncio.Semaphore(READERS)
        self.reading_of = Tally()  # by key

    @contextlib.asynccontextmanager
    async def parsed(self, request: Request, limit: int | None = None) -> AsyncIterator[bytes]:
        """The request body (``_read``), in the block with one of the ``PARSERS`` slots held
        (a few parsed at once, off the event loop); until the slot is taken it counts as read
        still (``READERS``, its key's share): bodies waiting for a parser were held without
        bound, 8 MiB each, however many one key sent one after another."""
        async with self._reading(request):
            body = await self._read(request, limit)
            request.state.body_bytes = len(body)  # (what a request waiting for room holds: ``Admission``)
            await self.parsing.acquire()
        try:
            yield body
        finally:
            self.parsing.release()

    @contextlib.asynccontextmanager
    async def _reading(self, request: Request) -> AsyncIterator[None]:
        """A place among the bodies read at once, and in its key's share (``_read``)."""
        key: str | None = getattr(request.state, "key", None)  # (None: a server of no keys)
        why = f"this key is sending {READERS_PER_KEY} request bodies already"
        with self.reading_of.counting((key, keys_share(key, READERS_PER_KEY), why)):
            async with self.reading:
                yield

    async def _read(self, request: Request, limit: int | None) -> bytes:
        """The request body, refused (413) past the size limit (or ``limit``, if tighter) before
        it is all read: by its ``Content-Length`` first; and (408) if it has not all come within
        ``BODY_SECONDS``. Read before a parser's slot is taken (four clients sending a byte now
        and then held all four, and every other request waited), ``READERS`` at once: what
        bodies hold in memory stays bounded, and a slow sender is gone at its deadline. One key
        sends at most ``READERS_PER_KEY`` at once (a 503 past that; a server without keys has one
        tenant, who may use them all): its slow senders held every place, and every other key's
        bodies waited behind them (``_reading``)."""
        limit = self.max_body_bytes if limit is None else min(limit, self.max_body_bytes)
        too_big = too_large(limit)
        if declared(request) > limit:
            raise too_big
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        request.state.body_asked = True  # (a client waiting for 100 Continue is now sending)
        try:
            await asyncio.wait_for(read(), BODY_SECONDS)
        except ClientDisconnect:
            raise ApiError("the client went away", None, None, 499) from None
        except asyncio.TimeoutError:  # (not yet the builtin one on Python 3.10)
            request.state.body_late = True  # (``drain`` waits no longer for it: the 408 closes)
            late = f"the request body did not arrive within {BODY_SECONDS} s"
            raise ApiError(late, None, None, 408) from None
        request.state.body_read = True  # (``drain`` reads no further)
        return b"".join(chunks)
