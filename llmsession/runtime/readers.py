"""Who reads a session's stream: the thread that made it or took its latest step, or the asyncio
task whose ``AsyncStream`` does (in its pump's thread: ``aio`` names the task there).

A new exchange (or a fork, a save, a clear) finishes an unfinished stream first when it is its
own reader's (a loop left with ``break``, an iterator set aside), or no one reads it any more (its
thread ended, its task is done, it was cancelled); another live reader's stream is busy
(``SessionBusyError``), as a step in flight is. Finishing it anyway cut that reader's reply short
between two of its steps, with no error on either side.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from typing import Any

from llmsession.errors import SessionBusyError

_TASK: contextvars.ContextVar[weakref.ref[asyncio.Task[Any]] | None] = contextvars.ContextVar(
    "llmsession_reading_task", default=None
)


def reading_task(task: asyncio.Task[Any]) -> None:
    """The streams made in this context are ``task``'s (run in the context a pump's thread runs)."""
    _TASK.set(weakref.ref(task))


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
        self._task = _TASK.get() or _running_task()  # (a plain call from a task is the task's)
        self._thread = None if self._task is not None else weakref.ref(threading.current_thread())

    def _who(self) -> object | None:
        return (
            self._task() if self._task is not None else self._thread() if self._thread is not None else None
        )

    def gone(self) -> bool:
        who = self._who()
        if isinstance(who, asyncio.Task):
            return who.done()
        return not (isinstance(who, threading.Thread) and who.is_alive())

    def check(self, latest: Reader) -> None:
        """Refuse to finish ``latest``'s unfinished stream for this caller unless it is this
        caller's, or its reader is gone."""
        if latest._who() is not self._who() and not latest.gone():
            raise SessionBusyError(
                "this session's last stream is still being read by another thread or task: "
                "read it to its end, or cancel or close it, first"
            )
