"""Residency: a hypothesis state machine over a fake shared context that applies every step the
way llama.cpp would (sequences, cells, parked blobs), checking the budget and that every session's
state is exactly what it last held, or cold."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmsession.engine.budget import Budget, BudgetError
from llmsession.engine.placement import MAX_MOVE_BYTES, Placement, choose, joins
from llmsession.engine.residency import Move, Residency, State

BYTES_PER_CELL = 10


class FakeContext:
    """Sequences of a unified KV cache: what each holds, and parked blobs in host RAM."""

    def __init__(self, n_seq: int, n_cells: int, own_cells: bool = False) -> None:
        self.seqs: dict[int, list[str]] = {i: [] for i in range(n_seq)}
        self.n_cells, self.own_cells = n_cells, own_cells
        self.parked: dict[object, list[str]] = {}

    def apply(self, step: Move) -> None:
        if step.action == "park":
            assert step.key not in self.parked
            self.parked[step.key] = list(self.seqs[step.seq])
            self.seqs[step.seq] = []
        elif step.action == "evict":
            self.seqs[step.seq] = []
        elif step.action == "release":
            del self.parked[step.key]
        elif step.action == "swap":  # a live state moves; another (if named) takes its place
            assert step.other is not None or self.seqs[step.to] == [], "moved onto a sequence's cells"
            moved, there = self.seqs[step.seq], self.seqs[step.to]
            self.seqs[step.to], self.seqs[step.seq] = moved, there if step.other is not None else []
        else:  # restore into a free sequence
            assert self.seqs[step.seq] == [], "restored into a sequence that holds cells"
            self.seqs[step.seq] = self.parked.pop(step.key)
        if self.own_cells:
            assert all(len(s) <= self.n_cells for s in self.seqs.values())
        else:
            assert sum(len(s) for s in self.seqs.values()) <= self.n_cells


class ResidencyMachine(RuleBasedStateMachine):
    @initialize(
        cells=st.integers(8, 64),
        live=st.integers(1, 5),
        host=st.integers(0, 400),
        unparkable=st.sets(st.integers(0, 7)),
        own=st.booleans(),
    )
    def setup(self, cells: int, live: int, host: int, unparkable: set[int], own: bool) -> None:
        self.budget = Budget(kv_cells=cells, max_live=live, host_bytes=host, own_cells=own)
        self.held: dict[int, list[str]] = {}  # what each session's memory should hold (its record)
        self.residency = Residency(self.budget, park_bytes=lambda key: BYTES_PER_CELL * len(self.held[key]))
        self.context = FakeContext(live, cells, own)
        self.busy: dict[int, int] = {}  # sessions in an exchange that goes on: their sequences
        self.unparkable = unparkable
        self.turn = 0
        for key in range(8):
            self.residency.add(key)
            self.held[key] = []

    def where(self, key: int) -> list[str] | None:
        entry = self.residency.entry(key)
        if entry.state is State.LIVE:
            return self.context.seqs[entry.seq]
        if entry.state is State.PARKED:
            return self.context.parked[key]
        return None

    @rule(key=st.integers(0, 7), grow=st.integers(1, 12), reply=st.integers(0, 6), fail=st.booleans())
    def exchange(self, key: int, grow: int, reply: int, fail: bool) -> None:
        """Acquire, decode `grow` prompt items, then `reply` tokens one by one, then release."""
        if key in self.busy:
            return
        self.turn += 1
        parkable = key not in self.unparkable
        state = self.residency.entry(key).state
        kept = self.held[key] if state is not State.COLD else []
        target = len(kept) + grow
        try:
            steps = self.residency.acquire(key, target, parkable=parkable, place=True)
        except BudgetError:
            assert target > self.budget.kv_cells or self.busy
            self.residency.release(key, len(self.where(key) or []), parkable=parkable)
            return
        self.carry_out(steps)
        assert {k: self.residency.entry(k).seq for k in self.busy} == self.busy, "a busy session moved"
        seq = self.residency.entry(key).seq
        memory = self.context.seqs[seq]
        assert memory == kept, "a live, restored or cold sequence does not hold what it should"
        self.held[key] = memory
        memory += [f"{key}:{self.turn}:{i}" for i in range(grow)]
        for i in range(reply):
            if len(memory) + 1 > self.budget.kv_cells:
                break
            try:
                steps = self.residency.grow(key, len(memory) + 1)
            except BudgetError:  # the pool's other cells are in exchanges
                assert self.busy and not self.budget.own_cells
                break
            for step in steps:
                self.context.apply(step)
            memory.append(f"{key}:{self.turn}:r{i}")
        if fail:  # an error mid-exchange: the engine cools the session
            for step in self.residency.cool(key):
                self.context.apply(step)
            self.held[key] = []
        self.residency.release(key, len(memory) if not fail else 0, parkable=parkable)

    @precondition(lambda self: hasattr(self, "residency"))
    @rule(key=st.integers(0, 7), grow=st.integers(1, 12))
    def background(self, key: int, grow: int) -> None:
        """Background work (an anticipatory prefill) takes a session only where it fits as it is:
        then it evicts and restores nothing, and makes no session more recent."""
        if key in self.busy:
            return
        parkable = key not in self.unparkable
        kept = self.held[key] if self.residency.entry(key).state is State.LIVE else []
        if not self.residency.fits(key, len(kept) + grow):
            return
        stamps = {k: self.residency.entry(k).stamp for k in list(self.residency._entries)}
        assert self.residency.acquire(key, len(kept) + grow, parkable=parkable, touch=False) == []
        assert {k: self.residency.entry(k).stamp for k in list(self.residency._entries)} == stamps
        memory = self.context.seqs[self.residency.entry(key).seq]
        assert memory == kept
        self.held[key] = memory
        memory += [f"{key}:ahead:{i}" for i in range(grow)]
        self.residency.release(key, len(memory), parkable=parkable)

    @precondition(lambda self: hasattr(self, "residency"))
    @rule(key=st.integers(0, 7), grow=st.integers(1, 12))
    def begin(self, key: int, grow: int) -> None:
        """An exchange that goes on while others run: it is placed beside them where it can be,
        and nobody in an exchange moves."""
        if key in self.busy:
            return
        parkable = key not in self.unparkable
        entry = self.residency.entry(key)
        kept = self.held[key] if entry.state is not State.COLD else []
        was = entry.seq if entry.state is State.LIVE else None
        try:
            steps = self.residency.acquire(key, len(kept) + grow, parkable=parkable, place=True)
        except BudgetError:
            assert len(kept) + grow > self.budget.kv_cells or self.busy
            self.residency.release(key, len(self.where(key) or []), parkable=parkable)
            return
        self.carry_out(steps)
        assert {k: self.residency.entry(k).seq for k in self.busy} == self.busy, "a busy session moved"
        seq = self.residency.entry(key).seq
        if self.budget.own_cells and self.busy and (was is None or parkable):
            busy, fixed = set(self.busy.values()), self.fixed(key)
            best = max(joins(s, busy) for s in range(self.budget.max_live) if s not in busy | fixed)
            assert joins(seq, busy) == best, "placed where it joins fewer runs than it could"
        elif was is not None:
            assert seq == was
        memory = self.context.seqs[seq]
        assert memory == kept
        self.held[key] = memory
        memory += [f"{key}:begun:{i}" for i in range(grow)]
        self.busy[key] = seq

    def carry_out(self, steps: list[Move]) -> None:
        for step in steps:
            if step.action == "swap":  # a state past its sliding window restores wrong: never copied
                assert step.key not in self.unparkable and step.other not in self.unparkable, step
            self.context.apply(step)

    def fixed(self, key: int) -> set[int]:
        """The sequences of idle live sessions that may not move (their states may not be copied)."""
        r = self.residency
        live = [r.entry(k) for k in list(r._entries) if k != key and r.entry(k).state is State.LIVE]
        return {e.seq for e in live if not e.busy and not e.parkable}

    @precondition(lambda self: hasattr(self, "residency"))
    @rule(key=st.integers(0, 7))
    def finish(self, key: int) -> None:
        if key in self.busy:
            del self.busy[key]
            self.residency.release(key, len(self.held[key]), parkable=key not in self.unparkable)

    @precondition(lambda self: hasattr(self, "residency"))
    @rule(key=st.integers(0, 7))
    def cool(self, key: int) -> None:
        for step in self.residency.cool(key):
            self.context.apply(step)
        self.held[key] = []
        if self.busy.pop(key, None) is not None:  # an error mid-exchange
            self.residency.release(key, 0, parkable=key not in self.unparkable)

    @invariant()
    def within_budget(self) -> None:
        if not hasattr(self, "residency"):
            return
        r = self.residency
        assert r.live_count <= self.budget.max_live
        if self.budget.own_cells:
            assert all(r.entry(k).cells <= self.budget.kv_cells for k in list(r._entries))
        else:
            assert r.live_cells <= self.budget.kv_cells
        assert r.parked_bytes <= self.budget.host_bytes
        seqs = [r.entry(k).seq for k in list(r._entries) if r.entry(k).state is State.LIVE]
        assert len(set(seqs)) == len(seqs)

    @invariant()
    def memory_matches_every_record(self) -> None:
        if not hasattr(self, "residency"):
            return
        for key in list(self.residency._entries):
            entry = self.residency.entry(key)
            held = self.where(key)
            if entry.state is State.LIVE:
                assert held == self.held[key] and entry.cells == len(held)
            elif entry.state is State.PARKED:
                assert key not in self.unparkable, "a session whose kind forbids it was parked"
                assert held == self.held[key]
        owned = {
            self.residency.entry(k).seq
            for k in list(self.residency._entries)
            if self.residency.entry(k).state is State.LIVE
        }
        for seq, cells in self.context.seqs.items():
            assert seq in owned or cells == [], f"sequence {seq} holds cells nobody owns"


ResidencyMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestResidency = ResidencyMachine.TestCase


def test_a_busy_session_is_never_evicted() -> None:
    residency = Residency(Budget(kv_cells=10, max_live=2, host_bytes=1000), park_bytes=lambda key: 10)
    for key in "ab":
        residency.add(key)
    residency.acquire("a", 6)
    with pytest.raises(BudgetError):
        residency.acquire("b", 6)
    residency.release("a", 6)
    steps = residency.acquire("b", 6)
    assert steps == [Move("park", "a", residency.entry("b").seq)] or steps[0].action == "park"
    assert residency.entry("a").state is State.PARKED


def test_parked_states_past_the_host_budget_go_cold_oldest_first() -> None:
    residency = Residency(Budget(kv_cells=4, max_live=1, host_bytes=25), park_bytes=lambda key: 10)
    for key in "abcd":
        residency.add(key)
        residency.acquire(key, 4)
        residency.release(key, 4)
    states = {key: residency.entry(key).state for key in "abcd"}
    assert states == {"a": State.COLD, "b": State.PARKED, "c": State.PARKED, "d": State.LIVE}


def test_a_session_joining_exchanges_takes_the_free_sequence_between_them() -> None:
    size = {"me": 100, "x": 100}.get
    assert choose(3, free=[1, 5], idle={}, busy=[0, 2], size=lambda k: size(k or "me")) == Placement(
        1, None, 100
    )
    assert choose(None, free=[1, 5], idle={}, busy=[4], size=lambda k: 0) == Placement(5)
    assert choose(None, free=[1, 5], idle={}, busy=[], size=lambda k: 0) == Placement(1), "alone: the lowest"


def test_a_session_trades_places_with_an_idle_one_only_where_it_joins_more_runs() -> None:
    def size(key: object | None) -> int:
        return {None: 300, "b": 200, "c": 10}[key]

    # a and c are in exchanges in 0 and 2; b idles in 1; the session is in 3, beside c already
    assert choose(3, free=[], idle={1: "b"}, busy=[0, 2], size=size) == Placement(1, "b", 500)
    assert choose(1, free=[3], idle={}, busy=[0, 2], size=size) == Placement(1), "it joins both already"
    assert choose(3, free=[], idle={}, busy=[2], size=size) == Placement(3), "nothing better: it stays"
    # a session with no sequence yet sends the idle one to the free sequence
    assert choose(None, free=[5], idle={1: "c"}, busy=[0, 2], size=size) == Placement(1, "c", 10)


def test_a_move_copies_at_most_its_bound() -> None:
    big = MAX_MOVE_BYTES + 1
    assert choose(3, free=[1], idle={}, busy=[0, 2], size=lambda k: big) == Placement(3)
    assert choose(None, free=[5], idle={1: "b"}, busy=[0, 2], size=lambda k: big) == Placement(5)


def test_residency_moves_a_live_session_next_to_those_in_exchanges() -> None:
    residency = Residency(
        Budget(kv_cells=16, max_live=4, host_bytes=1000, own_cells=True), park_bytes=lambda k: 40
    )
    for key in "abcd":
        residency.add(key)
        residency.acquire(key, 4)
    for key in "abcd":  # a, b, c, d live in 0, 1, 2, 3
        residency.release(key, 4)
    assert residency.acquire("a", 5, place=True) == [], "alone, it stays"
    assert residency.acquire("c", 5, place=True) == [Move("swap", "c", 2, 1, "b")]
    assert residency.acquire("d", 5, place=True) == [Move("swap", "d", 3, 2, "b")]
    assert [residency.entry(k).seq for k in "abcd"] == [0, 3, 1, 2]
    residency.release("a", 5)
    assert residency.acquire("b", 5, place=True) == [], "in 3, it is beside d in 2 already"


def four_in_order(unparkable: str = "") -> Residency:
    """Sessions a, b, c, d live in sequences 0 to 3 of a budget with cells of their own, idle."""
    residency = Residency(
        Budget(kv_cells=16, max_live=4, host_bytes=1000, own_cells=True), park_bytes=lambda k: 40
    )
    for key in "abcd":
        residency.add(key)
        residency.acquire(key, 4)
    for key in "abcd":
        residency.release(key, 4, parkable=key not in unparkable)
    return residency


def test_a_state_past_its_window_is_never_moved_nor_moves_another() -> None:
    residency = four_in_order(unparkable="b")
    residency.acquire("a", 5, place=True)
    assert residency.acquire("c", 5, place=True) == [], "b in 1 may not give up its sequence"
    residency = four_in_order()
    residency.acquire("a", 5, place=True)
    assert residency.acquire("c", 5, parkable=False, place=True) == [], "c may not be copied"
    assert residency.entry("c").seq == 2


def test_only_an_exchange_that_generates_moves_anyone() -> None:
    residency = four_in_order()
    residency.acquire("a", 5, place=True)
    assert residency.acquire("c", 5) == [], "a save, a load or a fork reads its state where it is"
    residency.release("c", 5)
    assert residency.acquire("c", 5, touch=False) == [], "nor does background work"


def test_shared_cells_never_move_a_session() -> None:
    residency = Residency(Budget(kv_cells=64, max_live=4, host_bytes=1000), park_bytes=lambda k: 40)
    for key in "abcd":
        residency.add(key)
        residency.acquire(key, 4)
    for key in "abcd":
        residency.release(key, 4)
    residency.acquire("a", 5, place=True)
    residency.acquire("c", 5, place=True)
    assert residency.acquire("d", 5, place=True) == []
    assert residency.entry("d").seq == 3


def ledger(residency: Residency, keys: str) -> list[tuple[object, ...]]:
    return [
        (k, e.state, e.seq, e.cells, e.busy, e.stamp, e.parked_bytes)
        for k in keys
        for e in [residency.entry(k)]
    ]


def test_a_failing_size_leaves_the_ledger_as_it_was() -> None:
    """``park_bytes`` asks the native context: when it fails halfway through evicting or moving
    sessions, nothing is left busy, evicted or moved on paper; the next try runs as if first."""
    failing = {"b"}

    def size(key: object) -> int:
        if key in failing:
            raise RuntimeError("the context could not size a state")
        return 40

    residency = Residency(Budget(kv_cells=16, max_live=3, host_bytes=1000), park_bytes=size)
    for key in "abc":
        residency.add(key)
    for key in "ab":
        residency.acquire(key, 6)
        residency.release(key, 6)
    before = ledger(residency, "abc")
    with pytest.raises(RuntimeError):
        residency.acquire("c", 12)  # a is parked (least recent), then b fails to size
    assert ledger(residency, "abc") == before, "c busy, a parked on paper: never evicted by the engine"
    assert residency.acquire("c", 4) == []  # it fits beside a and b
    before = ledger(residency, "abc")
    with pytest.raises(RuntimeError):
        residency.grow("c", 14)  # a is parked, then b fails to size
    assert ledger(residency, "abc") == before
    residency.release("c", 4)
    failing.clear()
    assert residency.acquire("c", 12) == [Move("park", "a", 0), Move("park", "b", 1)]
    assert residency.entry("a").state is residency.entry("b").state is State.PARKED


def test_a_failing_size_while_placing_leaves_nobody_busy() -> None:
    failing = set()

    def size(key: object) -> int:
        if key in failing:
            raise RuntimeError("the context could not size a state")
        return 40

    residency = Residency(Budget(kv_cells=16, max_live=4, host_bytes=1000, own_cells=True), park_bytes=size)
    for key in "abcd":
        residency.add(key)
        residency.acquire(key, 4)
        residency.release(key, 4)
    residency.acquire("a", 5, place=True)
    failing.update("bc")  # c (in 2) would trade places with b (in 1): each is sized first
    with pytest.raises(RuntimeError):
        residency.acquire("c", 5, place=True)
    assert not residency.entry("c").busy and residency.entry("c").seq == 2
    failing.clear()
    assert residency.acquire("c", 5, place=True) == [Move("swap", "c", 2, 1, "b")]
