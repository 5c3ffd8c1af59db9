"""The calls using a native model outside its contexts (tokenizing, detokenizing, token pieces,
its vocabulary, chat template and metadata), counted so that ``close`` never frees the model
under one: llama.cpp tokenizes without the GIL, and a model freed meanwhile crashed the process.

A reader/writer guard whose one writer frees: each call holds a shared count for its duration
(a counter under a lock, under a microsecond a call: some paths ask per token); ``close`` refuses
new calls with ModelClosedError, then waits for those in flight. A call nested in another is
refused, not waited for, once closing began, so no call waits on the close it holds up.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from llmsession.errors import ModelClosedError

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class InUse:
    """The count of calls under way on one native model, and whether it is closing."""

    __slots__ = ("closing", "count", "idle", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.count = 0
        self.closing = False

    def close(self) -> None:
        """Refuse new calls, and wait for those in flight (each ends with its native call)."""
        with self.lock:
            self.closing = True
            self.idle.wait_for(lambda: not self.count)


class Used(Protocol):
    @property
    def uses(self) -> InUse: ...


U = TypeVar("U", bound=Used)


def in_use(method: Callable[Concatenate[U, P], R]) -> Callable[Concatenate[U, P], R]:
    """A method that uses its object's native model: counted in its ``uses`` while it runs.
    (The count is inline: a ``with`` over an object of this module cost twice as much.)"""

    @functools.wraps(method)
    def held(self: U, /, *args: P.args, **kwargs: P.kwargs) -> R:
        uses = self.uses
        lock = uses.lock
        lock.acquire()
        if uses.closing:
            lock.release()
            raise ModelClosedError("the model is closed")
        uses.count += 1
        lock.release()
        try:
            return method(self, *args, **kwargs)
        finally:
            with lock:
                uses.count -= 1
                if uses.closing and not uses.count:
                    uses.idle.notify_all()

    return held


def holding(names: str) -> Callable[[type[T]], type[T]]:
    """A class decorator: its methods ``names`` (separated by spaces) held ``in_use``."""

    def wrap(cls: type[T]) -> type[T]:
        for name in names.split():
            setattr(cls, name, in_use(getattr(cls, name)))
        return cls

    return wrap


def free_model(lib: Any, ptr: Any, uses: InUse) -> None:
    """A model's finalizer, on every path (``close()``, collection, interpreter exit while other
    threads still call): it waits for the calls under way."""
    uses.close()
    lib.llama_model_free(ptr)
