"""What a user holds of a conversation: ``Session`` and ``Stream``, one face each, with two
implementations side by side: in this process (``runtime.session.LocalSession``,
``runtime.stream.LocalStream``) and in a worker process (``remote.proxies.WorkerSession``,
``WorkerStream``). Neither inherits the other; what the face builds on its abstract methods
(``respond``, the async twins, ``with``) is written once, here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from llmsession.options import GenerationOptions, checked_options
from llmsession.replies import Message, Reply, Snapshot
from llmsession.runtime.aio import AsyncStream, adrain

if TYPE_CHECKING:
    from llmsession.config import SessionConfig


class Stream(ABC):
    """One reply as it decodes: iterate it for ``Snapshot``s; ``reply`` holds the final
    ``Reply`` once it ends. ``session`` is the conversation it belongs to (a stateless call's
    kept session; None for a worker model's stateless call). ``with`` closes it."""

    session: Session | None

    @property
    @abstractmethod
    def reply(self) -> Reply | None:
        """The whole reply once the stream has ended, else None."""

    def __iter__(self) -> Iterator[Snapshot]:
        return self

    @abstractmethod
    def __next__(self) -> Snapshot: ...

    @abstractmethod
    def cancel(self) -> None:
        """Stop decoding before the next token (or mid-prefill); thread-safe and idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Cancel and finish the reply now (what was generated is kept)."""

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drain(stream: Stream) -> Reply:
    """Run a stream of either kind to its end and return its reply (``respond``, ``chat``)."""
    for _ in stream:
        pass
    assert stream.reply is not None
    return stream.reply


class Session(ABC):
    """A conversation with a model, made by ``model.session(...)``: its transcript
    (``messages``, which a caller may edit between exchanges), its settings (``config``, and
    each as an attribute), and its KV state in the model's shared memory.

    ``respond`` / ``stream`` send a user message (or a message, or messages: tool results);
    ``arespond`` / ``astream`` are their asyncio twins. ``fork`` copies the conversation and its
    state; ``save`` writes both to a file ``Model.load_session`` reads; ``close`` (or ``with``)
    ends it and frees its state."""

    messages: list[Message]

    def __new__(cls, *args: Any, **kwargs: Any) -> Session:
        if cls is Session:
            raise TypeError("a Session is made by model.session(...) (or Model.load_session)")
        return super().__new__(cls)

    @property
    @abstractmethod
    def config(self) -> SessionConfig:
        """The settings this session runs with: as asked, its context and batch resolved."""

    # Each setting, read from ``config`` (read-only: a session's memory was laid out for them;
    # assigned, one was skipped by the checks, half taken or, in a worker, silently ignored).
    @property
    def context_size(self) -> int:
        """The most positions the session's KV state holds (``config.context_size``)."""
        return cast(int, self.config.context_size)

    @property
    def batch_size(self) -> int:
        """The most tokens one decode of a prompt takes (``config.batch_size``)."""
        return self.config.batch_size

    @property
    def thinking(self) -> bool | str:
        """Whether (or how hard) its template thinks (``config.thinking``)."""
        return self.config.thinking

    @property
    def swa_full(self) -> bool:
        """Whether a sliding-window model keeps every position (``config.swa_full``)."""
        return self.config.swa_full

    @property
    def share_prefix(self) -> bool:
        """Whether it shares its cells with other sessions (``config.share_prefix``)."""
        return self.config.share_prefix

    @property
    @abstractmethod
    def cached_tokens(self) -> int:
        """How many positions the session's KV state holds (live or parked); 0 once it is
        ``closed`` (by ``close``, its model's, or ``keep_conversation``: it holds none then).
        Readable after close, as ``messages``, ``config`` and ``closed`` are."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether the session (or its model) was closed."""

    @abstractmethod
    def stream(self, content: Any, options: GenerationOptions | None = None) -> Stream:
        """Send a user message (or a message, or messages: tool results); iterate the result
        for snapshots as tokens decode."""

    @abstractmethod
    def fork(self) -> Session:
        """A new session with a copy of this transcript and of its KV cache (a copy of the
        state, not a re-decode): for alternatives and regenerations."""

    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Write the transcript and the KV cache to one file (atomically); ``Model.load_session``
        reads it back, here or in another process. An unfinished stream is finished first."""

    @abstractmethod
    def clear_cached_context(self) -> None:
        """Forget the session's KV state (the next exchange decodes from scratch, but for what
        it may start from of another session's: ``share_prefix``)."""

    @abstractmethod
    def close(self) -> None:
        """End the session: finish its stream, free its KV state; later calls raise
        ``ModelClosedError`` (the transcript stays readable). Idempotent."""

    def respond(self, content: Any, options: GenerationOptions | None = None) -> Reply:
        """Send a user message and return the whole reply."""
        return drain(self.stream(content, options))

    def astream(self, content: Any, options: GenerationOptions | None = None) -> AsyncStream:
        """``stream`` for asyncio: ``async for snapshot in session.astream(...)``. The stream runs
        in a thread of its own, a step each time the loop asks; cancelling the task cancels the
        exchange within one token."""
        checked = checked_options(options)  # (a bad option is refused here, not in the loop)
        return AsyncStream(lambda: self.stream(content, checked))

    async def arespond(self, content: Any, options: GenerationOptions | None = None) -> Reply:
        """``respond`` for asyncio; the event loop runs on while the reply decodes."""
        return await adrain(self.astream(content, options))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
