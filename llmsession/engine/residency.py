"""Where each session's KV state lives: in a sequence of the model's shared context, parked in
host RAM, or nowhere (cold: the transcript only, so the next exchange prefills from scratch).

All live sessions share one llama context: a live session holds one of its sequences and as many
KV cells as positions it keeps, of one pool, or of its sequence's own (``Budget.own_cells``). The
lowest free sequence goes first; with cells of their own, a session starting an exchange goes
where it joins the sequences in exchanges (``placement``: llama.cpp batches those together only
where their numbers follow each other). When an exchange needs a sequence or cells that are not free, the
least recently used idle session is evicted: parked (its sequence state copied to host RAM) when
its kind allows it and the host budget can hold it, dropping the oldest parked states to make
room, else dropped cold. A session in an exchange is never evicted.

Pure planning, like ``prefix.py``: ``Residency`` keeps the ledger and returns the steps; the
engine applies them to the native context in order.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Literal, NamedTuple

from llmsession.engine import placement
from llmsession.engine.budget import Budget, BudgetError

Key = Hashable


class State(Enum):
    LIVE = "live"
    PARKED = "parked"
    COLD = "cold"


class Move(NamedTuple):
    """One thing the engine must do, in order: ``park`` copies a live sequence's state to host
    RAM and frees the sequence; ``evict`` frees a live sequence whose state does not go to RAM
    (the engine writes it to its disk tier if it has one, else the session goes cold);
    ``release`` lets a parked state leave RAM (to the disk tier, else cold); ``restore`` loads a
    parked state into ``seq``; ``swap`` moves ``key``'s state from ``seq`` to ``to`` and, if
    ``other`` is given, ``other``'s from ``to`` to ``seq`` (``placement``)."""

    action: Literal["park", "evict", "release", "restore", "swap"]
    key: Key
    seq: int
    to: int = -1
    other: Key | None = None


@dataclass
class Entry:
    state: State = State.COLD
    seq: int = -1  # while live
    cells: int = 0  # while live
    parked_bytes: int = 0  # while parked
    busy: bool = False  # in an exchange: never evicted
    parkable: bool = True  # its state may be parked (not a sliding window past its window)
    stamp: int = 0  # last use, for LRU


