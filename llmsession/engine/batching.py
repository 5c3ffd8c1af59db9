"""Concurrent streams of one model decode their next tokens in one batch (llama-server's continuous
batching, for threads and asyncio tasks).

A stream's generation step asks for its tokens (the sampled one, and any a constraint forces) to be
decoded into its sequence and the next token sampled from their logits. A lone stream's step is
decoded at once on its own thread, as its prefill was: nothing is decoded that nobody asked for,
and nothing crosses threads. When other streams of the context are stepping too, the engine's
decode thread takes every step then waiting, decodes them in one ``llama_decode`` (each run with
logits on its last token) and samples each from its own row; while it decodes, the next steps
queue up, so N busy streams settle into batches of N. (One thread decodes the batches: with an
OpenMP build of ggml, which a user may bring, each decoding thread has a team of its own, and a
second team ran a fifth slower; the set-up builds ggml's own thread pool.) Streams in their generation loop
register (``generating``); the decode thread waits a moment (at most ``GATHER_S``) until every one
of them that stepped within ``RECENT_S`` has queued its step, so the batches stay full although
each stream does its own Python work between steps, and a stream whose consumer stopped reading
soon stops being waited for. Prefills stay in batches of ``batch_size``, and the decode thread
lets a waiting one go between two generation batches, so a long prompt does not stall the others
and is not stalled by them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from llmsession.errors import ModelClosedError
from llmsession.native.context import NativeContext
from llmsession.native.sampler import TokenSampler

GATHER_S = 0.002  # how long a leader waits for generating streams that have not queued yet
RECENT_S = 0.05  # a stream that has not stepped for this long is not waited for


class Gate:
    """The engine's lock, and how many threads wait for it: a prefill goes first between two
    generation batches, and background work (``anticipate``) gives way to anyone."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._waiting = 0
        self._counting = threading.Lock()

    @property
    def contended(self) -> bool:
        return self._waiting > 0

    def hold(self) -> Gate:
        """The lock, counted as waited for until it is taken: ``with gate.hold():`` (a plain
        context manager, no generator: every decode and sample takes it)."""
        return self

    def __enter__(self) -> None:
        with self._counting:
            self._waiting += 1
        try:
            self.lock.acquire()
        except BaseException:  # interrupted (Ctrl-C) before it got the lock
            self._uncount()
            raise
        try:
            self._uncount()
        except BaseException:  # interrupted once it had the lock: let it go
            self.lock.release()
            raise

    def _uncount(self) -> None:
        with self._counting:
            self._waiting -= 1

    def __exit__(self, *_exc: object) -> None:
        self.lock.release()


@dataclass(eq=False)
class Tracker:
    """A generating stream, and when its last step ended."""

    last: float = field(default_factory=time.perf_counter)


class Target(Protocol):
    """The sequence a step decodes into (``seat.Seat``): the same three calls make a lone
    decode's room, record and sample."""

    context: NativeContext
    seq: int

    def make_room(self, n_tokens: int) -> None: ...

    def decoded(self, items: Sequence[int], seconds: float) -> None: ...

    def sample_row(self, row: int, sampler: TokenSampler) -> int: ...


@dataclass(eq=False)
class Step:
    """One stream's generation step, and its outcome once ``finish``ed (``done`` is set for a
    step queued for the decode thread)."""

    target: Target
    tokens: Sequence[int]
    pos: int
    sampler: TokenSampler
    tracker: Tracker | None = None
    token: int = -1
    error: BaseException | None = None
    done: threading.Event | None = None

    def finish(self) -> None:
        if self.done is not None:
            self.done.set()


