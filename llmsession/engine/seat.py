"""A session's sequence for one exchange (``Seat``), and ``prefix.Memory`` over a sequence.

Sessions touch memory only through a seat the engine gives them. Every decode goes through the
model's one loop (``batching``: ``decode``, ``step``, ``eval_image`` and ``encode`` each hand it
a unit of work), which takes the engine's lock for it (``sample_row`` and ``make_room`` run under
it), so a decode and the sampling of its logits happen under one hold; every other call that
touches the context takes the lock itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Protocol

from llmsession.engine.batching import Batcher
from llmsession.engine.budget import Counters
from llmsession.engine.lease import Lease, SharedContext
from llmsession.engine.prefix import Item, Plan
from llmsession.engine.residency import Move
from llmsession.engine.work import Step, Tracker
from llmsession.errors import GrammarError, MemoryBudgetError, NativeError
from llmsession.native.context import DecodeAborted, NativeContext
from llmsession.native.projector import ImageChunk, Projector
from llmsession.native.sampler import TokenSampler

if TYPE_CHECKING:
    from typing_extensions import Buffer

GROWTH = 256  # cells reserved beyond what an exchange holds, taken again as its reply grows


class Host(Protocol):
    """What a seat needs of the engine that gave it (``engine.Engine``)."""

    projector: Projector | None
    counters: Counters
    batcher: Batcher

    def hold(self) -> AbstractContextManager[None]: ...

    def share(
        self, lease: Lease, seq: int, prompt: Sequence[Item], can_cut: Callable[[int], bool]
    ) -> int: ...

    def apply(self, home: SharedContext, moves: list[Move]) -> None: ...


class Seat:
    """A session's sequence for one exchange."""

    def __init__(
        self,
        host: Host,
        lease: Lease,
        context: NativeContext,
        seq: int,
        cancelled: threading.Event,
        *,
        single_use: bool = False,
        decoder_start: int = -1,
    ) -> None:
        """``single_use``: ``context`` is the exchange's own, not a sequence of the shared one
        (an encoder-decoder model's, whose decoder begins with ``decoder_start``)."""
        self.host, self.lease, self.context, self.seq = host, lease, context, seq
        self.cancelled, self.single_use, self.decoder_start = cancelled, single_use, decoder_start
        self.decode_s = self.sample_s = 0.0  # inside llama_decode (and encode, images); sampling
        self.shared = 0  # positions the plan reused that another session had decoded
        self._granted = 0  # cells the ledger gave the sequence, as last read

    @property
    def items(self) -> tuple[Item, ...]:
        return self.lease.cache.items

    def prepare(self, items: Sequence[Item], can_cut: Callable[[int], bool], *, share: bool = True) -> Plan:
        """Make the sequence hold the longest reusable prefix of ``items`` (an empty one starts
        from another session's, with ``share``: ``Engine.share``)."""
        with self.host.hold():
            if share and not self.single_use:
                self.shared = self.host.share(self.lease, self.seq, items, can_cut)
            plan = self.lease.cache.prepare(items, SequenceMemory(self.context, self.seq), can_cut=can_cut)
            self.host.counters.reused_tokens += plan.reused
            return plan

    def decode(
        self,
        tokens: Sequence[int],
        pos: int,
        *,
        abortable: bool = False,
        sampler: TokenSampler | None = None,
        tracker: Tracker | None = None,
    ) -> int:
        """Decode ``tokens`` from ``pos`` and record them, through the model's one loop
        (``batching``: whole at once if nobody else steps, else in slices beside the streams'
        steps); with a sampler, sample the next token from their logits before anyone else
        decodes (-1 without). ``abortable``: a cancel stops it (DecodeAborted; what was decoded
        stays recorded). ``tracker``: a prompt fed in chunks (``Feeder``)."""
        step = Step(self, tokens, pos, sampler, tracker, prompt=True, cancellable=abortable)
        token = self.host.batcher.run(step)
        if step.taken < len(tokens):  # (stopped between two slices: the record holds what was decoded)
            raise DecodeAborted(clean=True)
        return token

    def feeder(self) -> Feeder:
        """How a prefill decodes its prompt's chunks (``Feeder``); close it after."""
        return Feeder(self)

    def step(
        self,
        tokens: Sequence[int],
        pos: int,
        sampler: TokenSampler,
        tracker: Tracker | None = None,
        drafts: Sequence[int] = (),
    ) -> tuple[list[int], int]:
        """A generation step: decode ``tokens`` (and any ``drafts`` after them) from ``pos`` and
        sample the next token, in one batch with the steps other streams of this model are
        waiting to take (``batching``): (the drafts kept, the token after them)."""
        step = Step(self, tokens, pos, sampler, tracker, drafts=drafts)
        token = self.host.batcher.run(step)
        return list(drafts[: step.accepted]), token

    # -- one decode step, lone or batched (the lock is held) -----------------------------------
    def make_room(self, n_tokens: int) -> None:
        """Cells for ``n_tokens`` more than the sequence holds (idle sessions parked if need be)."""
        cells = len(self.items) + n_tokens
        if self.single_use or cells <= self._granted:
            return
        home, key = self.lease.shared_context, self.lease.key
        self._granted = home.residency.entry(key).cells  # (the seat's session is busy: only it grows it)
        if cells <= self._granted:
            return
        moves = home.residency.grow(key, min(home.budget.kv_cells, cells + GROWTH))  # or BudgetError
        self.host.apply(home, moves)
        self._granted = home.residency.entry(key).cells

    def decoded(self, items: Sequence[Item], seconds: float) -> None:
        """Record what a decode of ``seconds`` put in the sequence."""
        self.lease.cache.extend(items)
        self.decode_s += seconds

    def rewind(self, pos: int) -> bool:
        """Drop what a refused batch may have left in the sequence from ``pos`` on: True once it
        holds just its record again (False where llama.cpp cannot cut there: a recurrent state)."""
        return self.context.seq_rm(pos, self.seq) and self.context.pos_max(self.seq) == pos - 1

    def drop_last(self, n_items: int) -> None:
        """Forget the last ``n_items`` the sequence holds (rejected drafts, or decoded past
        where a reply ended)."""
        with self.host.hold():
            memory = SequenceMemory(self.context, self.seq)
            self.lease.cache.cut(memory, len(self.items) - n_items)

    def sample_row(self, row: int, sampler: TokenSampler) -> int:
        """Sample from the logits at batch ``row`` of the last (batched) decode."""
        return self._sample(sampler, row)

    def _sample(self, sampler: TokenSampler, row: int = -1) -> int:
        """Sample from the logits at ``row`` of the last decode (-1: its last), timed."""
        began = time.perf_counter()
        token = sampler.sample(self.context, row)
        self.sample_s += time.perf_counter() - began
        return token

    def encode(self, tokens: Sequence[int]) -> None:
        """Run the encoder over the prompt (an encoder-decoder model's exchange starts here)."""

        def encode() -> None:
            began = time.perf_counter()
            self.context.encode(tokens, abortable=True)
            self.decode_s += time.perf_counter() - began

        self.host.batcher.run(Step(self, (), 0, None, prompt=True, cancellable=True, native=encode))

    def eval_image(
        self,
        chunk: ImageChunk,
        pos: int,
        items: Sequence[Item],
        *,
        sampler: TokenSampler | None,
        tracker: Tracker | None = None,
    ) -> tuple[int, int]:
        """Decode an image chunk (its ``items``) from ``pos`` (alone: its embeddings go in
        batches of their own); the next position, and the next token sampled if a sampler is
        given (-1 without). ``tracker``: the prompt's, fed in chunks (``Feeder``)."""
        projector = self.host.projector
        assert projector is not None
        after = [pos]

        def evaluate() -> None:
            began = time.perf_counter()
            after[0] = projector.eval_image(
                self.context, chunk, pos, seq=self.seq, logits_last=sampler is not None
            )
            self.decoded(items, time.perf_counter() - began)

        step = Step(self, items, pos, sampler, tracker, prompt=True, cancellable=True, native=evaluate)  # type: ignore[arg-type]
        token = self.host.batcher.run(step)
        return after[0], token

    def checkpoint_stops(self, end: int) -> list[int]:
        """Where a prefill up to position ``end`` should stop to take a checkpoint."""
        return self.lease.cache.checkpoint_stops(end)

    def checkpoint(self) -> None:
        """Keep a copy of the recurrent state after what the sequence holds now."""
        with self.host.hold():
            self.lease.cache.take_checkpoint(SequenceMemory(self.context, self.seq))

    def clear(self) -> None:
        """Empty the sequence (the prompt cannot reuse it, or it no longer matches its record)."""
        with self.host.hold():
            self.context.seq_rm(-1, self.seq)
            self.lease.cache.reset()

    def after_abort(self) -> None:
        """An aborted decode may leave part of its batch in memory: go back to the record (a
        recurrent state to its newest checkpoint), or to nothing."""
        with self.host.hold():
            self.lease.cache.recover(SequenceMemory(self.context, self.seq))

    def after_failure(self, error: BaseException) -> None:
        """After a failed step, make memory match the session's record again, and raise what
        the caller should see (else the caller raises ``error``)."""
        if isinstance(error, DecodeAborted | MemoryBudgetError):  # Ctrl-C; or no room, refused
            self.after_abort()  # (before any decode: a 503's retry decodes only what it must)
            if isinstance(error, DecodeAborted):
                raise (error.cause or NativeError("a decode was aborted")) from None
        elif not isinstance(error, GrammarError):  # (raised after a decode was recorded: memory matches)
            self.clear()  # the memory may not match the record any more


