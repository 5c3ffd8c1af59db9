"""At the interpreter's exit, every model still open is closed before ``weakref.finalize``'s exit
hook frees the native objects: a stream decoding in a daemon thread (``astream``'s pump, or a
thread of the caller's) is cancelled and ends its step first (``ModelCore.close``), instead of
decoding into a context freed under it (a segfault), and no finalizer abandons a generator that
thread is running. atexit runs the newest hook first; this one is registered when the first
model has loaded, after the native finalizers registered theirs."""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Protocol, TypeVar

from llmsession.errors import SessionBusyError

T = TypeVar("T")


class Closable(Protocol):
    def close(self) -> None: ...


class Shuttable(Protocol):
    @property
    def stepping_here(self) -> bool: ...
    def shut(self) -> None: ...


STEPPING_HERE = (
    "this session is generating in this thread: it cannot be closed, nor its model, from inside "
    "its own step (a signal handler, a validator or a finalizer run there); cancel its stream "
    "there, and close once the step has returned"
)


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_hook: list[object] = []


def track(model: Closable) -> None:
    """Close ``model`` at exit if it is still open then (once loaded: its finalizers exist)."""
    _open.add(model)
    if not _hook:
        _hook.append(atexit.register(close_all))


def members(items: weakref.WeakSet[T]) -> list[T]:
    """What a weak set holds now: read again where another thread added to it meanwhile (its
    iteration raised RuntimeError: a model's ``close`` stopped halfway, its memory never freed)."""
    while True:
        with contextlib.suppress(RuntimeError):
            return list(items)


def not_stepping(sessions: weakref.WeakSet[Shuttable]) -> list[Shuttable]:
    """The sessions now, none of whose steps this thread is inside: else a SessionBusyError
    (a close from there would wait for ever), before anything is shut or cleared."""
    now = members(sessions)
    if any(session.stepping_here for session in now):
        raise SessionBusyError(STEPPING_HERE)
    return now


def shut_all(sessions: weakref.WeakSet[Shuttable]) -> None:
    """Every session in ``sessions`` shut (its stream stopped after its step in flight); none
    where this thread is inside one's step (``not_stepping``)."""
    for session in not_stepping(sessions):
        session.shut()


def close_all() -> None:
    """Close every tracked model (the exit hook): each waits for its streams' steps in flight."""
    for model in members(_open):
        with contextlib.suppress(Exception):
            model.close()
