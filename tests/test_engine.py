"""The engine over a fake shared context that keeps llama.cpp's semantics (a unified KV cache:
cells shared by sequences, or each sequence's own cells; decodes refused when no cell is free or
positions do not follow; sequence states as bytes that load only into room), driven by a
hypothesis state machine through exchanges, edits, failures, forks, closes and collected
sessions, with and without a disk tier. After every step: the budget holds, every session's
memory holds exactly its record wherever it lives (live, parked in RAM, on disk) or nothing
(cold), and no state past its window is parked."""

from __future__ import annotations

import itertools
import json
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmsession import ContextOverflowError, MemoryBudgetError, NativeError
from llmsession.engine import budget
from llmsession.engine.budget import MemoryPlan
from llmsession.engine.engine import Engine, Lease
from llmsession.engine.residency import State
from llmsession.options import KV_LAYOUTS

CONTEXT_SIZE = 16


class FakeContext:
    """A unified KV cache: ``cells[i] = (position, item, sequences)``; with ``own_cells``, each
    sequence places its items in its own ``n_ctx / n_seq_max`` cells and a copy is a state's."""

    def __init__(
        self,
        *,
        n_ctx: int,
        n_batch: int,
        threads: int,
        swa_full: bool,
        n_seq_max: int,
        flash_attention: bool | None,
        own_cells: bool = False,
    ) -> None:
        self.n_ctx, self.n_batch, self.n_seq_max, self.own_cells = n_ctx, n_batch, n_seq_max, own_cells
        self.cells: dict[int, tuple[int, Any, set[int]]] = {}
        self.abort = threading.Event()

    def items(self, seq: int) -> list[Any]:
        held = sorted((pos, item) for pos, item, seqs in self.cells.values() if seq in seqs)
        assert [pos for pos, _ in held] == list(range(len(held))), f"sequence {seq} has gaps: {held}"
        return [item for _, item in held]

    def _place(self, seq: int, start: int, items: Sequence[Any]) -> bool:
        per = self.n_ctx // self.n_seq_max
        mine = range(seq * per, (seq + 1) * per) if self.own_cells else range(self.n_ctx)
        free = [i for i in mine if i not in self.cells]
        if len(free) < len(items):
            return False
        for cell, (offset, item) in zip(free, enumerate(items), strict=False):
            self.cells[cell] = (start + offset, item, {seq})
        return True

    def decode(self, tokens: Sequence[int], start: int, *, seq: int = 0, abortable: bool = False) -> None:
        assert 0 <= seq < self.n_seq_max and 0 < len(tokens) <= self.n_batch
        if start != self.pos_max(seq) + 1:
            raise NativeError("llama_decode failed (positions do not follow)")
        if not self._place(seq, start, tokens):
            raise NativeError("llama_decode failed (no KV slot)")

    def check_run(self, tokens: Sequence[int], start: int, seq: int) -> None:
        if start + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"position {start + len(tokens)} exceeds the context size {self.n_ctx}"
            )
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"sequence {seq} is outside this context's 0..{self.n_seq_max - 1}")

    def decode_many(
        self, runs: Sequence[tuple[Sequence[int], int, int]], outputs: Any = None, *, abortable: bool = False
    ) -> list[int]:
        """Every run or none (llama.cpp takes back what it wrote of a refused batch); each run's
        last row."""
        assert 0 < sum(len(tokens) for tokens, _, _ in runs) <= self.n_batch
        before = dict(self.cells)
        try:
            for tokens, start, seq in runs:
                self.check_run(tokens, start, seq)
                self.decode(tokens, start, seq=seq)
        except BaseException:
            self.cells = before
            raise
        ends = list(itertools.accumulate(len(tokens) for tokens, _, _ in runs))
        return [end - 1 for end in ends]

    def seq_rm(self, p0: int, seq: int = 0) -> bool:
        for cell, (pos, _, seqs) in list(self.cells.items()):
            if seq in seqs and pos >= max(p0, 0):
                seqs.discard(seq)
                if not seqs:
                    del self.cells[cell]
        return True

    def seq_cp(self, src: int, dst: int) -> bool:
        if self.own_cells:
            assert self.state_set(self.state_get(src), dst), "a copy did not fit the sequence's cells"
            return True
        for _, _, seqs in self.cells.values():
            if src in seqs:
                seqs.add(dst)
        return True

    def pos_min(self, seq: int = 0) -> int:
        return min((pos for pos, _, seqs in self.cells.values() if seq in seqs), default=-1)

    def pos_max(self, seq: int = 0) -> int:
        return max((pos for pos, _, seqs in self.cells.values() if seq in seqs), default=-1)

    def state_size(self, seq: int = 0) -> int:
        return len(self.state_get(seq))

    def state_get(self, seq: int = 0) -> bytes:
        return json.dumps(self.items(seq)).encode()

    def state_set(self, blob: bytes, seq: int = 0, *, values: bool = False) -> bool:
        self.seq_rm(-1, seq)  # (``values``: a file's, checked finite; a fake's holds no numbers)
        return self._place(seq, 0, json.loads(bytes(blob)))

    def close(self) -> None:
        self.cells.clear()


