"""Gemma 3 sessions of the small sliding-window cache (``swa_full=False``) that differ only in
``context_size`` or ``batch_size`` share one llama context, made with the model's batch size (a
session's own batch cuts its prompts), and that context goes with the last of them: keyed by a
session's batch, every ``context_size`` under 512 made another context of ``kv_tokens`` cells,
kept until the model closed and counted nowhere (six sessions, six more contexts, 42 MiB each).
Their replies, parked and restored among each other there, equal fresh decodes in a context of
their own batch size (the old layout) within the measured split noise."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import internals
from near_ties import assert_same_within_noise, scored

from llmsession import GenerationOptions, Model, SessionConfig
from llmsession.native.context import NativeContext

LOAD: dict[str, Any] = dict(
    threads=1, kv_tokens=4096, max_live_sessions=2, flash_attention=False, anticipate=False
)
ONE = GenerationOptions(max_tokens=1, temperature=0)
REPLY = scored(GenerationOptions(max_tokens=16, temperature=0))


def held_contexts(model: Model) -> list[NativeContext]:
    """The llama contexts the model holds open (what its memory really is, beside weights)."""
    children = internals.local(model).native.children()
    return [c for c in children if isinstance(c, NativeContext) and not c.closed]


def test_small_window_sessions_of_any_size_share_one_context_freed_after_them(gemma3_path: Path) -> None:
    with Model(gemma3_path, **LOAD) as model:
        engine = internals.local(model).engine
        before = model.memory()  # (waits for the default context, made in the background)
        assert len(held_contexts(model)) == 1
        with model.session(swa_full=False, context_size=100) as a, model.session(swa_full=False) as b:
            for session in (a, b, a):
                session.respond("Hi", ONE)
                assert len(held_contexts(model)) == 2  # (the default one, and one for both)
            assert model.memory().counters.restores == 1  # (they take turns: a was parked)
        assert len(held_contexts(model)) == 1
        seen = []
        for size in (100, 101, 102, 103, 104, 105, None):
            with model.session(swa_full=False, context_size=size) as session:
                session.respond("Hi", ONE)
                report, held = model.memory(), held_contexts(model)
                assert report.buffer_bytes == sum(c.buffers for c in held)
                assert [s.key for s in report.sessions] == [session.lease.key]  # (closed ones gone)
                seen.append((len(held), report.buffer_bytes, frozenset(c.n_batch for c in held)))
            after = model.memory()
            assert len(held_contexts(model)) == 1, f"context_size {size}: its context outlived it"
            assert after.buffer_bytes == before.buffer_bytes and after.sessions == []
            assert len(engine._shared_contexts) == 1
        # One small-window context while a session is open, of the model's batch, the same each time.
        assert set(seen) == {(2, seen[0][1], frozenset({512}))}, seen


def test_small_window_replies_are_unchanged_and_equal_fresh_decodes(gemma3_path: Path) -> None:
    """Two turns each, turn after turn across the sessions (one live at a time: each is parked
    and restored). On a fresh model whose batch is the session's (the layout a context per batch
    size gave), the same two turns in a session alone answer alike, and so does a fresh session
    for each turn (a fresh decode)."""
    settings = [
        SessionConfig(context_size=100, swa_full=False),
        SessionConfig(swa_full=False),
        SessionConfig(context_size=400, batch_size=64, swa_full=False),  # a prompt of 64-token batches
    ]
    long_ = "Describe the harbour of a small fishing town at dawn: " + "boats, nets, gulls, light. " * 20
    asked = [["Hi, who are you?", long_][i // 2] for i in range(len(settings))]
    turns = [[first, "What is the capital of France?"] for first in asked]
    with Model(gemma3_path, **LOAD) as model:
        sessions = [model.session(config=c) for c in settings]
        transcripts: list[list[list[dict[str, Any]]]] = [[] for _ in settings]
        replies: list[list[Any]] = [[] for _ in settings]
        for turn in range(2):
            for i, session in enumerate(sessions):
                transcripts[i].append(copy.deepcopy(session.messages))
                replies[i].append(session.respond(turns[i][turn], REPLY))
        assert model.memory().counters.restores >= len(settings)
        assert all(r[1].usage.reused_tokens > 0 for r in replies), "a second turn decoded all"
        assert [s.batch_size for s in sessions] == [100, 512, 64]
        for i, session in enumerate(sessions):
            config = session.config
            with Model(gemma3_path, **{**LOAD, "batch_size": config.batch_size}) as old:
                alone = old.session(config=config)
                for turn in range(2):
                    same_within_noise(model, replies[i][turn], alone.respond(turns[i][turn], REPLY))
                for turn in range(2):
                    fresh = old.session(config=dataclasses.replace(config, share_prefix=False))
                    fresh.messages = transcripts[i][turn]
                    expected = fresh.respond(turns[i][turn], REPLY)
                    assert expected.usage.reused_tokens == 0
                    same_within_noise(model, replies[i][turn], expected)


def same_within_noise(model: Model, reply: Any, expected: Any) -> None:
    """``assert_same_within_noise``, its noise measured (45 s here) only where the replies part."""
    if reply.text != expected.text or len(reply.logprobs) != len(expected.logprobs):
        assert_same_within_noise(model, reply, expected)


def test_a_full_window_cache_in_a_pool_of_several_keeps_the_window_test(gemma3_path: Path) -> None:
    """A full window cache (``swa_full``, the default) skipped the window test: its cells were
    taken to be never reused. In a pool of several sequences (``kv_layout="shared"``) a decode
    takes another sequence's out-of-window cells, and llama.cpp drops those positions from the
    window layers: a rewind, or a prefix copied to another session, then attended to less than
    a fresh decode does. There the test holds; a sequence of cells of its own needs none."""
    for layout in ("shared", "per_session"):
        with Model(gemma3_path, **{**LOAD, "kv_layout": layout}) as model:
            n_swa = internals.local(model).native.n_swa
            with model.session() as session:
                assert n_swa > 0 and session.lease.cache.n_swa == (n_swa if layout == "shared" else 0)
