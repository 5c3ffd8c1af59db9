"""One exchange as its caller sees it: ``Stream`` iterates the reply's snapshots, one
``exchange.Exchange`` step at a time, under its session's busy guard."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from llmsession.errors import ModelClosedError
from llmsession.replies import Message, Reply, Snapshot
from llmsession.runtime.exchange import Exchange


class Transcript(Protocol):
    """What a stream tells of its session: the transcript, with the exchange once it ends."""

    messages: list[Message]


class Replying(Protocol):
    """A stream of either kind (in this process or a worker's, sync or async): ``drain``."""

    @property
    def reply(self) -> Reply | None: ...

    def __iter__(self) -> Iterator[Snapshot]: ...


def drain(stream: Replying) -> Reply:
    """Run a stream to its end and return its reply (``respond`` and ``chat`` are this)."""
    for _ in stream:
        pass
    assert stream.reply is not None
    return stream.reply


class Stream:
    """An iterator of ``Snapshot``s; ``reply`` holds the final ``Reply`` once it ends."""

    def __init__(
        self, session: Transcript, exchange: Exchange, busy: Callable[[], AbstractContextManager[None]]
    ) -> None:
        """``busy``: the session's guard, held for each step (one thread at a time)."""
        self.session = session
        self.exchange = exchange
        self._busy = busy
        self._steps = exchange.run()
        # Runs once: on close(), when the session moves on, or when the stream is dropped.
        self.abandon = weakref.finalize(self, exchange.abandon, self._steps)

    @property
    def reply(self) -> Reply | None:
        return self.exchange.reply

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Snapshot:
        if self.exchange.model_closed:
            raise ModelClosedError("the model was closed while this stream was open")
        if self.exchange.done:
            raise StopIteration
        with self._busy():
            try:
                return next(self._steps)
            except StopIteration:
                if self.exchange.model_closed:  # cancelled by the model's close()
                    raise ModelClosedError("the model was closed while this stream was open") from None
                raise

    def cancel(self) -> None:
        """Stop decoding before the next token (or mid-prefill); thread-safe and idempotent."""
        self.exchange.cancelled.set()

    def close(self) -> None:
        """Cancel and finish the reply now (what was generated is kept)."""
        self.cancel()
        if self.exchange.done:
            return  # finished, or ended by its model's close()
        with self._busy():
            self.abandon()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
