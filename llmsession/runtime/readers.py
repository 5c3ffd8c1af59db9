"""Who reads a session's stream: the thread that made it or took its latest step, or the asyncio
task whose ``AsyncStream`` does (in its pump's thread: ``aio`` names the task there).

A new exchange (or a fork, a save, a clear) finishes an unfinished stream first, as it always
did. When the stream was another reader's (another thread, another task) that reader is told:
its next step raises ``SessionBusyError`` instead of ending as if the reply were over (its reply
was cut short between two of its steps with no error on either side). A reader's own stream (a
loop left with ``break``, an iterator set aside) ends quietly, as before. Refusing the new call
instead would refuse for good a caller whose steps run on a thread pool's threads (each step on
another, none of them ever gone).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from typing import Any


class Asking:
    """The task that asks an ``AsyncStream`` for its steps, as its last ``__anext__`` found it
    (its pump's thread takes the steps: they are that task's)."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task: weakref.ref[asyncio.Task[Any]] | None = None

    def now(self) -> None:
        """The task running this (on the loop) asks now."""
        self.task = _running_task()


_ASKING: contextvars.ContextVar[Asking | None] = contextvars.ContextVar("llmsession_asking", default=None)


CUT = (
    "this stream was finished by another call on its session (from another thread or task): "
    "its reply ends where it got, as the session's transcript holds it"
)


def reading_for(asking: Asking) -> None:
    """The steps taken in this context are ``asking``'s task's (run in the context a pump's
    thread runs)."""
    _ASKING.set(asking)


def _running_task() -> weakref.ref[asyncio.Task[Any]] | None:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # (no loop runs in this thread)
        return None
    return weakref.ref(task) if task is not None else None


class Reader:
    """The caller that made a stream or took its latest step (held weakly: a reader gone is no
    one)."""

    __slots__ = ("_task", "_thread")

    def __init__(self) -> None:
        self.note()

    def note(self) -> None:
        """The caller is the reader now."""
        asking = _ASKING.get()
        self._task = asking.task if asking is not None else _running_task()  # (a call from a task: its)
        self._thread = None if self._task is not None else weakref.ref(threading.current_thread())

    def _who(self) -> object | None:
        return (
            self._task() if self._task is not None else self._thread() if self._thread is not None else None
        )

    def same(self, other: Reader) -> bool:
        """Whether ``other`` is this caller (a reader gone is no one's)."""
        who = self._who()
        return who is not None and who is other._who()
