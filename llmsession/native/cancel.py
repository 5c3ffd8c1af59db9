"""How a decode is stopped, and who else is decoding: an exchange's cancel flag (mirrored in a
word that native code reads without the GIL), the abort callbacks llama.cpp calls at every graph
node, and the process's decode activity that background work waits out."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from llmsession.native.llama import bindings


class Activity:
    """Whether any context of this process is decoding, and since when none has: background work
    (``anticipate``) waits for the CPU to be idle, whichever model or context used it. A decode
    runs inside ``with ACTIVITY:`` (a plain context manager: it runs once per generated token)."""

    def __init__(self) -> None:
        self._running, self._ended, self._lock = 0, time.monotonic(), threading.Lock()
        self._began = self._ended
        self._allowed = 0.0  # seconds a state being moved may take before it counts as stuck

    @contextmanager
    def moving(self, nbytes: int) -> Iterator[None]:
        """A sequence's state read or written: busy, and (over RPC, a transfer) allowed
        ``nbytes`` at ``STATE_BYTES_S`` before ``busy_for`` counts it (a big model's state is
        gigabytes: a healthy save must not pass for a stuck server). The allowance is the
        process's while it runs: a decode hung meanwhile is reported that much later."""
        allowed = nbytes / STATE_BYTES_S
        self._begin(allowed)
        try:
            yield
        finally:
            self._end(allowed)

    def __enter__(self) -> None:
        self._begin(0.0)

    def __exit__(self, *_exc: object) -> None:
        self._end(0.0)

    def _begin(self, allowed: float) -> None:
        with self._lock:
            if not self._running:
                self._began = time.monotonic()
            self._running += 1
            self._allowed += allowed

    def _end(self, allowed: float) -> None:
        with self._lock:
            self._running, self._ended = self._running - 1, time.monotonic()
            self._allowed = self._allowed - allowed if self._running else 0.0  # (none left over)

    def idle_for(self) -> float:
        """Seconds since the last decode ended (0 while one runs)."""
        return 0.0 if self._running else time.monotonic() - self._ended

    def busy_for(self) -> float:
        """Seconds native work (a decode, a state moved) has been running since any last ended,
        less what a state being moved is allowed (0 while none runs): how a worker process
        tells a call that hangs (an RPC server that stopped answering) from a slow exchange."""
        if not self._running:
            return 0.0
        return max(0.0, time.monotonic() - max(self._began, self._ended) - self._allowed)


STATE_BYTES_S = 8e6  # (a slow network's: 64 Mbit/s)
ACTIVITY = Activity()


class CancelFlag(threading.Event):
    """An exchange's cancel flag, mirrored in a word native code reads: a decode outside the main
    thread checks it without taking the GIL (``abort_check.c``)."""

    def __init__(self) -> None:
        from llama_cffi import ffi

        super().__init__()
        self.word = ffi.new("int *")

    def set(self) -> None:
        self.word[0] = 1
        super().set()

    def clear(self) -> None:
        self.word[0] = 0
        super().clear()


class AbortFlag:
    """What the prefill abort callback reads. The callback closes over this, never over the
    context, so the context is in no reference cycle."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def native_word(self) -> Any:
        """The word to hand the native check, or None when the check must run in Python: on the
        main thread (a Ctrl-C raises inside the Python callback, so it stops the decode), and for
        any other event (``anticipate.Yielding``'s state is computed in Python)."""
        event = self.event
        if not isinstance(event, CancelFlag):
            return None
        return None if threading.current_thread() is threading.main_thread() else event.word


def abort_callback(flag: AbortFlag) -> Any:
    """``bool(void *)`` for llama_set_abort_callback: stop when the flag is set, or when a
    signal handler raised inside a callback (the exception is kept for the caller to raise)."""
    from llama_cffi import has_pending_error, note_abort, stash_error

    _, ffi = bindings()

    def on_error(kind: Any, error: BaseException | None, traceback: Any) -> bool:
        stash_error(kind, error, traceback)
        return True

    def should_abort(_data: Any) -> bool:
        if flag.event.is_set() or has_pending_error():
            note_abort()
            return True
        return False

    return ffi.callback("bool(void *)", should_abort, onerror=on_error)
