"""The memory manager on the real library: many sessions under a budget far below their sum,
parked and restored, each reply equal (within the split-noise method of ``test_reuse``) to a
control session that was never evicted; what may not be parked goes cold; a damaged restore is
caught by the same check."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import internals
import pytest
from test_reuse import check_against_fresh, short_prompt_noise, tolerance_for

from llmsession import GenerationOptions, MemoryBudgetError, Model, NativeError, Reply, Session
from llmsession.engine.lease import Lease, SharedContext
from llmsession.engine.moves import Mover
from llmsession.native.context import NativeContext

REPLY = GenerationOptions(max_tokens=4, temperature=0)
GREEDY = GenerationOptions(max_tokens=16, temperature=0)
TOPICS = ("rivers", "bridges", "lanterns", "harbours", "meadows", "orchards", "towers", "valleys")


def question(i: int, turn: int) -> str:
    return f"Conversation {i}, turn {turn}: name three facts about {TOPICS[(i + turn) % len(TOPICS)]}."


def round_robin(model: Model, control: Model, n: int, turns: int) -> tuple[list[str], list[Session]]:
    """``n`` sessions take ``turns`` turns each, in rotation, on ``model`` (a small budget). From
    the second turn on (the first decodes from scratch anyway) each reply is compared with a
    control that was never evicted: a new session of ``control`` (room for all) given the same
    transcript. Returns the problems found, and the sessions (alive: a collected session's memory
    is freed)."""
    ours = [model.session(f"You are assistant number {i}.", context_size=1024) for i in range(n)]
    tolerance, problems = tolerance_for(short_prompt_noise(control)), []  # the same file and build
    for turn in range(turns):
        for i, session in enumerate(ours):
            before = copy.deepcopy(session.messages)
            reply = session.respond(question(i, turn), REPLY)
            if turn == 0:
                continue
            twin = control.session(context_size=1024)
            twin.messages = before
            expected = twin.respond(question(i, turn), REPLY)  # another model: its own context
            if reply.text != expected.text:  # then every choice must be within the split noise
                found = (
                    check_against_fresh(session, reply, tolerance, at_least=1)
                    if tolerance > 0.05
                    else ["differs"]
                )
                if found:
                    problems.append(f"session {i} turn {turn}: {reply.text!r} != {expected.text!r} {found}")
    return problems, ours


@pytest.fixture()
def control(smollm2: Model) -> Model:
    """The suite's SmolLM2 with the default budget: its new sessions were never evicted."""
    return smollm2


def test_32_sessions_round_robin_under_a_small_budget_equal_a_never_evicted_control(
    smollm2_path: Path, control: Model
) -> None:
    # 4 live sequences of 1,024 cells each: 32 x 1,024 positions would need 8 times that.
    with Model(
        smollm2_path, threads=2, kv_tokens=4096, max_live_sessions=4, host_cache_bytes=128 << 20
    ) as model:
        problems, _ = round_robin(model, control, n=32, turns=2)
        report = model.memory()
    assert problems == []
    counters = report.counters
    assert counters.parks >= 28 and counters.restores >= 28 and counters.drops == 0, counters
    assert report.live_sessions <= 4 and report.kv_layout == "per_session" and report.session_cells == 1024
    assert report.parked_bytes <= 128 << 20


