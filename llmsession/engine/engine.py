"""The engine: a model's shared llama contexts, and where every session's KV state lives.

A live session holds one sequence of a shared context: cells of its own (llama.cpp's
per-sequence streams, ``kv_layout="per_session"``), or as many as it keeps of one pool
(``kv_unified``, "shared"). When an exchange needs a sequence or cells that are not free,
``Residency`` (pure) picks idle sessions to park (their state copied to host RAM by
``llama_state_seq_get_data``; past the RAM budget to disk, or forgotten) or drop cold, and the
engine applies its steps. A session's record (its
``PrefixCache``) follows its state: a restore must give back exactly that many positions, else
the session goes cold. One lock per engine serializes every native call on the shared contexts,
and a decode and the sampling of its logits happen under one hold.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import TYPE_CHECKING

from llmsession.engine import sharing
from llmsession.engine.batching import Batcher
from llmsession.engine.budget import (
    Budget,
    Counters,
    MemoryPlan,
    MemoryReport,
    SessionMemory,
    own_cells,
    uses_own_cells,
)
from llmsession.engine.drafting import MAX_DRAFT
from llmsession.engine.lease import Lease, SharedContext
from llmsession.engine.moves import Mover
from llmsession.engine.parking import ParkingLot
from llmsession.engine.prefix import Item
from llmsession.engine.residency import State
from llmsession.engine.seat import Seat
from llmsession.engine.work import Gate
from llmsession.errors import MemoryBudgetError, ModelClosedError
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel
from llmsession.native.projector import Projector

if TYPE_CHECKING:
    import threading as _threading

    from typing_extensions import Buffer

log = logging.getLogger("llmsession")


class Engine:
    """Owns a model's shared contexts and parked states; sessions reach memory only through it."""

    def __init__(
        self,
        native: NativeModel,
        projector: Projector | None,
        threads: int,
        config: MemoryPlan,
        make_context: Callable[..., NativeContext] | None = None,
        flash_attention: bool | None = None,
        kv_type: str = "f16",
    ) -> None:
        """``make_context``: how a shared context is made (tests pass a fake that keeps llama.cpp's
        semantics); by default a ``NativeContext`` of ``native`` with cells of ``kv_type``."""
        self.native, self.projector, self.threads, self.config = native, projector, threads, config
        self.flash_attention = flash_attention
        self.make_context = make_context or functools.partial(
            NativeContext, native, kv_type=kv_type, outputs_per_seq=1 + MAX_DRAFT
        )
        self.gate = Gate()  # the lock, and who waits for it
        self.hold = self.gate.hold  # every taker counts as waiting: background work gives way to it
        self.batcher = Batcher(self.gate)  # its decode thread holds the gate, not the engine
        weakref.finalize(self, self.batcher.close)
        self.lot = ParkingLot(config.disk_cache_dir)
        self.counters = Counters()
        self.moves = Mover(self.lot, self.counters)  # carries out the ledger's steps
        self.apply = self.moves.apply  # (home, steps)
        self._shared_contexts: dict[bool, SharedContext] = {}  # by swa_full: one a layout
        self._single_use: set[NativeContext] = set()  # an encoder-decoder's exchanges' own contexts
        self._keys = itertools.count()
        self._dead: list[Lease] = []  # leases of collected sessions, freed at the next safe point
        self._closed = False

    def lease(self, *, swa_full: bool, batch_size: int, shares: bool = True) -> Lease:
        """A new session's place. Sessions share one context per layout, made with the model's
        batch size; a session's own ``batch_size`` (at most that) only cuts its prompts. The small
        sliding-window cache (``swa_full=False``, a memory saver) holds the window plus one batch
        per sequence: its sessions take turns in a context of their own, one live at a time (a
        unified one let a deep rewind's logits drift past the split-noise tolerance), freed with
        the last of them (``release``)."""
        if not 0 < batch_size <= self.config.batch_size:
            raise ValueError(f"batch_size {batch_size}: 1 to the model's {self.config.batch_size}")
        n_swa = max(0, self.native.n_swa)
        swa_full = swa_full or n_swa == 0  # one layout when there is no window
        with self.hold():
            self._reap()  # (sessions made and dropped before a seat would pile up otherwise)
            home = self._shared_context(swa_full)
            recurrent = self.config.checkpoints if self.native.is_recurrent else None
            # (a pool of several: a decode takes another's out-of-window cells, and llama.cpp
            # drops those positions from the window layers, swa_full or not: the window test holds)
            window = 0 if swa_full and (home.budget.own_cells or home.budget.max_live == 1) else n_swa
            lease = Lease(home, next(self._keys), n_swa, window, checkpoints=recurrent, shares=shares)
            home.leases[lease.key] = lease
            home.residency.add(lease.key)
            return lease

    @property
    def contended(self) -> bool:
        """Whether a thread waits for the lock (background work gives way to it)."""
        return self.gate.contended

    def _shared_context(self, swa_full: bool) -> SharedContext:
        """The layout's shared context, made with the model's batch size whatever its sessions'
        (keyed by a session's, every ``context_size`` under 512 made another context of
        ``kv_tokens`` cells, kept until the model closed)."""
        if self._closed:  # (no context is made for a model closing: it is freed next)
            raise ModelClosedError("the model is closed")
        if swa_full not in self._shared_contexts:
            live = self.config.max_live_sessions if swa_full else 1
            c = self.config
            own, cells = self.own_cells(swa_full), self.session_cells(swa_full)
            make = functools.partial(
                self.make_context,
                n_ctx=cells * live if own else cells,
                n_batch=c.batch_size,
                threads=self.threads,
                swa_full=swa_full,
                n_seq_max=live,
                flash_attention=self.flash_attention,
                own_cells=own,
            )
            budget = Budget(cells, max_live=live, host_bytes=c.host_cache_bytes, own_cells=own)
            home = SharedContext(make, budget, swa_full=swa_full, n_batch=c.batch_size)
            self._shared_contexts[swa_full] = home
        return self._shared_contexts[swa_full]

    def own_cells(self, swa_full: bool) -> bool:
        """Whether live sessions of this layout have cells of their own (``uses_own_cells``; a
        model without a sliding window has only the full layout)."""
        native, full = self.native, swa_full or self.native.n_swa <= 0
        return uses_own_cells(
            self.config, full=full, recurrent=native.is_recurrent, encoder=native.has_encoder
        )

    def streams(self, swa_full: bool) -> int:
        """How many sequences have cells of their own (a saved state names it; 1: one pool)."""
        return self.config.max_live_sessions if self.own_cells(swa_full) else 1

    def session_cells(self, swa_full: bool) -> int:
        """The most positions one session may hold live."""
        c = self.config
        live = c.max_live_sessions
        return own_cells(c.kv_tokens, live) if self.own_cells(swa_full) else c.kv_tokens

    def warm(self) -> threading.Thread | None:
        """Make the default layout's shared context now, in the background, so that no exchange
        waits for it (65-145 ms, most of a first turn's time); an exchange that comes first waits
        for it under the lock. A failure here is left for that exchange to raise."""
        if self.native.has_encoder:
            return None  # its exchanges take contexts of their own
        with self.hold():
            home = self._shared_context(True)

        def make() -> None:
            with self.hold():
                if not self._closed:
                    try:
                        home.context  # noqa: B018  (made on first use)
                    except Exception as error:
                        log.debug("warming the shared context failed: %s", error)

        # Not a daemon: the interpreter's exit joins it before ``weakref.finalize``'s exit hook
        # frees the model, which under a context still being made crashed the process.
        thread = threading.Thread(target=make, name="llmsession-warm")
        thread.start()
        return thread

    def bury(self, lease: Lease) -> None:
        """Its session was collected: free its memory at the next safe point (this may run in a
        garbage collection, in any thread, even while the lock is held)."""
        self._dead.append(lease)

    def discard(self, lease: Lease) -> None:
        """Forget a session's state wherever it is: the session goes cold."""
        with self.hold():
            self.moves.free(lease, lease.shared_context.residency.cool(lease.key))
            lease.cache.reset()

    def release(self, lease: Lease) -> None:
        """Its session was closed: forget it and its state at once (as ``bury``, later)."""
        with self.hold():
            if not self._closed:
                self._forget(lease)
            lease.cache.reset()

    @contextmanager
    def seat(
        self,
        lease: Lease,
        cells: int,
        cancelled: _threading.Event,
        *,
        exchange: bool = True,
        joins: bool = False,
    ) -> Iterator[Seat]:
        """A sequence holding ``lease``'s state (restored if parked) with room for ``cells``
        cells, for one exchange; the session is busy (never evicted) until the block ends. Not
        for an exchange (background work): only a session that is not parked and fits without
        evicting anyone, else ``MemoryBudgetError``; it is neither counted nor made recent.
        ``joins``: an exchange that generates, placed beside the others in exchanges
        (``placement``; saving, loading and forking a state move nobody)."""
        home, busy = lease.shared_context, False
        try:  # (from the ledger's yes on, on every path: not left busy, never evicted again)
            with self.hold():
                if self._closed:
                    raise ModelClosedError("the model is closed")
                self._reap()
                if cells > home.budget.kv_cells:
                    most = home.budget.kv_cells
                    raise MemoryBudgetError(f"{cells} positions exceed a live session's {most} cells")
                if not exchange and not home.residency.fits(lease.key, cells):
                    raise MemoryBudgetError("background work evicts no one")
                # (a BudgetError is the MemoryBudgetError callers see)
                steps = home.residency.acquire(
                    lease.key, cells, parkable=lease.parkable, touch=exchange, place=joins
                )
                busy = True  # (nothing between the ledger's answer and here takes an interrupt)
                try:
                    self.apply(home, steps)
                    seq = home.residency.entry(lease.key).seq
                    if not any(s.action == "restore" and s.key == lease.key for s in steps):
                        self.moves.settle(home, lease, seq)
                    self.counters.exchanges += exchange
                    seat = Seat(self, lease, home.context, seq, cancelled)
                except BaseException:  # (given back under the hold: no other call sees it busy)
                    home.residency.release(lease.key, len(lease.cache.items), parkable=lease.parkable)
                    busy = False
                    raise
            yield seat
        finally:
            if busy:
                with self.hold():
                    home.residency.release(lease.key, len(lease.cache.items), parkable=lease.parkable)

    @contextmanager
    def single_use(self, lease: Lease, n_ctx: int, cancelled: _threading.Event) -> Iterator[Seat]:
        """A context of its own for one exchange of an encoder-decoder model: its decoder state
        depends on the whole encoded prompt, so there is no prefix to keep (as upstream does)."""
        with self.hold():
            if self._closed:  # (as ``_shared_context``: nothing made for a model being freed)
                raise ModelClosedError("the model is closed")
            self._reap()
            self.counters.exchanges += 1
            context = self.make_context(
                n_ctx=n_ctx, n_batch=n_ctx, threads=self.threads, flash_attention=self.flash_attention
            )
            self._single_use.add(context)
        lease.cache.reset()
        try:
            yield Seat(
                self, lease, context, 0, cancelled, single_use=True, decoder_start=self.native.decoder_start
            )
        finally:
            with self.hold():
                self._single_use.discard(context)
                context.close()
                lease.cache.reset()

    def share(self, lease: Lease, seq: int, prompt: Sequence[Item], can_cut: Callable[[int], bool]) -> int:
        """Start an empty session from the longest prefix of ``prompt`` another session holds,
        live or parked (``sharing``); how many positions it gave (the caller holds the lock)."""
        if lease.cache.items or not lease.shares or self.native.is_recurrent:
            return 0
        parked = sharing.Parked(self.lot.holds, self.parked_state, self.native.n_swa)
        return sharing.share(lease, seq, prompt, can_cut, parked)

    def parked_state(self, lease: Lease) -> Buffer | None:
        """A parked session's state, left parked."""
        return self.lot.peek(lease.key)

    def state(self, lease: Lease) -> Buffer | None:
        """A copy of the session's state (for saving): parked, as it is; live, from its sequence."""
        with self.hold():
            if not lease.cache.items:
                return None
            live = lease.shared_context.residency.entry(lease.key).state is State.LIVE
            if not live and self.lot.holds(lease.key):
                return self.lot.peek(lease.key)
            with self.seat(lease, len(lease.cache.items), threading.Event()) as seat:
                return seat.context.state_get(seat.seq) if lease.cache.items else None

    def most_state_bytes(self) -> int | None:
        """The most bytes one session's state may have here (``stateblob.most_bytes``)."""
        with self.hold():  # (the default layout's context: its cells hold the most)
            return self._shared_context(True).context.most_state_bytes

    def adopt(self, lease: Lease, blob: Buffer, record: Sequence[Item], *, foreign: bool = True) -> bool:
        """Load a saved state (a file's: ``foreign``, its cells no other session's prefix) into a cold
        session; False (still cold) if refused (values not finite among them) or not of ``record``."""
        lease.cache.foreign |= foreign  # (before its cells are there to be taken: ``sharing``)
        with self.hold(), self.seat(lease, len(record), threading.Event()) as seat:
            context = seat.context
            if (
                context.state_set(blob, seat.seq, values=foreign)
                and context.pos_max(seat.seq) == len(record) - 1
            ):
                lease.cache.extend(record)
                return True
            context.seq_rm(-1, seat.seq)
            lease.cache.foreign = False
            return False

    def fork(self, source: Lease, target: Lease) -> None:
        """Give a cold ``target`` what ``source`` holds: the same cells (``seq_cp``) when both
        fit at once, else a copy of the state; cold when the state cannot be copied exactly."""
        target.cache.foreign = source.cache.foreign  # (a file's cells stay its own: ``adopt``)
        if not source.cache.items or not source.parkable:
            return
        record = source.cache.items
        with self.hold(), self.seat(source, len(record), threading.Event()) as mine:
            if not source.cache.items:
                return
            try:
                with self.seat(target, len(record), threading.Event()) as theirs:
                    if not mine.context.seq_cp(mine.seq, theirs.seq):
                        return  # (a copied state llama.cpp refused: it stays cold)
                    target.cache.extend(record)
                    target.cache.share_checkpoints(source.cache)
                    return
            except MemoryBudgetError:
                blob = mine.context.state_get(mine.seq)
        if self.adopt(target, blob, record, foreign=False):
            target.cache.share_checkpoints(source.cache)

    def memory(self) -> MemoryReport:
        with self.hold():
            self._reap()
            sessions, live, parked, checkpoints = [], 0, 0, 0
            for home in self._shared_contexts.values():
                for key, lease in home.leases.items():
                    entry = home.residency.entry(key)
                    where = self.lot.holds(key) if entry.state is not State.LIVE else "live"
                    state = {"host": "parked", "disk": "disk", "": "cold", "live": "live"}[where]
                    held = len(lease.cache.items) if state != "cold" else 0
                    sessions.append(SessionMemory(key, state, held, self.lot.size(key)))
                    checkpoints += lease.cache.checkpoint_bytes
                live += home.residency.live_count
                parked += home.residency.parked_bytes
            c = self.config
            return MemoryReport(
                kv_tokens=c.kv_tokens,
                live_tokens=sum(s.tokens for s in sessions if s.state == "live"),
                max_live_sessions=c.max_live_sessions,
                live_sessions=live,
                host_cache_bytes=c.host_cache_bytes,
                parked_bytes=parked,
                disk_entries=self.lot.disk_entries,
                disk_bytes=self.lot.disk_bytes,
                checkpoint_bytes=checkpoints,
                sessions=sessions,
                kv_layout="per_session" if self.own_cells(True) else "shared",
                session_cells=self.session_cells(True),
                counters=Counters(**{f.name: getattr(self.counters, f.name) for f in fields(Counters)}),
            )

    def close(self) -> None:
        self.batcher.close()
        with self.hold():
            self._closed = True
            for home in self._shared_contexts.values():
                home.close()
            for context in self._single_use:  # (under the gate: an exchange may be decoding in it)
                context.close()
            self.lot.close()

    # -- the ledger's steps (``moves``: ``apply``) ---------------------------------------------
    def _reap(self) -> None:
        while self._dead:
            self._forget(self._dead.pop())

    def _forget(self, lease: Lease) -> None:
        """A session that went (closed or collected) no longer counts; the small sliding-window
        layout's context goes with its last session (made again for the next), so that what it
        holds is held only while a session may use it. The default layout's stays (warm)."""
        home = lease.shared_context
        if lease.key not in home.leases:
            return
        self.moves.free(lease, home.residency.remove(lease.key))
        del home.leases[lease.key]
        if not home.leases and not home.swa_full and self._shared_contexts.get(False) is home:
            del self._shared_contexts[False]
            home.close()