class FakeNative:
    def __init__(self, n_swa: int) -> None:
        self.n_swa, self.is_recurrent, self.has_encoder = n_swa, False, False


class Boom(Exception):
    """An error in the middle of an exchange."""


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        kv=st.integers(CONTEXT_SIZE, 48),
        live=st.integers(1, 4),
        host=st.integers(0, 300),
        disk=st.booleans(),
        n_swa=st.sampled_from([0, 8]),
        layout=st.sampled_from(KV_LAYOUTS),
    )
    def setup(self, kv: int, live: int, host: int, disk: bool, n_swa: int, layout: str) -> None:
        self.tmp = tempfile.TemporaryDirectory() if disk else None
        own = layout == "per_session" and live > 1
        self.quantum, budget.CELLS_QUANTUM = budget.CELLS_QUANTUM, 1  # the fake pads nothing
        dir_ = Path(self.tmp.name) if self.tmp else None
        config = MemoryPlan(kv * live if own else kv, live, host, dir_, batch_size=4, kv_layout=layout)
        self.engine = Engine(FakeNative(n_swa), None, 1, config, make_context=FakeContext)  # type: ignore[arg-type]
        self.n_swa, self.kv, self.host = n_swa, kv, host  # kv: what one session may hold
        self.total = config.kv_tokens
        self.leases: list[Lease] = []
        self.history: dict[int, list[Any]] = {}  # each session's last prompt and reply
        self.counter = itertools.count(10_000)
        for _ in range(5):
            self.add()

    def add(self) -> Lease:
        lease = self.engine.lease(swa_full=True, batch_size=4)
        self.leases.append(lease)
        self.history[lease.key] = []
        return lease

    @property
    def context(self) -> FakeContext:
        (pool,) = self.engine._shared_contexts.values()
        return pool.context  # type: ignore[return-value]

    @precondition(lambda self: hasattr(self, "engine") and self.leases)
    @rule(
        data=st.data(),
        new=st.integers(1, 6),
        reply=st.integers(0, 4),
        fail=st.booleans(),
        abort=st.booleans(),
    )
    def exchange(self, data: st.DataObject, new: int, reply: int, fail: bool, abort: bool) -> None:
        lease = data.draw(st.sampled_from(self.leases))
        history = self.history[lease.key]
        keep = data.draw(st.integers(0, len(history)))  # an edit or a regeneration rewinds
        prompt = [*history[:keep], *(next(self.counter) for _ in range(new))][-CONTEXT_SIZE + 1 :]
        cells = min(CONTEXT_SIZE, max(len(lease.cache.items), len(prompt)) + 2)
        with self.engine.seat(lease, cells, threading.Event()) as seat:
            assert self.context.items(seat.seq) == list(lease.cache.items), (
                "the seat does not hold the record"
            )
            try:
                plan = seat.prepare(prompt, can_cut=lambda position: True)
                assert list(lease.cache.items) == prompt[: plan.reused]
                pos = plan.reused
                for i in range(pos, len(prompt), 4):
                    if abort and i + 4 >= len(prompt):  # cancelled mid-batch: part of it landed
                        seat.context.decode(prompt[i : i + 2], pos, seq=seat.seq)
                        seat.after_abort()
                        self.history[lease.key] = prompt  # the cache keeps what was decoded
                        return
                    seat.decode(prompt[i : i + 4], pos)
                    pos += len(prompt[i : i + 4])
                replied = []
                for _ in range(reply):
                    if pos + 1 >= CONTEXT_SIZE:
                        break
                    token = next(self.counter)
                    seat.decode([token], pos)
                    replied.append(token)
                    pos += 1
                if fail:
                    raise Boom
                self.history[lease.key] = prompt + replied
            except Boom:
                seat.clear()  # what Session does when an exchange fails

    @precondition(lambda self: hasattr(self, "engine") and self.leases and len(self.leases) < 9)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        source = data.draw(st.sampled_from(self.leases))
        target = self.add()
        record = source.cache.items
        self.history[target.key] = list(record)
        self.engine.fork(source, target)
        # With one sequence and no room to park, the copy may push the original out (cold).
        assert target.cache.items in ((), record)

    @precondition(lambda self: hasattr(self, "engine") and self.leases)
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.leases))
        self.engine.discard(lease)
        assert lease.cache.items == ()

    @precondition(lambda self: hasattr(self, "engine") and len(self.leases) > 1)
    @rule(data=st.data())
    def collect(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.leases))
        self.leases.remove(lease)
        self.engine.bury(lease)
        self.engine.memory()  # a safe point: the buried lease's memory is freed here

    @rule()
    def budget_exceeded_is_refused(self) -> None:
        if hasattr(self, "engine") and self.leases:
            try:
                with self.engine.seat(self.leases[0], self.kv + 1, threading.Event()):
                    raise AssertionError("a request above kv_tokens was seated")
            except MemoryBudgetError:
                pass

    @invariant()
    def everything_holds_its_record(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine, owned = self.engine, set()
        for lease in self.leases:
            record = list(lease.cache.items)
            assert record == self.history[lease.key][: len(record)], "a record holds foreign items"
            entry = lease.shared_context.residency.entry(lease.key)
            where = engine.lot.holds(lease.key)
            if entry.state is State.LIVE:
                owned.add(entry.seq)
                assert self.context.items(entry.seq) == record
            elif where:
                blob = engine.lot.peek(lease.key)
                assert blob is not None, "a parked state did not come back"
                assert json.loads(bytes(blob)) == record
                assert self.n_swa == 0 or len(record) <= self.n_swa, "a state past its window was parked"
            else:
                assert record == [], "a cold session kept a record"
        for _, _, seqs in self.context.cells.values() if self.engine._shared_contexts else []:
            assert seqs <= owned, f"cells of sequences nobody owns: {seqs - owned}"

    @invariant()
    def within_budget(self) -> None:
        if not hasattr(self, "engine") or not self.engine._shared_contexts:
            return
        report = self.engine.memory()
        assert len(self.context.cells) <= self.total
        assert report.live_sessions <= self.engine.config.max_live_sessions
        assert self.engine.lot.host_bytes <= self.host
        assert self.engine.lot.disk_entries == 0 or self.engine.lot.disk_dir is not None

    def teardown(self) -> None:
        if hasattr(self, "quantum"):
            budget.CELLS_QUANTUM = self.quantum
        if hasattr(self, "engine"):
            self.engine.close()
            if self.tmp is not None:
                assert list(Path(self.tmp.name).iterdir()) == [], "closing left parked files behind"
                self.tmp.cleanup()


EngineMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
TestEngine = EngineMachine.TestCase
