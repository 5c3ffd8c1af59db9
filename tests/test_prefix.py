"""Prefix reuse: `plan` keeps the longest allowed prefix, and `PrefixCache` driven through a
random chat keeps fake memories, built to behave like llama.cpp's, exactly as a fresh decode
of its record would leave them."""

from __future__ import annotations

import functools
import pickle
import random
from collections.abc import Callable, Sequence
from itertools import cycle
from typing import Protocol

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from llmsession.config import CheckpointConfig
from llmsession.engine.checkpoints import Checkpoint, Checkpoints
from llmsession.engine.prefix import (
    Item,
    Plan,
    PrefixCache,
    best_donor,
    common_prefix,
    image_items,
    plan,
    starts_a_chunk,
)

CLEARED = Plan(reused=0, remove_from=0, cleared=True)
IMAGE_LEN = 3
WINDOW = 4

# ---------------------------------------------------------------------------------------------
# plan: pure invariants

symbols = st.lists(st.integers(0, 2), max_size=12)


Case = tuple[list[int], list[int], frozenset[int]]


@st.composite
def plan_case(draw: st.DrawFn) -> Case:
    """A record, a prompt sharing a random part of it, and cuts that are not allowed."""
    recorded = draw(symbols)
    shared = recorded[: draw(st.integers(0, len(recorded)))]
    prompt = draw(st.sampled_from([shared, []])) + draw(symbols)
    banned = draw(st.frozensets(st.integers(1, 25)))
    return recorded, prompt or [0], banned


@given(plan_case())
def test_plan_keeps_the_longest_allowed_prefix(case: Case) -> None:
    recorded, prompt, banned = case

    def can_cut(k: int) -> bool:
        return k not in banned

    p = plan(recorded, prompt, can_cut=can_cut)
    limit = min(common_prefix(recorded, prompt), len(prompt) - 1)
    assert 0 <= p.reused <= limit
    assert recorded[: p.reused] == prompt[: p.reused]
    assert can_cut(p.reused)
    assert not any(can_cut(k) for k in range(p.reused + 1, limit + 1))
    assert (p.remove_from is None) == (p.reused == len(recorded))
    assert p.remove_from in (None, p.reused)
    assert p.cleared == (p.remove_from == 0)


@given(st.lists(symbols, max_size=4), symbols.filter(bool), st.frozensets(st.integers(1, 25)))
def test_the_best_donor_gives_the_most_an_own_record_would(
    records: list[list[int]], prompt: list[int], banned: frozenset[int]
) -> None:
    def can_cut(k: int) -> bool:
        return k not in banned

    index, kept = best_donor(prompt, records, can_cut=can_cut)
    gives = [plan(r, prompt, can_cut=can_cut).reused for r in records]
    assert kept == max([0, *gives])
    assert (index == -1) == (kept == 0)
    if kept:
        assert gives.index(kept) == index  # the first of the best
        assert records[index][:kept] == prompt[:kept] and kept < len(prompt) and can_cut(kept)


@given(symbols, symbols)
def test_common_prefix(a: list[int], b: list[int]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


@given(symbols, symbols.filter(bool))
def test_every_cut_is_allowed_by_default(recorded: list[int], prompt: list[int]) -> None:
    assert plan(recorded, prompt) == plan(recorded, prompt, can_cut=lambda k: True)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError):
        plan([1, 2], [])


# ---------------------------------------------------------------------------------------------
# prepare: which memory calls it makes


class Scripted:
    """Records prepare's calls; seq_rm answers `accept`, pos_min answers `lowest`."""

    def __init__(self, accept: bool = True, lowest: int = 0) -> None:
        self.accept, self.lowest = accept, lowest
        self.calls: list[str] = []

    def seq_rm(self, p0: int) -> bool:
        self.calls.append(f"seq_rm({p0})")
        return self.accept

    def clear(self) -> None:
        self.calls.append("clear")

    def pos_min(self) -> int:
        self.calls.append("pos_min")
        return self.lowest


def cache_holding(items: list[Item], n_swa: int = 0) -> PrefixCache:
    cache = PrefixCache(n_swa)
    cache.extend(items)
    return cache


