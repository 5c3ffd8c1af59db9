"""One scheduling loop per model: every decode of its contexts is a unit of work (``Step``) that
goes through ``Batcher.run`` (llama-server's ``update_slots``, for threads and asyncio tasks).

The units: a stream's generation step (its sampled token, any a constraint forces, and drafted
tokens to verify: ``drafting``), a stretch of tokens to decode (a prompt's chunk, a reply's
forced tokens, an anticipated opening), and work that decodes through llama.cpp by itself (an
image's embeddings, an encoder's pass). A unit that finds no other stream stepping on its context
(or whose thread holds the engine's lock) is decoded at once on its caller's thread, whole, as it
always was: nothing is decoded that nobody asked for, nothing crosses threads, and a cancel stops
a stretch's decode in flight. Otherwise it queues for the engine's decode thread, which takes
every unit then waiting, decodes them in one ``llama_decode`` (each run with logits on its last
token, or on its drafts' too) and samples each from its own row; while it decodes, the next
steps queue up, so N busy streams settle into batches of N. (One thread decodes the batches:
with an OpenMP build of ggml, which a user may bring, each decoding thread has a team of its own,
and a second team ran a fifth slower; the set-up builds ggml's own thread pool.)

Streams in their generation loop register (``generating``); the decode thread waits a moment
(``GATHER_S``, or a twentieth of the last batch's time when batches are slow: each stream missing
one would wait two) until every one of them that stepped within ``RECENT_S`` (or two batches' time)
has queued its step, so the batches stay full although each stream does its own Python work between
steps, and a stream whose consumer stopped reading soon stops being waited for.

Each batch takes every generating stream's tokens first, then as many of the waiting stretches'
tokens as keep the step within a latency budget (``chunking``), so a long prompt neither stalls
the streams nor waits for them; a stretch stays queued, slice after slice, until it is whole. A
unit that decodes by itself goes alone, between two batches, once it is the oldest waiting. A
batch that llama.cpp refuses is retried one sequence at a time, so one failing sequence fails
alone; a failing unit of its own fails alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from llmsession.engine.chunking import ChunkSizer
from llmsession.engine.work import Gate, Step, Tracker
from llmsession.errors import ModelClosedError, NativeError
from llmsession.native.context import DecodeAborted, NativeContext

GATHER_S = 0.002  # how long a leader waits for generating streams that have not queued yet
GATHER_SHARE = 0.05  # or this share of the last batch's time, if longer
RECENT_S = 0.05  # a stream that has not stepped for this long is not waited for


class Batcher:
    """The queue of steps waiting for a model's contexts; see the module's docstring."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate  # the engine's lock: held for every native call on its contexts
        self._queue = threading.Condition()  # held only to add, count or take steps
        self._pending: list[Step] = []
        self._streams: dict[int, set[Tracker]] = {}  # the generating streams, per context
        self.batches = self.steps = 0  # how many decodes, and how many generation steps they carried
        self.prompt_tokens = 0  # prompt tokens the decode thread decoded (in slices)
        self.mixed = 0  # batches that carried prompt slices beside generation steps
        self.sizer = ChunkSizer()
        self._last_batch_s = 0.0
        self._worker: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def generating(self, context: NativeContext, *, prompt: bool = False) -> Iterator[Tracker]:
        """A stream's generation loop (or, ``prompt``, a prompt fed in chunks) on ``context``: a
        leader may wait for its next step."""
        tracker = Tracker(prompt)
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
        """Decode ``step`` (with whatever else is waiting) and return its sampled token (-1
        when it samples nothing). Alone (no other stream steps on its context, or this thread
        holds the engine's lock) it is decoded at once on the caller's thread, whole, and a
        cancel stops its decode in flight: nothing waits, nothing crosses threads."""
        context = step.target.context
        if self.gate.held_here or self.alone(context, step.tracker):
            with self.gate.hold():
                step.slice_end = len(step.tokens)
                self._decode(context, [step], alone=True)
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
            step.abandoned = True  # (a prompt's stretch ends with the slice being decoded)
            if not self._withdraw(step):
                wait_out(done)
            raise
        return self._outcome(step)

    def _withdraw(self, step: Step) -> bool:
        """Take an interrupted step out of the queue if no batch has decoded any of it (its
        caller need not wait for one)."""
        with self._queue:
            if step not in self._pending or (step.prompt and step.taken > 0):
                return False
            self._pending.remove(step)
        return True

    def alone(self, context: NativeContext, tracker: Tracker | None = None) -> bool:
        """No other stream is stepping on ``context``: nothing to batch with."""
        now, recent = time.perf_counter(), self._recent_s
        with self._queue:
            if any(s.target.context is context for s in self._pending):
                return False
            trackers = self._streams.get(id(context), set())
            return not any(t is not tracker and now - t.last < recent for t in trackers)

    @property
    def _recent_s(self) -> float:
        """How lately a stream must have stepped to count as stepping: a stream that queued
        during a slow batch has waited for all of it (a mixed batch takes hundreds of ms)."""
        return max(RECENT_S, 2 * self._last_batch_s)

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
            steps: list[Step] | None = None  # (None: an error before the batch was taken)
            try:  # (the thread must live: every caller waits on it)
                self._gather(context)
                steps = self._take(context)  # never waits for the queue holding the engine's lock
                while self.gate.contended:  # a lone prefill's batch goes between two of these
                    time.sleep(0.0005)
                with self.gate.hold():
                    self._decode(context, steps)
            except BaseException as error:
                self._fail(context, steps, error)

    def _fail(self, context: NativeContext, steps: list[Step] | None, error: BaseException) -> None:
        """The batch's steps end with ``error`` (a prompt's stretch queued again ends here);
        before it was taken (``None``), every step waiting for ``context`` does: none waits
        forever."""
        with self._queue:
            failed = [s for s in self._pending if s.target.context is context] if steps is None else steps
            self._pending = [s for s in self._pending if s not in failed]
        for step in failed:
            if step.done is not None and not step.done.is_set():
                step.error = step.error or error
                step.finish()

    def _gather(self, context: NativeContext) -> None:
        """Wait (briefly) until as many steps wait for ``context`` as its last batch carried."""
        deadline = time.perf_counter() + max(GATHER_S, GATHER_SHARE * self._last_batch_s)
        with self._queue:
            while (left := deadline - time.perf_counter()) > 0:
                waiting = sum(1 for s in self._pending if s.target.context is context)
                now, recent = time.perf_counter(), self._recent_s
                active = sum(1 for t in self._streams.get(id(context), ()) if now - t.last < recent)
                if waiting >= active:
                    return
                self._queue.wait(left)

    def _take(self, context: NativeContext) -> list[Step]:
        """The waiting steps for ``context``, oldest first, as many as one batch holds: every
        generation step first, then prompt chunks within the step's budget (``chunking``)."""
        taken: list[Step] = []
        room = context.batch.capacity
        with self._queue:
            ours = [s for s in self._pending if s.target.context is context]
            if ours and ours[0].native is not None:  # the oldest work decodes by itself: alone
                native = ours[0]
                self._pending.remove(native)
                if native.stopped:  # (cancelled while it waited: nothing of it decoded)
                    native.error = DecodeAborted(clean=True)
                    native.finish()
                    return []
                native.slice_end = len(native.tokens)
                return [native]
            ours = [s for s in ours if s.native is None]
            for step in (s for s in ours if not s.prompt):
                if step.abandoned:  # (its caller was interrupted, and no longer waits: nothing decoded)
                    self._pending.remove(step)
                    step.error = DecodeAborted(clean=True)
                    step.finish()
                elif len(step.decoding) <= room or not taken:
                    taken.append(step)  # (one too long for any batch is taken alone: it errs)
                    room -= len(step.decoding)
            now, recent = time.perf_counter(), self._recent_s
            streaming = (t for t in self._streams.get(id(context), ()) if not t.prompt)
            if taken or any(now - t.last < recent for t in streaming):  # (a consumer reads slowly)
                room = min(room, self.sizer.allowance(context.batch.capacity))
            for step in (s for s in ours if s.prompt):
                if step.stopped:  # it ends with what it has
                    self._pending.remove(step)
                    step.finish()
                elif room > 0:
                    step.slice_end = step.taken + min(len(step.tokens) - step.taken, room)
                    room -= step.slice_end - step.taken
                    taken.append(step)
            self._pending = [s for s in self._pending if s not in taken]
        return taken

    def _decode(self, context: NativeContext, steps: list[Step], *, alone: bool = False) -> None:
        """Decode ``steps`` in one batch and sample each; every step ends done. A batch
        llama.cpp refuses is decoded again one step at a time (``_isolate``). ``alone``: one
        step on its caller's thread (a cancel stops it in flight; a stretch of tokens decoded so
        is not counted as a batch of the loop's)."""
        ready = [step for step in steps if self._ready(context, step)]
        if not ready:
            return
        if ready[0].native is not None:  # (taken alone)
            self._native(context, ready[0])
            return
        abortable = alone and ready[0].cancellable
        if abortable:
            context.abort = ready[0].target.cancelled
        began = time.perf_counter()
        try:
            runs = [(s.decoding, s.at, s.target.seq) for s in ready]
            rows = context.decode_many(runs, [1 + len(s.drafts) for s in ready], abortable=abortable)
        except NativeError as error:
            self._isolate(context, ready, error)
            return
        except BaseException as error:  # every sequence in the batch may be partly written
            for step in ready:
                step.error = error
                step.finish()
            return
        decoded = time.perf_counter() - began
        if not (alone and ready[0].prompt):
            self._count(ready, decoded)
        ended, unfinished = time.perf_counter(), []
        for step, row in zip(ready, rows, strict=True):
            step.target.decoded(step.decoding, decoded)
            whole = step.whole
            if step.prompt:
                step.taken = step.slice_end
            try:
                if step.drafts:
                    self._verify(step, row)
                elif step.sampler is not None and whole:
                    step.token = step.target.sample_row(row, step.sampler)
            except BaseException as error:  # a constraint's error is its stream's alone
                step.error = error
            if step.tracker is not None:
                step.tracker.last = ended
            if whole or step.error is not None:
                step.finish()
            else:
                unfinished.append(step)
        if unfinished:  # a prompt's next slice goes in the next batch
            with self._queue:
                self._pending[:0] = unfinished

    @staticmethod
    def _verify(step: Step, row: int) -> None:
        """Sample each drafted position in turn, keeping the drafts while the samples equal them
        (``drafting``); the first sample that differs (or the one after the last draft) is the
        step's token, and the rejected drafts leave memory and record."""
        drafts, sampler = step.drafts, step.sampler
        assert sampler is not None
        first = row - len(drafts)
        token = step.target.sample_row(first, sampler)
        while step.accepted < len(drafts) and token == drafts[step.accepted]:
            step.accepted += 1
            token = step.target.sample_row(first + step.accepted, sampler)
        step.token = token
        if step.accepted < len(drafts):
            step.target.drop_last(len(drafts) - step.accepted)

    @staticmethod
    def _native(context: NativeContext, step: Step) -> None:
        """Work that decodes by itself (it records what it decoded), then its sample."""
        assert step.native is not None
        if step.cancellable:
            context.abort = step.target.cancelled
        try:
            step.native()
            if step.sampler is not None:
                step.token = step.target.sample_row(-1, step.sampler)
        except BaseException as error:  # (its memory is its own: ``Seat.after_abort``)
            step.error = error
        step.finish()

    @staticmethod
    def _ready(context: NativeContext, step: Step) -> bool:
        """Room made and the run checked for ``step``; else it ends with its own error."""
        try:
            if step.native is None:  # (native work checks its own positions)
                context.check_run(step.decoding, step.at, step.target.seq)
            step.target.make_room(len(step.decoding))
            return True
        except BaseException as error:  # this stream's budget error is its own
            step.error = error
            step.finish()
            return False

    def _isolate(self, context: NativeContext, steps: list[Step], error: NativeError) -> None:
        """llama.cpp refused the batch (and took back what it wrote of it): decode each step
        alone, so only a step that fails alone fails (a sequence that cannot go back to where
        its step began, a recurrent state, fails with the batch's error)."""
        for step in steps:
            try:
                alone = len(steps) > 1 and step.target.rewind(step.at)
            except NativeError:
                alone = False
            if alone:
                self._decode(context, [step])
            else:
                step.error = error
                step.finish()

    def _count(self, steps: list[Step], seconds: float) -> None:
        self._last_batch_s = seconds
        prompt = sum(len(s.decoding) for s in steps if s.prompt)
        others = sum(len(s.decoding) for s in steps if not s.prompt)
        self.batches, self.steps = self.batches + 1, self.steps + sum(1 for s in steps if not s.prompt)
        self.prompt_tokens += prompt
        self.mixed += bool(prompt and others)
        self.sizer.observe(prompt, others, seconds)


def wait_out(done: threading.Event) -> None:
    """Wait for an abandoned step's batch to end (a slice of a prompt at most; an image's or an
    encoder's whole pass), through any further Ctrl-C: a second one left it to be decoded into a
    sequence its session might no longer hold. Another exception met meanwhile (a signal
    handler's ``SystemExit``) is raised once it has ended."""
    met: BaseException | None = None
    while True:
        try:
            if done.wait(0.05):
                break
        except KeyboardInterrupt:  # (again: still waited out)
            continue
        except BaseException as error:
            met = met or error
    if met is not None:
        raise met
