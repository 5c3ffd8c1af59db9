"""Anticipatory prefill: when a reply ends, the opening of the next prompt is already known (the
end of the reply's turn and the next user turn's header, whatever the user types), so a
background thread decodes it while the user reads and types; the next exchange then decodes only
the user's own words.

The opening is found generically: the transcript rendered with two probe user messages of
different kinds, and the tokens their prompts share. Being wrong is cheap and never changes an
answer: the next exchange keeps the longest prefix its prompt shares with memory, as always (a
recurrent memory resumes from the checkpoint taken where this prefill began, so models whose
state cannot rewind are not anticipated for). It never delays anyone: it uses the engine's idle time
(a script's next question comes sooner than its quiet moment), gives up the moment another exchange waits for
the engine, and a new exchange of its own session waits for it only if it has begun and the new
prompt begins with what it decodes, else stops it within a graph node.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmsession.engine.engine import Engine
from llmsession.engine.lease import Lease
from llmsession.engine.prefix import Item, common_prefix
from llmsession.engine.prompt import Prompt
from llmsession.native.cancel import ACTIVITY
from llmsession.native.context import DecodeAborted
from llmsession.native.llama import NativeModel
from llmsession.replies import Message

log = logging.getLogger("llmsession")
QUIET_S = 0.05  # it begins once nothing has decoded for this long (a script's next call comes sooner)
PATIENCE_S = 1.0  # and gives up without such a pause within this time
PROBES = ("A", "1")  # two user messages that share nothing: their prompts share the opening
_running: weakref.WeakSet[Ahead] = weakref.WeakSet()
_exit_hook: list[object] = []


class Yielding(threading.Event):
    """An abort flag that is also set while another thread waits for the engine, or once the
    session is gone."""

    def __init__(self, engine: Engine, alive: Callable[[], bool]) -> None:
        super().__init__()
        self.engine, self.alive = engine, alive  # (its Ahead holds the engine)

    def is_set(self) -> bool:
        return super().is_set() or self.engine.contended or not self.alive()


@dataclass(frozen=True)
class Guess:
    """What the background thread needs of its session (which it never holds, so that a
    dropped session goes at once): how its prompts are made, and the transcript so far."""

    prompt: Callable[[list[Message]], Prompt]  # the session's prompt for a transcript
    native: NativeModel
    enabled: bool  # the model's ``anticipate``
    lease: Lease
    messages: list[Message]
    context_size: int
    batch_size: int


class Ahead:
    """One session's anticipatory prefill, running in its own thread."""

    def __init__(self, engine: Engine, guess: Guess, alive: Callable[[], bool]) -> None:
        self.engine = engine
        self.cancelled = Yielding(engine, alive)
        self.target: tuple[Item, ...] | None = None  # what memory will hold, once known
        self.start, self.decoded = 0, 0  # positions start.. start + decoded were decoded ahead
        self.started = False  # its first decode has begun
        self._wake = threading.Event()  # stop waiting for idle time: stopped, or waited for
        self._thread = threading.Thread(target=self._run, args=(guess,), name="llmsession-ahead", daemon=True)
        if not _running and not _exit_hook:  # registered after the finalizers' own hook, so it runs first
            _exit_hook.append(atexit.register(stop_all))
        _running.add(self)
        self._thread.start()

    def settle(self, prompt: Sequence[Item] | None) -> None:
        """Before the session touches its memory: wait for this prefill if it has begun decoding
        and ``prompt`` (the next one) begins with what it decodes, else stop it (None: always
        stop it, and wait until its thread is done). One that has not begun is not waited for:
        the exchange decodes the opening in its own batch, which costs less than a batch of its
        own (it touches memory only under the engine's lock, after checking that it was not
        stopped)."""
        target = self.target
        wanted = (
            self.started
            and target is not None
            and prompt is not None
            and tuple(prompt[: len(target)]) == target
        )
        if not wanted:
            self.cancelled.set()
            self._wake.set()
        if wanted or prompt is None:
            self._thread.join()

    def reused_of(self, reused: int) -> int:
        """How many of the first ``reused`` positions were decoded ahead (read under the engine's
        lock: a stopped prefill no longer changes memory then). Those of a stopped one count too,
        where the exchange keeps them (after a ``fork`` or ``save``, say)."""
        return max(0, min(reused - self.start, self.decoded))

    def wait(self) -> None:
        """Until it has finished, beginning now if it waits for idle time (someone waits for it:
        tests and benchmarks, to see what it decoded)."""
        self._wake.set()
        self._thread.join()

    def _run(self, guess: Guess) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while ACTIVITY.idle_for() < QUIET_S:  # idle time only: no decode anywhere in the process
            if self._wake.wait(QUIET_S):
                break  # waited for (or stopped: seen below)
            if self.cancelled.is_set() or time.monotonic() > deadline:
                return  # the next call came (it decodes the opening in its own batch), or no idle time
        if self.cancelled.is_set():
            return
        try:
            decode_opening(self, guess)
        except Exception as error:  # it was only a guess: the next exchange does the work
            log.debug("anticipatory prefill stopped: %s", error)