@pytest.mark.parametrize(
    ("recorded", "prompt", "memory", "applied", "calls"),
    [
        ([], [1, 2], Scripted(), Plan(0, None, False), []),
        ([1, 2], [1, 2, 3], Scripted(), Plan(2, None, False), []),
        ([1, 2, 3], [1, 2, 9], Scripted(), Plan(2, 2, False), ["pos_min", "seq_rm(2)"]),
        ([1, 2, 3], [1, 2, 3], Scripted(), Plan(2, 2, False), ["pos_min", "seq_rm(2)"]),
        ([1, 2, 3], [9], Scripted(), CLEARED, ["clear"]),
        ([1, 2, 3], [1, 9], Scripted(accept=False), CLEARED, ["pos_min", "seq_rm(1)", "clear"]),
        ([1, 2, 3], [1, 9], Scripted(lowest=-1), CLEARED, ["pos_min", "clear"]),
        ([1, 2, 3], [1, 9], Scripted(lowest=2), CLEARED, ["pos_min", "clear"]),
    ],
    ids=["first", "append", "rewind", "regenerate", "disjoint", "refused", "lost", "recurrent"],
)
def test_prepare_calls(
    recorded: list[Item], prompt: list[Item], memory: Scripted, applied: Plan, calls: list[str]
) -> None:
    cache = cache_holding(recorded)
    assert cache.prepare(prompt, memory) == applied
    assert memory.calls == calls
    assert cache.items == tuple(prompt[: applied.reused])


# ---------------------------------------------------------------------------------------------
# Fake memories that compute, per position, what a real decode would: a state that depends on
# every earlier item, or CORRUPT when a position it attends to is missing.

CORRUPT = "CORRUPT"


def step(state: object, item: Item) -> int:
    return hash((state, item))


def fresh_states(items: Sequence[Item]) -> list[int]:
    """The state at each position after decoding items into an empty memory."""
    states, state = [], 0
    for item in items:
        state = step(state, item)
        states.append(state)
    return states


class FakeMemory(Protocol):
    def seq_rm(self, p0: int) -> bool: ...
    def clear(self) -> None: ...
    def pos_min(self) -> int: ...
    def decode(self, pos: int, item: Item) -> None: ...
    def check(self, items: Sequence[Item]) -> None: ...


class FakeKV:
    """llama_kv_cache for one sequence. With a window: a small sliding-window cache where a
    position attends to the window - 1 before it, and cells the next position no longer sees
    get overwritten (eagerly, or a random 0-2 positions late)."""

    def __init__(self, window: int = 0, rng: random.Random | None = None) -> None:
        self.window, self.rng = window, rng
        self.cells: dict[int, object] = {}

    def seq_rm(self, p0: int) -> bool:
        self.cells = {p: s for p, s in self.cells.items() if p < p0}
        return True

    def clear(self) -> None:
        self.cells = {}

    def pos_min(self) -> int:
        return min(self.cells, default=-1)

    def decode(self, pos: int, item: Item) -> None:
        if self.cells:
            assert pos == max(self.cells) + 1, "llama_decode rejects non-consecutive positions"
        seen = range(max(0, pos - self.window + 1) if self.window else 0, pos)
        ok = all(self.cells.get(p, CORRUPT) != CORRUPT for p in seen)
        self.cells[pos] = step(self.cells[pos - 1] if pos else 0, item) if ok else CORRUPT
        if self.window:
            oldest = pos + 2 - self.window - (self.rng.randint(0, 2) if self.rng else 0)
            self.cells = {p: s for p, s in self.cells.items() if p >= oldest}

    def check(self, items: Sequence[Item]) -> None:
        n = len(items)
        needed = range(max(0, n - self.window + 1) if self.window else 0, n)
        assert set(needed) <= self.cells.keys() <= set(range(n)), (sorted(self.cells), n)
        states = fresh_states(items)
        assert all(s == states[p] for p, s in self.cells.items()), "memory differs from the record"


