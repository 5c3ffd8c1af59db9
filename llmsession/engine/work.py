"""The units of work the model's one loop decodes (``batching``): a ``Step`` into a ``Target``
sequence, and the ``Tracker`` of a stream that steps; and the engine's lock (``Gate``) that every
native call on its contexts holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llmsession.native.context import NativeContext
from llmsession.native.sampler import TokenSampler


class Gate:
    """The engine's lock, and how many threads wait for it: a prefill goes first between two
    generation batches, and background work (``anticipate``) gives way to anyone."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._waiting = 0
        self._counting = threading.Lock()
        self._mine = threading.local()  # ``depth``: how many holds this thread has entered

    @property
    def contended(self) -> bool:
        return self._waiting > 0

    @property
    def held_here(self) -> bool:
        """This thread holds the lock: its work cannot wait for the decode thread, which would
        wait for the lock. (Counted before the lock is taken and after it is let go: a Ctrl-C
        between the two can only make this say True without the lock, which costs nothing,
        never False with it.)"""
        return bool(getattr(self._mine, "depth", 0))

    def hold(self) -> Gate:
        """The lock, counted as waited for until it is taken: ``with gate.hold():`` (a plain
        context manager, no generator: every decode and sample takes it)."""
        return self

    def __enter__(self) -> None:
        mine = self._mine
        mine.depth = getattr(mine, "depth", 0) + 1
        with self._counting:
            self._waiting += 1
        try:
            self.lock.acquire()
        except BaseException:  # interrupted (Ctrl-C) before it got the lock
            self._uncount()
            mine.depth -= 1
            raise
        try:
            self._uncount()
        except BaseException:  # interrupted once it had the lock: let it go
            self.lock.release()
            mine.depth -= 1
            raise

    def _uncount(self) -> None:
        with self._counting:
            self._waiting -= 1

    def __exit__(self, *_exc: object) -> None:
        try:
            self.lock.release()
        finally:
            self._mine.depth -= 1


@dataclass(eq=False)
class Tracker:
    """A generating stream (or a prompt fed in chunks), and when its last step ended."""

    prompt: bool = False
    last: float = field(default_factory=time.perf_counter)


class Target(Protocol):
    """The sequence a step decodes into (``seat.Seat``): the same three calls make a lone
    decode's room, record and sample."""

    context: NativeContext
    seq: int
    cancelled: threading.Event

    def make_room(self, n_tokens: int) -> None: ...

    def decoded(self, items: Sequence[int], seconds: float) -> None: ...

    def sample_row(self, row: int, sampler: TokenSampler) -> int: ...

    def rewind(self, pos: int) -> bool: ...

    def drop_last(self, n_items: int) -> None: ...


@dataclass(eq=False)
class Step:
    """A unit of decoding work and its outcome once ``finish``ed (``done`` is set for one queued
    for the decode thread): a stream's generation step (with any drafts after its token), a
    stretch of tokens to decode (``prompt``: a prompt's chunk, a reply's forced tokens, an
    anticipated opening; it stays queued while batch after batch decodes a slice of it, ``taken``
    so far, and samples after the last), or ``native`` work that decodes through llama.cpp by
    itself (an image's embeddings, an encoder pass: decoded alone, as its own batch)."""

    target: Target
    tokens: Sequence[int]
    pos: int
    sampler: TokenSampler | None
    tracker: Tracker | None = None
    prompt: bool = False
    cancellable: bool = False  # a cancel of its target stops it (between slices, or within a lone decode)
    native: Callable[[], None] | None = None  # decodes (and records) by itself; the sampler samples after
    taken: int = 0
    slice_end: int = 0  # a prompt's tokens up to which the current batch decodes
    abandoned: bool = False  # its caller was interrupted: decode no more of it
    drafts: Sequence[int] = ()  # a generation step's proposed next tokens, verified by sampling
    accepted: int = 0  # how many of them the samples kept
    token: int = -1
    error: BaseException | None = None
    done: threading.Event | None = None

    @property
    def decoding(self) -> Sequence[int]:
        """The tokens this step's batch decodes."""
        if self.prompt:
            return self.tokens[self.taken : self.slice_end]
        return [*self.tokens, *self.drafts] if self.drafts else self.tokens

    @property
    def at(self) -> int:
        """The position of the first of them."""
        return self.pos + self.taken

    @property
    def whole(self) -> bool:
        """Once decoded, nothing of the step is left to decode: its sampler samples."""
        return not self.prompt or self.slice_end == len(self.tokens)

    @property
    def stopped(self) -> bool:
        """Its caller was interrupted, or it was cancelled: decode no more of it."""
        return self.abandoned or (self.cancellable and self.target.cancelled.is_set())

    def finish(self) -> None:
        if self.done is not None:
            self.done.set()