def opening(guess: Guess) -> tuple[Item, ...]:
    """The items every next prompt of this transcript begins with, whatever the user writes."""
    probes = []
    for probe in PROBES:
        transcript: list[Message] = [*guess.messages, {"role": "user", "content": probe}]
        prompt = guess.prompt(transcript)
        prompt.close()
        probes.append(prompt.items)
    return tuple(probes[0][: common_prefix(*probes)])


def worth_it(guess: Guess) -> bool:
    """Whether the opening is worth decoding ahead: never for an encoder-decoder model (each
    exchange has a context of its own), a recurrent memory that cannot rewind if the guess is
    wrong (no checkpoints), or a transcript with images (re-tokenizing them is not free)."""
    native, cache = guess.native, guess.lease.cache
    rewinds = not native.is_recurrent or bool(cache.checkpoint_stops(len(cache.items) + 1))
    return (
        guess.enabled
        and not native.has_encoder
        and rewinds
        and all(isinstance(m.get("content"), str) for m in guess.messages)
    )


def decode_opening(ahead: Ahead, guess: Guess) -> None:
    """Decode the opening after what memory holds, one batch at a time, each under one hold of
    the engine's lock (the session is never busy between them, so it can be parked as any idle
    one); first a checkpoint where memory is recurrent (where a wrong guess resumes from)."""
    target = opening(guess)
    if len(target) + 1 >= guess.context_size:
        return  # the next prompt cannot fit anyway
    engine, lease = ahead.engine, guess.lease
    reused = common_prefix(lease.cache.items, target)
    if reused < len(lease.cache.items):
        return  # the transcript changed under memory: leave it to the exchange
    ahead.target, ahead.start = target, reused
    while True:
        with engine.hold():
            if ahead.cancelled.is_set():
                return  # stopped, or another thread waits for the engine: give way
            ahead.started = True
            with engine.seat(lease, len(target), ahead.cancelled, exchange=False) as seat:
                done = len(seat.items)
                if done == len(target) or done < reused or seat.items != target[:done]:
                    return  # done, or lost meanwhile (parked, then dropped cold)
                if done in seat.checkpoint_stops(len(target)) and not ahead.decoded:
                    seat.checkpoint()
                chunk = [int(item) for item in target[done : done + guess.batch_size]]  # type: ignore[call-overload]
                try:
                    seat.decode(chunk, done, abortable=True)
                except DecodeAborted:
                    seat.after_abort()
                    return
                ahead.decoded += len(chunk)


def stop_all(engine: Engine | None = None) -> None:
    """Stop (and wait for) every anticipation, or ``engine``'s: before its model is freed, and at
    exit, before ``weakref.finalize``'s exit hook frees the contexts a thread may decode into
    (atexit runs the newest hook first; ours is registered with the first anticipation, after
    the model's finalizers registered theirs)."""
    while True:  # (an exchange that ends meanwhile adds to the set: its iteration raises)
        with contextlib.suppress(RuntimeError):
            running = list(_running)
            break
    for ahead in running:
        if engine is None or ahead.engine is engine:
            ahead.settle(None)


def start(engine: Engine, guess: Guess, alive: Callable[[], bool]) -> Ahead | None:
    """Begin decoding the next prompt's opening in the background (None if not worth it);
    ``alive`` says whether the session still exists."""
    return Ahead(engine, guess, alive) if worth_it(guess) else None