class FakeRecurrent:
    """llama_memory_recurrent without rollback snapshots: one running state at its last position.
    Removing from inside the sequence is refused; from past its end is a no-op; from 0 clears."""

    def __init__(self) -> None:
        self.pos: int = -1
        self.state: object = 0

    def seq_rm(self, p0: int) -> bool:
        if p0 <= 0:
            self.clear()
            return True
        return p0 > self.pos

    def clear(self) -> None:
        self.pos, self.state = -1, 0

    def pos_min(self) -> int:
        return self.pos

    def decode(self, pos: int, item: Item) -> None:
        if self.pos >= 0:
            assert pos == self.pos + 1, "llama_decode rejects non-consecutive positions"
        ok = pos == self.pos + 1 and self.state != CORRUPT
        self.pos, self.state = pos, step(self.state, item) if ok else CORRUPT

    def check(self, items: Sequence[Item]) -> None:
        last = fresh_states(items)[-1] if items else 0
        assert (self.pos, self.state) == (len(items) - 1, last), "state differs from the record"

    def snapshot(self) -> bytes:
        return pickle.dumps((self.pos, self.state))

    def resume(self, blob: bytes, position: int) -> bool:
        self.pos, self.state = pickle.loads(blob)
        return self.seq_rm(position) and self.pos == position - 1


class FakeHybrid:
    """llama_memory_hybrid: attention cache plus recurrent state; removal asks the recurrent
    part first, pos_min is the larger of the two."""

    def __init__(self) -> None:
        self.attn, self.recr = FakeKV(), FakeRecurrent()

    def seq_rm(self, p0: int) -> bool:
        return self.recr.seq_rm(p0) and self.attn.seq_rm(p0)

    def clear(self) -> None:
        self.attn.clear()
        self.recr.clear()

    def pos_min(self) -> int:
        return max(self.attn.pos_min(), self.recr.pos_min())

    def decode(self, pos: int, item: Item) -> None:
        self.attn.decode(pos, item)
        self.recr.decode(pos, item)

    def check(self, items: Sequence[Item]) -> None:
        self.attn.check(items)
        self.recr.check(items)

    def snapshot(self) -> bytes:
        return self.recr.snapshot()  # PARTIAL_ONLY: the recurrent part alone

    def resume(self, blob: bytes, position: int) -> bool:
        return self.recr.resume(blob, position) and self.attn.seq_rm(position)


def decode(cache: PrefixCache, memory: FakeMemory, items: Sequence[Item]) -> None:
    """Decode items after what the cache records, as the session does, then record them."""
    start = len(cache.items)
    for i, item in enumerate(items):
        memory.decode(start + i, item)
    cache.extend(items)


# ---------------------------------------------------------------------------------------------
# A random chat. Items are tokens 0-3 and images: IMAGE_LEN positions never to be split.


def as_token(t: int) -> list[Item]:
    return [t]


def as_image(k: int) -> list[Item]:
    return image_items(f"image-{k}", IMAGE_LEN)


def flat(pieces: list[list[Item]]) -> list[Item]:
    return [item for piece in pieces for item in piece]


def item_lists(min_size: int = 0) -> st.SearchStrategy[list[Item]]:
    pieces = st.one_of(st.integers(0, 3).map(as_token), st.integers(0, 1).map(as_image))
    return st.lists(pieces, min_size=min_size, max_size=5).map(flat)


def can_cut_in(prompt: Sequence[Item]) -> Callable[[int], bool]:
    """Cuts are allowed anywhere except inside an image."""

    return functools.partial(starts_a_chunk, prompt)


# How an exchange runs: prefill chunk sizes (cycled), the tokens generated, and an optional
# interruption ("error" or "cancel") before the n-th decode call.
Run = tuple[list[int], list[int], tuple[str, int] | None]
runs = st.tuples(
    st.lists(st.integers(1, 5), min_size=1, max_size=3),
    st.lists(st.integers(0, 3), max_size=4),
    st.none() | st.tuples(st.sampled_from(["error", "abort", "cancel"]), st.integers(0, 6)),
)


