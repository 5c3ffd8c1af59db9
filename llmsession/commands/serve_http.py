"""The HTTP connections ``llmsession serve`` takes: uvicorn's, with a bound on a request's head.

uvicorn arms no timer before a connection's first response, and a byte that arrives clears the
one it arms after; it bounds no request head either (with httptools). So a client without a key
could open thousands of connections and send a header byte a minute on each: the server ran out
of file descriptors and stopped taking connections. Here a request's head (its line and headers)
must arrive within ``HEAD_SECONDS`` of the connection's opening or of its last response's end,
and within ``MAX_HEAD_BYTES``; else the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

HEAD_SECONDS = 30.0
MAX_HEAD_BYTES = 1 << 20  # (what arrives before the head is whole: a body's first piece may be in it)


def bounded_protocol(http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``auto``: httptools' where installed, else ``h11``'s), its
    heads bounded."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base: Any = import_from_string(HTTP_PROTOCOLS[http])

    class HeadBounded(base):  # type: ignore[misc]
        """A request whose head is not whole in time, or in size, closes its connection. A head
        is awaited while no request is under way (no cycle yet, or the last one's response
        complete: a pipelined request's cycle is made as the one before it ends, its head whole)."""

        def connection_made(self, transport: Any) -> None:
            self.timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.timer is not None:
                self.timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if self._awaiting():
                self.head_bytes += len(data)
                if self.head_bytes > MAX_HEAD_BYTES:
                    self.transport.close()
                    return
            super().data_received(data)

        def _awaiting(self) -> bool:
            return bool(self.cycle is None or self.cycle.response_complete)

        def _await_head(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
            self.head_bytes, self.timer = 0, None
            if self._awaiting():
                self.timer = self.loop.call_later(HEAD_SECONDS, self._late, self.cycle)

        def _late(self, before: Any) -> None:
            if self.cycle is before and self._awaiting() and not self.transport.is_closing():
                self.transport.close()

    return HeadBounded
