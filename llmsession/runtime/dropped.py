"""Streams the cyclic garbage collector finds dropped are finished in a thread of their own.

A stream dropped by its last reference is finished where it was dropped, at once: its reply is
in the transcript when ``del`` returns. One kept alive by a reference cycle (an exception's
traceback that holds it, say) is freed by the cyclic collector, which runs in whichever thread
allocates at that moment: possibly one holding a lock the finishing takes (a reply's record, the
parking lot's), which would then wait on itself forever. So a finishing asked for inside a
collection is queued (``queue.SimpleQueue``'s ``put`` is safe there) to one daemon thread; the
stream's ``Finishing`` says it is under way, and its session's next call waits for it. A model
closing first waits for every one queued (``finish_dropped``): none finishes on freed memory.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("llmsession")

_jobs: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
_collecting = threading.local()  # ``on`` while this thread runs a cyclic collection
_reaper: list[threading.Thread] = []  # the thread, once started
_starting = threading.Lock()


def _on_collection(phase: str, info: dict[str, int]) -> None:
    _collecting.on = phase == "start"


gc.callbacks.append(_on_collection)


def ready() -> None:
    """Start the thread that finishes what a collection drops (from ordinary code: never from
    inside a collection, where starting a thread takes locks of its own)."""
    with _starting:
        if not _reaper:
            thread = threading.Thread(target=_reap, name="llmsession-dropped-streams", daemon=True)
            try:
                thread.start()
            except RuntimeError as error:  # (no thread to be had: dropped streams finish inline)
                log.warning("no thread for streams a garbage collection drops: %s", error)
                return
            _reaper.append(thread)


def deferred(job: Callable[[], object]) -> bool:
    """Queue ``job`` if this thread is inside a cyclic collection (True), else leave it to the
    caller to run now (False)."""
    if not getattr(_collecting, "on", False) or not _reaper:
        return False
    _jobs.put(job)
    return True


def finish_dropped(timeout: float = 60.0) -> None:
    """Wait until every finishing queued so far has run (a model closing: none may run after
    its memory is freed)."""
    if not _reaper or threading.current_thread() is _reaper[0]:
        return
    done = threading.Event()
    _jobs.put(done.set)  # (the queue runs in order: all before it have finished)
    if not done.wait(timeout):
        log.warning("streams dropped in a garbage collection were still finishing after %.0f s", timeout)


def _reap() -> None:
    while True:
        job = _jobs.get()
        try:
            job()
        except BaseException:  # (a finishing that failed: its ``Finishing`` is set all the same)
            log.exception("a stream dropped in a garbage collection failed to finish")
        finally:
            del job  # (a finishing holds its session: not kept alive while the next is awaited)


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it starts its own when it needs one."""
    global _jobs, _starting
    _reaper.clear()
    _jobs, _starting = queue.SimpleQueue(), threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
