"""One exchange as its caller sees it: ``LocalStream`` iterates the reply's snapshots, one
``exchange.Exchange`` step at a time, under its session's busy guard."""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Generator, Iterator
from contextlib import contextmanager

from llmsession.errors import ModelClosedError, SessionBusyError
from llmsession.replies import Reply, Snapshot
from llmsession.runtime import dropped
from llmsession.runtime.exchange import Exchange
from llmsession.runtime.exiting import STEPPING_HERE
from llmsession.runtime.face import Session, Stream
from llmsession.runtime.readers import CUT, Reader


class Guard:
    """A session's busy guard, held for each step of its exchanges: one thread at a time (a
    second gets ``SessionBusyError`` at once while the first steps a live exchange, or does
    anything else with the session), and none once the session is ``closed`` (a
    ``ModelClosedError`` saying ``refusal``). A holder that only lets go of a stream (its
    ``brief`` close, or a step of a stream whose exchange another call finished meanwhile) holds
    it for an instant: it is waited for, up to ``BRIEF_S`` (a stream broken out of with
    ``async for`` left its pump thread to close it, and the next stream's first step found the
    guard taken a third of the time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None  # the thread holding the lock (set once it holds it)
        self.stepping: Exchange | None = None  # the exchange its holder steps, if any
        self.brief = False  # its holder only closes a stream
        self.closed = False
        self.refusal = "this session is closed (or its model is)"

    def __enter__(self) -> None:
        self._take(0.0)
        if self.closed:
            self.lock.release()
            raise ModelClosedError(self.refusal)
        self.owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self.owner = self.stepping = None
        self.lock.release()

    def _take(self, seconds: float) -> None:
        """The lock within ``seconds`` (0: at once), or as long as its holder only lets go of
        a stream (up to ``BRIEF_S``); else SessionBusyError."""
        if self.held_here:  # (a handler run inside this thread's own step: never free)
            raise SessionBusyError("this session is already generating in this thread")
        if self.lock.acquire(timeout=seconds) if seconds > 0 else self.lock.acquire(blocking=False):
            return
        began = time.monotonic()
        while (waited := time.monotonic() - began) < BRIEF_S:
            live = self.stepping  # (None just after a step took the lock: looked at again)
            letting_go = self.brief or (live is not None and live.done)
            if not letting_go and (live is not None or waited > UNSEEN_S):
                break
            if self.lock.acquire(timeout=0.005):
                return
        raise SessionBusyError("this session is already generating in another thread")

    @contextmanager
    def step(self, exchange: Exchange) -> Iterator[None]:
        """As ``with guard:``, for a step of ``exchange``."""
        with self:
            self.stepping = exchange
            yield

    @property
    def held_here(self) -> bool:
        """This thread is inside a step (a signal handler, a validator or a finalizer run in it:
        waiting for the guard there would wait for ever)."""
        return self.owner == threading.get_ident()

    @contextmanager
    def waiting(self, seconds: float) -> Iterator[None]:
        """As ``with guard:``, but waiting up to ``seconds`` for another thread's step to end
        (a cancelled stream's: it ends within a graph node, then lets go)."""
        self._take(seconds)
        try:
            if self.closed:
                raise ModelClosedError(self.refusal)
            self.owner = threading.get_ident()
            yield
        finally:
            self.owner = self.stepping = None
            self.lock.release()


BRIEF_S = 1.0  # the longest wait for a guard whose holder only lets go of a stream
UNSEEN_S = 0.02  # how long a holder that has not said what it does yet is given to say it


class LocalStream(Stream):
    """A stream decoded in this process: one ``exchange.Exchange`` step per snapshot, each under
    its session's busy guard."""

    def __init__(self, session: Session, exchange: Exchange, guard: Guard) -> None:
        self.session = session
        self.exchange = exchange
        self.reader = Reader()  # (who made it, or took its latest step: ``readers``)
        self.cut = False  # finished for another reader's call: its next step says so
        self._guard = guard
        self._steps = exchange.run()
        # Runs once: on close(), when the session moves on, or when the stream is dropped (then
        # in the thread that dropped it, or ``dropped``'s if a garbage collection found it, without
        # the guard: ``ended`` tells the next call when it has finished, the reply recorded, so
        # that call never starts before).
        dropped.ready()
        self.ended = Finishing()
        self.abandon = weakref.finalize(self, _finish, exchange, self._steps, self.ended, session)

    @property
    def reply(self) -> Reply | None:
        return self.exchange.reply

    def __next__(self) -> Snapshot:
        if self.exchange.model_closed:
            raise ModelClosedError("the model was closed while this stream was open")
        if self.exchange.done:
            if self.cut:
                raise SessionBusyError(CUT)
            raise StopIteration
        with self._guard.step(self.exchange):
            self.reader.note()
            try:
                return next(self._steps)
            except StopIteration:
                if self.exchange.model_closed:  # cancelled by the model's close()
                    raise ModelClosedError("the model was closed while this stream was open") from None
                if self.cut:  # (finished for another's call between the check above and this step)
                    raise SessionBusyError(CUT) from None
                raise

    def cancel(self) -> None:
        self.exchange.cancelled.set()

    def close(self) -> None:
        guard = self._guard
        if guard.held_here:  # (from inside its own step: the step it would wait for is its caller's)
            if self.exchange.done:
                return
            raise SessionBusyError(STEPPING_HERE)
        self.cancel()
        # A step in flight in another thread ends first (it was cancelled; one that finished the
        # reply records it): bounded. Finished and let go of (by its own last step, or by the
        # call that moved the session on), it is left alone: taken then, the guard would be the
        # next stream's first step's to wait for.
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not (self.exchange.done and guard.stepping is not self.exchange):
            if guard.lock.acquire(timeout=CLOSE_POLL_S):
                break
            if time.monotonic() > deadline:
                raise SessionBusyError("this session is generating in another thread")
        else:
            return
        guard.owner, guard.brief = threading.get_ident(), True
        try:
            self.abandon()
        finally:
            guard.owner, guard.brief = None, False
            guard.lock.release()


CLOSE_WAIT_S = 10.0
CLOSE_POLL_S = 0.02  # (how often a waiting close looks whether its exchange finished)


class Finishing(threading.Event):
    """Set once a stream's finishing (``LocalStream.abandon``) has ended; ``began`` once it has
    started, in whichever thread: a session is not idle in between."""

    began = False

    @property
    def under_way(self) -> bool:
        return self.began and not self.is_set()


def _finish(
    exchange: Exchange, steps: Generator[Snapshot, None, None], ended: Finishing, session: Session
) -> None:
    """``session`` is held until the finishing has run: collected in the same pass, its lease
    would be freed (another seat's ``_reap``) under an exchange that still holds a seat of it,
    and a closing model would not wait for it (``shut``)."""
    ended.began = True
    # A finished exchange has nothing left to do but close a finished generator, which takes
    # no lock: done here, its session is idle at once (not after the reaper's turn).
    if exchange.done or not dropped.deferred(functools.partial(_finishing, exchange, steps, ended, session)):
        _finishing(exchange, steps, ended)


def _finishing(
    exchange: Exchange, steps: Generator[Snapshot, None, None], ended: Finishing, session: object = None
) -> None:
    try:
        exchange.abandon(steps)
    finally:
        ended.set()