class Chat(RuleBasedStateMachine):
    """One session over a fake memory: each exchange prepares, then decodes the prompt's tail in
    chunks (stopping to take the checkpoints the cache asks for) and the generated tokens one by
    one, recording each; errors clear, aborted decodes recover, cancels just stop."""

    n_swa = 0
    checkpoints: CheckpointConfig | None = None

    def new_memory(self, rng: random.Random) -> FakeMemory:
        raise NotImplementedError

    def allowed(self, planned: Plan) -> list[Plan]:
        """The plans prepare may apply when `planned` is the ideal one."""
        return [planned, CLEARED]

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(self.n_swa, self.checkpoints)
        self.memory = self.new_memory(random.Random(0))
        self.transcript: list[Item] = []
        self.last_prompt: list[Item] = []

    @initialize(rng=st.randoms(use_true_random=False))
    def seed(self, rng: random.Random) -> None:
        self.memory = self.new_memory(rng)

    def exchange(self, prompt: list[Item], run: Run) -> None:
        chunks, generated, stop = run
        can_cut = can_cut_in(prompt)
        planned = plan(self.cache.items, prompt, can_cut=can_cut)
        applied = self.cache.prepare(prompt, self.memory, can_cut=can_cut)
        assert applied in self.allowed(planned)
        assert self.cache.items == tuple(prompt[: applied.reused])
        self.memory.check(self.cache.items)
        self.last_prompt, self.transcript = prompt, prompt + generated

        stops = set(self.cache.checkpoint_stops(len(prompt)))
        pos, sizes, batches = applied.reused, cycle(chunks), []
        while pos < len(prompt):
            end = min([len(prompt), pos + next(sizes), *(p for p in stops if p > pos)])
            batches.append(prompt[pos:end])
            pos = end
        batches += [[token] for token in generated]
        for i, batch in enumerate(batches):
            if len(self.cache.items) in stops:
                self.cache.take_checkpoint(self.memory)
            if stop is not None and stop[1] == i:
                if stop[0] in ("error", "abort"):
                    # a failed llama_decode may leave part of the batch in memory
                    for j, item in enumerate(batch[: len(batch) // 2]):
                        self.memory.decode(len(self.cache.items) + j, item)
                    if stop[0] == "abort":
                        self.cache.recover(self.memory)
                    else:
                        self.memory.clear()
                        self.cache.reset()
                return
            decode(self.cache, self.memory, batch)
            self.memory.check(self.cache.items)

    @rule(extra=item_lists(min_size=1), run=runs)
    def append(self, extra: list[Item], run: Run) -> None:
        self.exchange(self.transcript + extra, run)

    @precondition(lambda self: self.transcript)
    @rule(at=st.integers(0, 99), token=st.integers(0, 3), extra=item_lists(), run=runs)
    def edit(self, at: int, token: int, extra: list[Item], run: Run) -> None:
        prompt = list(self.transcript)
        prompt[at % len(prompt)] = token
        self.exchange(prompt + extra, run)

    @precondition(lambda self: self.transcript)
    @rule(keep=st.integers(1, 99), extra=item_lists(), run=runs)
    def truncate(self, keep: int, extra: list[Item], run: Run) -> None:
        self.exchange(self.transcript[: 1 + keep % len(self.transcript)] + extra, run)

    @precondition(lambda self: self.last_prompt)
    @rule(run=runs)
    def regenerate(self, run: Run) -> None:
        self.exchange(self.last_prompt, run)

    @rule(prompt=item_lists(min_size=1), run=runs)
    def new_prompt(self, prompt: list[Item], run: Run) -> None:
        self.exchange(prompt, run)

    @rule()
    def clear(self) -> None:
        self.memory.clear()
        self.cache.reset()

    @invariant()
    def memory_matches_record(self) -> None:
        self.memory.check(self.cache.items)


class KVChat(Chat):
    def new_memory(self, rng: random.Random) -> FakeMemory:
        return FakeKV()

    def allowed(self, planned: Plan) -> list[Plan]:
        return [planned]  # a full cache always gives back the whole shared prefix


class RecurrentChat(Chat):
    def new_memory(self, rng: random.Random) -> FakeMemory:
        return FakeRecurrent()

    def allowed(self, planned: Plan) -> list[Plan]:
        return [planned if planned.remove_from is None else CLEARED]  # appends only


class HybridChat(RecurrentChat):
    def new_memory(self, rng: random.Random) -> FakeMemory:
        return FakeHybrid()


class CheckpointedRecurrentChat(Chat):
    """Recurrent memory with checkpoints: a refused cut resumes from one at or below it."""

    checkpoints = CheckpointConfig(max_count=3, max_bytes=1 << 20, every=4)

    def new_memory(self, rng: random.Random) -> FakeMemory:
        return FakeRecurrent()

    def allowed(self, planned: Plan) -> list[Plan]:
        if planned.remove_from is None:
            return [planned]
        held = self.cache.checkpoints.positions if self.cache.checkpoints else []
        resumed = [Plan(p, p, False, from_checkpoint=True) for p in range(1, planned.reused + 1)]
        return [CLEARED, *resumed] if held or resumed else [CLEARED]

    @invariant()
    def checkpoints_fit(self) -> None:
        assert self.cache.checkpoints is not None
        held = self.cache.checkpoints.positions
        assert len(held) <= 3 and all(0 < p <= len(self.cache.items) for p in held)


class CheckpointedHybridChat(CheckpointedRecurrentChat):
    def new_memory(self, rng: random.Random) -> FakeMemory:
        return FakeHybrid()


class ResumeAboveTheCut(Checkpoints):
    """Broken on purpose: resumes from the newest checkpoint even when it lies above the cut."""

    def best(self, cut: int, can_cut: Callable[[int], bool] | None = None) -> Checkpoint | None:
        return max(self._held, key=lambda c: c.position, default=None)


class BrokenCheckpointChat(CheckpointedRecurrentChat):
    def __init__(self) -> None:
        super().__init__()
        assert self.checkpoints is not None
        self.cache.checkpoints = ResumeAboveTheCut(self.checkpoints)


class SlidingWindowChat(Chat):
    n_swa = WINDOW

    def new_memory(self, rng: random.Random) -> FakeMemory:
        return FakeKV(window=WINDOW, rng=rng)


class UncheckedSlidingWindowChat(SlidingWindowChat):
    """The cache is not told about the window."""

    n_swa = 0


CHAT_SETTINGS = settings(max_examples=30, stateful_step_count=20, deadline=None, database=None)


@pytest.mark.parametrize(
    "machine",
    [KVChat, RecurrentChat, HybridChat, CheckpointedRecurrentChat, CheckpointedHybridChat, SlidingWindowChat],
)
def test_memory_always_matches_the_record(machine: type[Chat]) -> None:
    run_state_machine_as_test(machine, settings=CHAT_SETTINGS)


@pytest.mark.parametrize("machine", [UncheckedSlidingWindowChat, BrokenCheckpointChat])
def test_the_checks_have_teeth(machine: type[Chat]) -> None:
    find_only = settings(CHAT_SETTINGS, max_examples=200, phases=[Phase.generate])
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=find_only)


@pytest.mark.parametrize(("n_swa", "corrupt"), [(WINDOW, False), (0, True)])
def test_regenerate_after_the_window_slid(n_swa: int, corrupt: bool) -> None:
    """Ten prompt items and one generated token leave positions 8-10 of a 4-wide window.
    Regenerating re-decodes position 9, which attends to 6-8: without the window check the
    cache cuts at 9 and decodes over the gap; with it, it starts over."""
    memory, cache = FakeKV(window=WINDOW), PrefixCache(n_swa)
    prompt: list[Item] = list(range(10))
    decode(cache, memory, prompt[cache.prepare(prompt, memory).reused :])
    decode(cache, memory, [10])
    assert sorted(memory.cells) == [8, 9, 10]
    applied = cache.prepare(prompt, memory)
    assert applied == (Plan(9, 9, False) if corrupt else CLEARED)
    decode(cache, memory, prompt[applied.reused :])
    assert (CORRUPT in memory.cells.values()) == corrupt


def test_an_aborted_decode_keeps_a_record_whose_window_is_whole() -> None:
    """In a pool of several sequences another decode takes this one's cells as they leave its
    window (pos_min = L - window + 1: all the next position needs). Undoing an aborted decode
    cut nothing, yet the window test's margin cleared the whole record (a retry decoded the
    conversation again); a cut keeps the margin."""
    memory, cache = FakeKV(window=WINDOW), PrefixCache(WINDOW)
    prompt: list[Item] = list(range(10))
    decode(cache, memory, prompt[cache.prepare(prompt, memory).reused :])
    memory.cells = {p: s for p, s in memory.cells.items() if p >= 10 - WINDOW + 1}  # (taken by another)
    cache.recover(memory)
    assert len(cache.items) == 10
    decode(cache, memory, [10])
    assert CORRUPT not in memory.cells.values()
    cache.cut(memory, 9)  # (a rejected draft: position 9 attends to 6-8, and 6 is gone)
    assert len(cache.items) == 0
