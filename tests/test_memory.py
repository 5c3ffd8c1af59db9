"""The memory manager on the real library: many sessions under a budget far below their sum,
parked and restored, each reply equal (within the split-noise method of ``test_reuse``) to a
control session that was never evicted; what may not be parked goes cold; a damaged restore is
caught by the same check."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import internals
import pytest
from test_reuse import check_against_fresh, short_prompt_noise, tolerance_for

from llmsession import GenerationOptions, MemoryBudgetError, Model, Reply, Session
from llmsession.engine.lease import Lease, SharedContext
from llmsession.engine.moves import Mover

REPLY = GenerationOptions(max_tokens=4, temperature=0)
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
                if reply.text != expected.text or reply.usage.reused_tokens != expected.usage.reused_tokens:
                    problems.append((i, turn, reply.text, expected.text))
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
        assert len(list(folder.iterdir())) <= report.disk_entries
    assert problems == []
    assert list(tmp_path.iterdir()) == [], "closing the model leaves no parked state behind"


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