class Residency:
    """The ledger of the sessions of one shared context (a model has one per memory layout),
    and the eviction policy."""

    def __init__(self, budget: Budget, park_bytes: Callable[[Key], int]) -> None:
        """``park_bytes(key)``: the size a live session's parked state would take."""
        self.budget = budget
        self._park_bytes = park_bytes
        self._entries: dict[Key, Entry] = {}
        self._free_seqs = list(range(budget.max_live))  # a heap: the lowest goes first
        self._clock = 0

    # -- views ---------------------------------------------------------------------------------
    def entry(self, key: Key) -> Entry:
        return self._entries[key]

    @property
    def live_cells(self) -> int:
        return sum(e.cells for e in self._entries.values() if e.state is State.LIVE)

    @property
    def parked_bytes(self) -> int:
        return sum(e.parked_bytes for e in self._entries.values() if e.state is State.PARKED)

    @property
    def live_count(self) -> int:
        return sum(e.state is State.LIVE for e in self._entries.values())

    def fits(self, key: Key, cells: int) -> bool:
        """Whether ``key`` (live, or cold) may hold ``cells`` cells without evicting anyone."""
        entry = self._entries[key]
        live = entry.state is State.LIVE
        if entry.state is State.PARKED or not (live or self._free_seqs):
            return False
        return cells <= self.room(key)

    def room(self, key: Key) -> int:
        """The cells ``key``'s sequence may hold without evicting anyone."""
        if self.budget.own_cells:
            return self.budget.kv_cells
        entry = self._entries[key]
        held = entry.cells if entry.state is State.LIVE else 0
        return self.budget.kv_cells - self.live_cells + held

    # -- changes -------------------------------------------------------------------------------
    def add(self, key: Key) -> None:
        if key in self._entries:
            raise KeyError(f"{key!r} is already known")
        self._entries[key] = Entry()

    def remove(self, key: Key) -> list[Move]:
        """Forget a session (closed or collected): free its sequence or parked state."""
        steps = self.cool(key)
        del self._entries[key]
        return steps

    def cool(self, key: Key) -> list[Move]:
        """Make a session cold (its state was lost or is no longer wanted)."""
        entry = self._entries[key]
        steps = []
        if entry.state is State.LIVE:
            steps.append(Move("evict", key, entry.seq))
            self._free(entry)
        elif entry.state is State.PARKED:
            steps.append(Move("release", key, -1))
        entry.state, entry.parked_bytes = State.COLD, 0
        return steps

    def lost(self, key: Key) -> None:
        """A session the ledger parked whose state never reached the lot (its park failed, or
        came after one that did): cold, its bytes no longer counted (they made others cold)."""
        entry = self._entries.get(key)
        if entry is not None and entry.state is State.PARKED:
            entry.state, entry.parked_bytes = State.COLD, 0

    def acquire(
        self, key: Key, cells: int, *, parkable: bool = True, touch: bool = True, place: bool = False
    ) -> list[Move]:
        """Make ``key`` live holding ``cells`` cells and mark it busy; the steps evict what must
        go and, for a parked session, restore it (last). Cold sessions come back empty.
        ``touch``: this counts as a use (background work does not make a session recent).
        ``place``: an exchange that generates, put where it joins the sequences in exchanges
        (``placement``), moving idle sessions if need be; else the lowest free sequence (or
        its own). All or nothing: a failure on the way (``park_bytes`` asks the native
        context) leaves the ledger as it was: the session not busy, no one evicted on paper."""
        with self._all_or_nothing(key):
            return self._acquire(key, cells, parkable=parkable, touch=touch, place=place)

    @contextmanager
    def _all_or_nothing(self, key: Key) -> Iterator[None]:
        """Put the ledger back as it was if the block fails (the same entries: callers may hold
        them; a cold one other than ``key``'s is never touched, so only the others are copied)."""
        touched = [
            (e, dataclasses.replace(e))
            for k, e in self._entries.items()
            if k == key or e.state is not State.COLD
        ]
        free, clock = list(self._free_seqs), self._clock
        try:
            yield
        except BaseException:
            for entry, was in touched:
                entry.__dict__.update(was.__dict__)
            self._free_seqs, self._clock = free, clock
            raise

    def _acquire(self, key: Key, cells: int, *, parkable: bool, touch: bool, place: bool) -> list[Move]:
        entry = self._entries[key]
        if cells > self.budget.kv_cells:
            raise BudgetError(f"{cells} cells exceed the shared context's {self.budget.kv_cells}")
        steps = self._make_room(key, cells)
        if touch:
            self._clock += 1
            entry.stamp = self._clock
        entry.busy, entry.parkable = True, parkable
        steps += self._place(key, entry, joining=place)
        if entry.state is not State.LIVE:
            if entry.state is State.PARKED:
                entry.parked_bytes = 0
                steps.append(Move("restore", key, entry.seq))
            entry.state = State.LIVE
        entry.cells = cells
        return steps

    def grow(self, key: Key, cells: int) -> list[Move]:
        """A busy live session needs ``cells`` cells now (prompt decoded, reply growing)."""
        entry = self._entries[key]
        if entry.state is not State.LIVE or not entry.busy:
            raise ValueError(f"{key!r} is not in an exchange")
        if cells > self.budget.kv_cells:
            raise BudgetError(f"{cells} cells exceed the shared context's {self.budget.kv_cells}")
        with self._all_or_nothing(key):
            steps = self._make_room(key, cells)
        entry.cells = cells
        return steps

    def release(self, key: Key, cells: int, *, parkable: bool = True) -> None:
        """The exchange is over: ``key`` holds ``cells`` cells and may be evicted again."""
        entry = self._entries[key]
        entry.busy, entry.parkable = False, parkable
        if entry.state is State.LIVE:
            entry.cells = cells

    # -- policy --------------------------------------------------------------------------------
    def _make_room(self, key: Key, cells: int) -> list[Move]:
        """Evict idle sessions, least recently used first, until ``key`` fits. Checked before
        anything changes, so a refusal leaves the ledger as it was."""
        entry = self._entries[key]
        held = entry.cells if entry.state is State.LIVE else 0
        needs_seq = entry.state is not State.LIVE
        others = [(e.stamp, k) for k, e in self._entries.items() if e.state is State.LIVE and k != key]
        busy = [k for _, k in others if self._entries[k].busy]
        busy_cells = 0 if self.budget.own_cells else sum(self._entries[k].cells for k in busy)
        if busy_cells + cells > self.budget.kv_cells or (needs_seq and len(busy) >= self.budget.max_live):
            raise BudgetError(
                f"sessions in an exchange hold {busy_cells} cells and {len(busy)} sequences: "
                f"{cells} more cells do not fit the budget ({self.budget})"
            )
        steps: list[Move] = []
        victims = sorted((v for v in others if not self._entries[v[1]].busy), key=lambda v: v[0])
        pool = self.budget.kv_cells if not self.budget.own_cells else None
        while (needs_seq and not self._free_seqs) or (pool and self.live_cells - held + cells > pool):
            steps += self._evict(victims.pop(0)[1], key)
        return steps

    def _place(self, key: Key, entry: Entry, *, joining: bool) -> list[Move]:
        """Give ``key`` (now busy) its sequence: ``joining``, where it joins the sequences in
        exchanges, where each has cells of its own (``placement``); else the lowest free one
        (or its own)."""
        live = entry.state is State.LIVE
        if not (joining and self.budget.own_cells) or (live and not entry.parkable):
            if not live:
                entry.seq = heapq.heappop(self._free_seqs)
            return []
        others = [(k, e) for k, e in self._entries.items() if k != key and e.state is State.LIVE]
        busy = {e.seq for _, e in others if e.busy}
        idle = {e.seq: k for k, e in others if not e.busy and e.parkable}
        current = entry.seq if live else None
        place = placement.choose(
            current, self._free_seqs, idle, busy, lambda k: self._park_bytes(key if k is None else k)
        )
        steps = []
        if place.evicts is not None:  # trade places with an idle session (or send it to a free one)
            other = self._entries[place.evicts]
            other.seq = entry.seq if live else heapq.heappop(self._free_seqs)
            steps.append(
                Move("swap", key, entry.seq, place.seq, place.evicts)
                if live
                else Move("swap", place.evicts, place.seq, other.seq)
            )
        elif place.seq != current:
            self._free_seqs.remove(place.seq)
            heapq.heapify(self._free_seqs)
            if live:
                steps.append(Move("swap", key, entry.seq, place.seq))
                heapq.heappush(self._free_seqs, entry.seq)
        entry.seq = place.seq
        return steps

    def _evict(self, key: Key, requester: Key) -> list[Move]:
        """Park ``key`` (dropping the oldest parked states to make room, never the requester's,
        which is about to be restored), or drop it cold when it may not or cannot be parked."""
        entry = self._entries[key]
        mine = self._entries[requester]
        restoring = mine.parked_bytes if mine.state is State.PARKED else 0
        size = self._park_bytes(key) if entry.parkable else self.budget.host_bytes + 1
        if size > self.budget.host_bytes - restoring:
            steps = [Move("evict", key, entry.seq)]
            self._free(entry)
            entry.state = State.COLD
            return steps
        steps = []
        while self.parked_bytes - restoring + size > self.budget.host_bytes:
            parked = [
                (e.stamp, k) for k, e in self._entries.items() if e.state is State.PARKED and k != requester
            ]
            steps += self.cool(min(parked, key=lambda v: v[0])[1])
        steps.append(Move("park", key, entry.seq))
        self._free(entry)
        entry.state, entry.parked_bytes = State.PARKED, size
        return steps

    def _free(self, entry: Entry) -> None:
        heapq.heappush(self._free_seqs, entry.seq)
        entry.seq, entry.cells = -1, 0