class Feeder:
    """A prompt's chunks into a seat's sequence (``Seat.decode``, abortable by the exchange's
    cancel): registered with the batcher as a stream once others step, so the decode thread
    takes its slices beside their steps as a step's budget allows (``batching``)."""

    def __init__(self, seat: Seat) -> None:
        self.seat = seat
        self.tracker: Tracker | None = None  # registered once a chunk went through the batcher
        self._registered = ExitStack()

    def __call__(self, tokens: Sequence[int], pos: int, sampler: TokenSampler | None) -> int:
        """Decode ``tokens`` from ``pos``: the token sampled after the last of them if a sampler
        is given, else -1 (DecodeAborted if cancelled meanwhile)."""
        seat, batcher = self.seat, self.seat.host.batcher
        if self.tracker is None and not batcher.alone(seat.context):
            self.tracker = self._registered.enter_context(batcher.generating(seat.context, prompt=True))
        return seat.decode(tokens, pos, abortable=True, sampler=sampler, tracker=self.tracker)

    def close(self) -> None:
        self._registered.close()


class SequenceMemory:
    """``prefix.Memory`` for one sequence of a shared context (never clears the others)."""

    def __init__(self, context: NativeContext, seq: int) -> None:
        self.context, self.seq = context, seq

    def seq_rm(self, p0: int) -> bool:
        return self.context.seq_rm(p0, self.seq)

    def clear(self) -> None:
        self.context.seq_rm(-1, self.seq)

    def pos_min(self) -> int:
        return self.context.pos_min(self.seq)

    def snapshot(self) -> Buffer:
        return self.context.state_get(self.seq, partial=True)

    def resume(self, blob: Buffer, position: int) -> bool:
        context, seq = self.context, self.seq
        if not context.state_set(blob, seq, partial=True):
            return False
        return context.seq_rm(position, seq) and context.pos_max(seq) == position - 1