class Batcher:
    """The queue of steps waiting for a model's contexts; see the module's docstring."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate  # the engine's lock: held for every native call on its contexts
        self._queue = threading.Condition()  # held only to add, count or take steps
        self._pending: list[Step] = []
        self._streams: dict[int, set[Tracker]] = {}  # the generating streams, per context
        self.batches = self.steps = 0  # how many decodes, and how many steps they carried
        self._worker: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def generating(self, context: NativeContext) -> Iterator[Tracker]:
        """A stream's generation loop on ``context``: a leader may wait for its next step."""
        tracker = Tracker()
        with self._queue:
            self._streams.setdefault(id(context), set()).add(tracker)
        try:
            yield tracker
        finally:
            with self._queue:
                streams = self._streams[id(context)]
                streams.discard(tracker)
                if not streams:  # (single-use contexts come and go)
                    del self._streams[id(context)]
                self._queue.notify_all()

    def run(self, step: Step) -> int:
        """Decode ``step`` (with whatever else is waiting) and return its sampled token."""
        if self._alone(step):  # on the caller's thread, which decoded its prefill too
            with self.gate.hold():
                self._decode(step.target.context, [step])
            return self._outcome(step)
        with self._queue:
            if self._closed:
                raise ModelClosedError("this model is closed")
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="llmsession-decode", daemon=True)
                self._worker.start()
            step.done = done = threading.Event()
            self._pending.append(step)
            self._queue.notify_all()
        try:
            done.wait()
        except BaseException:  # Ctrl-C while waiting: the step ends first, so memory matches its record
            while not done.wait(0.05):
                pass
            raise
        return self._outcome(step)

    def _alone(self, step: Step) -> bool:
        """No other stream is stepping on this context: nothing to batch with."""
        context, now = step.target.context, time.perf_counter()
        with self._queue:
            if any(s.target.context is context for s in self._pending):
                return False
            trackers = self._streams.get(id(context), set())
            return not any(t is not step.tracker and now - t.last < RECENT_S for t in trackers)

    @staticmethod
    def _outcome(step: Step) -> int:
        if step.error is not None:
            raise step.error
        return step.token

    def close(self) -> None:
        """Let the decode thread end (it finishes the steps already queued)."""
        with self._queue:
            self._closed = True
            self._queue.notify_all()

    def _work(self) -> None:
        while True:
            with self._queue:
                while not self._pending and not self._closed:
                    self._queue.wait()
                if not self._pending:
                    return
                context = self._pending[0].target.context
            self._gather(context)
            steps = self._take(context)  # never waits for the queue while holding the engine's lock
            while self.gate.contended:  # a prefill batch goes between two generation batches
                time.sleep(0.0005)
            with self.gate.hold():
                self._decode(context, steps)

    def _gather(self, context: NativeContext) -> None:
        """Wait (briefly) until as many steps wait for ``context`` as its last batch carried."""
        deadline = time.perf_counter() + GATHER_S
        with self._queue:
            while (left := deadline - time.perf_counter()) > 0:
                waiting = sum(1 for s in self._pending if s.target.context is context)
                now = time.perf_counter()
                active = sum(1 for t in self._streams.get(id(context), ()) if now - t.last < RECENT_S)
                if waiting >= active:
                    return
                self._queue.wait(left)

    def _take(self, context: NativeContext) -> list[Step]:
        """The waiting steps for ``context``, oldest first, as many as one batch holds."""
        taken: list[Step] = []
        room = context.batch.capacity
        with self._queue:
            for step in self._pending:
                if step.target.context is context and (len(step.tokens) <= room or not taken):
                    taken.append(step)  # (one too long for any batch is taken alone: it errs)
                    room -= len(step.tokens)
            self._pending = [s for s in self._pending if s not in taken]
        return taken

    def _decode(self, context: NativeContext, steps: list[Step]) -> None:
        """Decode ``steps`` in one batch and sample each; every step ends done."""
        ready = []
        for step in steps:
            try:
                step.target.make_room(len(step.tokens))
                ready.append(step)
            except BaseException as error:  # this stream's budget error is its own
                step.error = error
                step.finish()
        if not ready:
            return
        began = time.perf_counter()
        try:
            rows = context.decode_many([(s.tokens, s.pos, s.target.seq) for s in ready])
        except BaseException as error:  # every sequence in the batch may be partly written
            for step in ready:
                step.error = error
                step.finish()
            return
        decoded = time.perf_counter() - began
        self.batches, self.steps = self.batches + 1, self.steps + len(ready)
        ended = time.perf_counter()
        for step, row in zip(ready, rows, strict=True):
            step.target.decoded(step.tokens, decoded)
            try:
                step.token = step.target.sample_row(row, step.sampler)
            except BaseException as error:  # a constraint's error is its stream's alone
                step.error = error
            if step.tracker is not None:
                step.tracker.last = ended
            step.finish()