def test_a_restore_with_damaged_values_is_caught(
    smollm2_path: Path, control: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The teeth: restored states whose positions are right but whose last values are not pass
    the position check; the differential must see it."""
    real_restore = Mover.restore

    def damaged(self: Mover, pool: SharedContext, lease: Lease, seq: int, blob: bytes | None) -> None:
        real_restore(self, pool, lease, seq, blob)
        held = len(lease.cache.items)
        if held > 4:  # the last 4 positions hold other tokens' keys and values
            pool.context.seq_rm(held - 4, seq)
            pool.context.decode([1, 2, 3, 4], held - 4, seq=seq)

    monkeypatch.setattr(Mover, "restore", damaged)
    with Model(smollm2_path, threads=2, kv_tokens=1024, max_live_sessions=1) as model:
        problems, _ = round_robin(model, control, n=2, turns=2)
        assert model.memory().counters.restores > 0
    assert problems, "a damaged restore went unnoticed"


def test_sessions_past_a_sliding_window_go_cold_and_within_it_are_parked(gemma3_path: Path) -> None:
    with Model(gemma3_path, threads=2, max_live_sessions=1) as model:
        long_, short = model.session(context_size=2048), model.session(context_size=2048)
        long_.respond("word " * 600, GenerationOptions(max_tokens=2, temperature=0))
        short.respond("Hello there.", GenerationOptions(max_tokens=2, temperature=0))  # evicts long_
        states = {s.key: s.state for s in model.memory().sessions}
        assert states[long_.lease.key] == "cold", "a state past its window was parked"
        long_.respond("More.", GenerationOptions(max_tokens=2, temperature=0))  # evicts short: parked
        assert {s.key: s.state for s in model.memory().sessions}[short.lease.key] == "parked"
        again = short.respond("And?", GenerationOptions(max_tokens=2, temperature=0))
        assert again.usage.reused_tokens > 0 and model.memory().counters.restores == 1


def test_a_recurrent_state_is_parked_and_restored_exactly(fixture_path: Callable[[str], Path]) -> None:
    path = fixture_path("mamba-tiny.gguf")
    with Model(path, threads=2, max_live_sessions=1) as model, Model(path, threads=2) as control:
        problems = []
        pairs = [(model.session(context_size=512), control.session(context_size=512)) for _ in range(3)]
        for turn in range(3):
            for i, (session, twin) in enumerate(pairs):
                reply, expected = (
                    session.respond(question(i, turn), REPLY),
                    twin.respond(question(i, turn), REPLY),
                )
                # what each read from its own record (the opening decoded ahead of the next turn
                # while the script moved on is the idle time's, not the restore's: left out)
                held, want = (r.usage.reused_tokens - r.usage.anticipated_tokens for r in (reply, expected))
                if reply.text != expected.text or held != want:
                    problems.append((i, turn, reply.text, expected.text, held, want))
        assert model.memory().counters.restores >= 6
    assert problems == []


def test_parked_states_spill_to_disk_and_come_back(
    smollm2_path: Path, control: Model, tmp_path: Path
) -> None:
    with Model(
        smollm2_path,
        threads=2,
        kv_tokens=1024,
        max_live_sessions=1,
        host_cache_bytes=0,
        disk_cache_dir=tmp_path,
    ) as model:
        problems, _alive = round_robin(model, control, n=2, turns=2)
        report = model.memory()
        assert report.counters.disk_writes > 0 and report.counters.drops == 0
        assert report.disk_entries > 0 and report.disk_bytes > 0
        (folder,) = tmp_path.iterdir()  # the model's private folder
        assert len([p for p in folder.iterdir() if p.name != ".alive"]) <= report.disk_entries
    assert problems == []
    assert list(tmp_path.iterdir()) == [], "closing the model leaves no parked state behind"


def test_a_disk_tier_whose_folder_cannot_be_made_forgets_instead(
    smollm2_path: Path, control: Model, tmp_path: Path
) -> None:
    """The first spill makes the model's folder in ``disk_cache_dir``: one that cannot be made
    (a file in its place, a full disk, no right to write), the state is forgotten (a miss) and
    every exchange still answers; it raised in the middle of the ledger's moves, failing the
    exchange that needed the room."""
    gone = tmp_path / "gone"
    with Model(
        smollm2_path, threads=2, kv_tokens=1024, max_live_sessions=1, host_cache_bytes=0, disk_cache_dir=gone
    ) as model:
        gone.write_text("a file where the folder would be")  # (made at the first spill: it cannot be)
        problems, _alive = round_robin(model, control, n=2, turns=2)
        counters = model.memory().counters
    assert problems == []
    assert counters.disk_writes == 0 and counters.drops >= 2, counters


def test_a_park_that_fails_leaves_no_cells_behind_in_the_sequence_it_freed(
    smollm2_path: Path, control: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state read that fails while a session is parked to make room (the ledger already has
    it parked and its sequence free): the sequence is emptied and that session cold, so the next
    one placed there decodes from nothing, as a fresh decode does. Its cells stayed: the next
    prompt was refused by llama.cpp, or decoded beside them. The ledger has it cold too: its
    state's bytes stayed counted as parked, and made other sessions cold instead of parked."""
    with Model(smollm2_path, threads=2, kv_tokens=1024, max_live_sessions=1, anticipate=False) as model:
        first, second = model.session(), model.session()
        first.respond("Tell me about rivers.", REPLY)
        real, reads = NativeContext.state_get, []

        def failing(context: NativeContext, seq: int = 0, **flags: Any) -> Any:
            reads.append(seq)
            raise NativeError("llama_state_seq_get_data failed (injected)")

        monkeypatch.setattr(NativeContext, "state_get", failing)
        with pytest.raises(NativeError, match="injected"):
            second.respond("Tell me about bridges.", REPLY)
        monkeypatch.setattr(NativeContext, "state_get", real)
        assert reads == [0] and internals.record(first) == ()
        memory = model.memory()  # (the ledger had it parked: its bytes made others cold)
        assert memory.parked_bytes == 0, memory
        tolerance = tolerance_for(short_prompt_noise(control))
        for session in (second, first):  # (each takes sequence 0 in turn: the other is parked)
            reply = session.respond("Tell me about bridges.", GREEDY)
            assert check_against_fresh(session, reply, tolerance, reference=control, at_least=1) == []


def test_a_stream_refused_room_in_a_shared_pool_keeps_its_cache(smollm2_path: Path) -> None:
    """Two streams grow in one pool until one is refused room (a MemoryBudgetError, a 503 at the
    doors) before its step decodes: memory still holds its record, so the retry decodes only
    what the record lacks. The whole cache was dropped, and the retry began from nothing."""
    long = GenerationOptions(max_tokens=400, temperature=0)
    with Model(
        smollm2_path, threads=2, kv_layout="shared", kv_tokens=768, max_live_sessions=2, anticipate=False
    ) as model:
        sessions = [model.session(context_size=512) for _ in range(2)]
        streams = [s.stream(f"Write a long story about {TOPICS[i]}.", long) for i, s in enumerate(sessions)]
        refused: list[int] = []
        while not refused:
            for i, stream in enumerate(streams):
                try:
                    next(stream)
                except MemoryBudgetError:
                    refused.append(i)
                except StopIteration:
                    raise AssertionError("both replies ended before the pool was full") from None
        (i,) = refused
        streams[1 - i].close()
        held = sessions[i].cached_tokens
        assert held > 100, "its prompt and the reply so far stay in memory"
        retry = sessions[i].respond(f"Write a long story about {TOPICS[i]}.", REPLY)
        assert retry.usage.reused_tokens == retry.usage.prompt_tokens - 1 <= held, retry.usage


def test_a_parked_session_costs_its_tokens_not_its_context(smollm2: Model) -> None:
    """A parked state's size follows the positions it holds (KV bytes per token from the GGUF),
    whatever the session's context_size."""
    native = internals.local(smollm2).native
    keys = ("block_count", "attention.head_count", "attention.head_count_kv", "embedding_length")
    layers, heads, kv_heads, width = (int(internals.meta(native, f"llama.{key}") or 0) for key in keys)
    per_token = layers * 2 * (kv_heads * width // heads) * 2  # K and V rows, f16
    session = smollm2.session(context_size=2048)
    session.respond("Tell me a story about a lighthouse keeper.", REPLY)
    size = len(internals.state(session))
    assert per_token == 22.5 * 1024
    assert size <= 1.1 * session.cached_tokens * per_token, (size, session.cached_tokens)


def test_streams_holding_every_sequence_refuse_another_clearly(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2, max_live_sessions=1) as model:
        first, second = model.session(), model.session()
        stream = first.stream("Count to ten.", REPLY)
        next(stream)  # first is in an exchange: it may not be evicted
        with pytest.raises(MemoryBudgetError):
            second.respond("Hello.", REPLY)
        assert second.messages == [] and second.cached_tokens == 0
        stream.close()
        assert second.respond("Hello.", REPLY).text
        with pytest.raises(ValueError, match="kv_tokens"):
            model.session(context_size=16384)


def test_sessions_in_threads_share_the_context_safely(smollm2: Model) -> None:
    """Interleaved decodes of several sessions on several threads: each reply is what the same
    session answers alone (a decode and the sampling of its logits are one step)."""
    sessions: list[Session] = [smollm2.session(f"You are assistant {i}.") for i in range(4)]
    alone = [smollm2.session(f"You are assistant {i}.").respond(question(i, 0), REPLY).text for i in range(4)]
    replies: dict[int, Reply] = {}

    def run(i: int) -> None:
        replies[i] = sessions[i].respond(question(i, 0), REPLY)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tolerance = tolerance_for(short_prompt_noise(smollm2))
    for i, session in enumerate(sessions):
        if replies[i].text != alone[i]:  # then every choice must be within the split noise
            problems = check_against_fresh(session, replies[i], tolerance, final=False, at_least=1)
            assert problems == [], (replies[i].text, alone[i])


def test_a_disk_cache_dir_that_cannot_be_made_is_a_miss_not_a_failed_load(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """A file where the folder should be (or no right to write) raised a raw FileExistsError
    from the model's construction, after its weights had loaded: the README's promise is a
    spill's miss, logged, tried again at the next spill."""
    taken = tmp_path / "taken"
    taken.write_text("a file")
    with Model(smollm2_path, threads=1, flash_attention=False, disk_cache_dir=taken) as model:
        assert (
            model.chat([{"role": "user", "content": "Hi."}], GenerationOptions(max_tokens=2)).text is not None
        )


def test_a_seat_that_fails_once_the_ledger_said_yes_leaves_its_session_free(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the ledger's yes and the block that gives the session back, an error (or a
    Ctrl-C, between two bytecodes) left the session busy for good: never evicted, so with one
    live session no other could ever run. From the ledger's yes on, every path gives it back."""
    from llmsession.engine import engine as engine_module

    with Model(smollm2_path, threads=2, kv_tokens=1024, max_live_sessions=1, anticipate=False) as model:
        first, second = model.session(), model.session()
        first.respond("Tell me about rivers.", REPLY)

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise MemoryError("a seat (injected)")

        seat = engine_module.Seat
        monkeypatch.setattr(engine_module, "Seat", refused)
        with pytest.raises(MemoryError, match="injected"):
            first.respond("And lakes?", REPLY)
        monkeypatch.setattr(engine_module, "Seat", seat)
        assert second.respond("Tell me about bridges.", REPLY).text  # (the first evicted for it)
