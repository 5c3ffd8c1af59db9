"""Stateless calls find their cached prefix; forks copy the cache instead of re-decoding. Both
answer exactly as a session that was driven the same way."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from near_ties import assert_same_within_noise, scored

from llmsession import GenerationOptions, GrammarError, Model, TemplateError
from llmsession.runtime.session import LocalSession

GREEDY = GenerationOptions(max_tokens=16, temperature=0)
QUESTIONS = [
    "Name a large city in France.",
    "What river flows through it?",
    "Name a famous museum there.",
    "What is it known for?",
    "Which artist painted the most famous work in it?",
    "Name another painting by that artist.",
]


def test_a_growing_history_decodes_only_what_is_new(smollm2: Model) -> None:
    session = smollm2.session(system="You are terse.", share_prefix=False)  # its batches alone
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    decoded = new = previous_total = 0
    parted = True  # (turn 1 may already find the system prompt cached by an earlier call)
    for turn, question in enumerate(QUESTIONS):
        expected = session.respond(question, scored(GREEDY))
        history.append({"role": "user", "content": question})
        reply = smollm2.chat(copy.deepcopy(history), scored(GREEDY))
        assert_same_within_noise(smollm2, reply, expected)  # (their cells lie elsewhere)
        if not parted:  # (what anticipation decoded ahead depends on when the next call came)
            before = [r.usage.reused_tokens - r.usage.anticipated_tokens for r in (reply, expected)]
            assert before[0] == before[1]
        parted = reply.text != expected.text
        session.messages[-1]["content"] = reply.text  # (after a near tie, both go on from one text)
        history.append({"role": "assistant", "content": reply.text})
        if turn:
            decoded += reply.usage.decoded_prompt_tokens
            new += reply.usage.prompt_tokens - previous_total
        previous_total = reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert decoded <= 1.05 * new + len(QUESTIONS), (decoded, new)


def test_interleaved_conversations_each_find_their_own_prefix(smollm2: Model) -> None:
    a: list[dict[str, Any]] = [{"role": "system", "content": "You are A."}]
    b: list[dict[str, Any]] = [{"role": "system", "content": "You are B, a pirate."}]
    for question in QUESTIONS[:3]:
        for history in (a, b):
            history.append({"role": "user", "content": question})
            reply = smollm2.chat(history, GREEDY)
            history.append({"role": "assistant", "content": reply.text})
            if len(history) > 3:
                assert reply.usage.reused_tokens > reply.usage.prompt_tokens // 2


def test_a_branch_forks_and_the_original_conversation_keeps_its_cache(smollm2: Model) -> None:
    """A regeneration (the same history, another last question) must not cut the cache of the
    conversation it branches from: the next call of that conversation still reuses it all."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse, branch test."}]
    for question in QUESTIONS[:2]:
        history.append({"role": "user", "content": question})
        history.append({"role": "assistant", "content": smollm2.chat(history, GREEDY).text})
    branch = smollm2.chat([*history[:-2], {"role": "user", "content": "Something else entirely?"}], GREEDY)
    assert branch.usage.reused_tokens > 0
    history.append({"role": "user", "content": QUESTIONS[2]})
    again = smollm2.chat(history, GREEDY)
    kept = len(smollm2.prompt_tokens(history[:-2]))  # through the second question: the branch cut there
    assert again.usage.reused_tokens >= kept, (again.usage, kept)


def test_concurrent_stateless_streams_never_share_a_session(smollm2: Model) -> None:
    history = [{"role": "user", "content": QUESTIONS[0]}]
    first = smollm2.chat_stream(history, GREEDY)
    next(first)
    second = smollm2.chat_stream(history, GREEDY)  # the same prefix, while the first still runs
    assert first.session is not second.session
    texts = ["".join(s.delta for s in stream) for stream in (second, first)]
    assert first.reply is not None and second.reply is not None
    assert second.reply.text == texts[0]


def test_a_stateless_call_needs_a_last_user_message(smollm2: Model) -> None:
    with pytest.raises(TemplateError):
        smollm2.chat([{"role": "assistant", "content": "Hi"}])
    with pytest.raises(TemplateError):
        smollm2.chat([])


@pytest.mark.parametrize("which", ["smollm2", "mamba"])
def test_a_fork_continues_exactly_like_its_original(
    which: str, smollm2_path: Path, fixture_path: Callable[[str], Path]
) -> None:
    path = smollm2_path if which == "smollm2" else fixture_path("mamba-tiny.gguf")
    with Model(path, threads=2) as model:
        session = model.session(system="You are terse.")
        session.respond(QUESTIONS[0], GREEDY)
        fork = session.fork()
        assert fork.messages == session.messages and fork.cached_tokens == session.cached_tokens > 0
        fork.messages[1]["content"] = "changed"  # its own transcript
        assert session.messages[1]["content"] == QUESTIONS[0]
        fork.messages[1]["content"] = QUESTIONS[0]
        original, forked = (s.respond(QUESTIONS[1], scored(GREEDY)) for s in (session, fork))
        assert_same_within_noise(model, forked, original)  # (their new cells lie elsewhere)
        # (what the original decoded ahead of this turn while idle, before the fork, is credited
        # to it alone: a CPU-timed difference, not the fork's)
        same = [dataclasses.replace(r.usage, anticipated_tokens=0) for r in (forked, original)]
        assert same[0] == same[1] or forked.text != original.text


def test_a_session_still_finishing_its_reply_is_not_taken_by_another_call(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step that finishes a reply records it and decodes the next prompt's opening ahead,
    its exchange already done: a call arriving then (a client that left, then came back) gets
    another session, not a SessionBusyError (a 500 from the server, seen in its soak test)."""
    history = [{"role": "user", "content": QUESTIONS[0]}]
    look_ahead, seen = LocalSession._look_ahead, []

    def meanwhile(session: LocalSession) -> None:
        monkeypatch.setattr(LocalSession, "_look_ahead", look_ahead)
        grown = [*history, session.messages[-1], {"role": "user", "content": QUESTIONS[1]}]
        with smollm2.chat_stream(grown, GREEDY) as stream:
            seen.append(stream.session is not session)

    monkeypatch.setattr(LocalSession, "_look_ahead", meanwhile)
    smollm2.chat(history, GREEDY)
    assert seen == [True]


def converse_in_turn(model: Model, chats: int) -> list[tuple[int, int]]:
    """``chats`` conversations, each asked twice, taken in turn: for each second turn, the
    tokens it reused and the length of its first turn's prompt."""
    options = GenerationOptions(max_tokens=4, temperature=0)
    histories = [
        [{"role": "user", "content": f"Chat {i}: name a colour, then a fruit."}] for i in range(chats)
    ]
    firsts = []
    for history in histories:
        reply = model.chat(history, options)
        firsts.append(reply.usage.prompt_tokens)
        history += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And another?"}]
    return [(model.chat(h, options).usage.reused_tokens, n) for h, n in zip(histories, firsts, strict=True)]


def test_more_conversations_than_live_sessions_each_find_their_history(smollm2: Model) -> None:
    """12 conversations on a model of 8 live sessions: the ones past 8 are parked, not dropped,
    and each one's second turn reuses its whole first turn."""
    assert all(reused >= first for reused, first in converse_in_turn(smollm2, 12))


def test_a_pool_smaller_than_the_conversations_loses_their_history(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2, stateless_sessions=8) as model:
        assert any(reused < first for reused, first in converse_in_turn(model, 12))
    with pytest.raises(ValueError, match="stateless_sessions"):
        Model(smollm2_path, stateless_sessions=0)


def test_a_call_refused_as_it_starts_leaves_the_kept_conversation_as_it_was(smollm2: Model) -> None:
    """A turn of a kept conversation refused as it starts (a pattern that does not compile)
    took the conversation's session out of the kept ones and dropped it: the next good turn
    decoded everything again, and ``take_conversation`` found nothing. It is put back."""
    history: list[dict[str, Any]] = [{"role": "user", "content": QUESTIONS[0]}]
    first = smollm2.chat(history, GREEDY, tenant="t", conversation="refused")
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": QUESTIONS[1]}]
    with pytest.raises(GrammarError):
        smollm2.chat(history, GenerationOptions(max_tokens=4, regex="("), tenant="t", conversation="refused")
    assert "refused" in smollm2.conversations()
    reply = smollm2.chat(history, GREEDY, tenant="t", conversation="refused")
    assert reply.usage.reused_tokens >= first.usage.prompt_tokens, (reply.usage, first.usage)
    taken = smollm2.take_conversation("refused")
    assert taken is not None and taken[1] == "t" and taken[0].messages[-1]["content"] == reply.text
    taken[0].close()


def test_a_tenant_that_is_not_a_str_is_refused_before_the_session_is_kept(smollm2: Model) -> None:
    """A list as ``keep_conversation``'s tenant was kept, then every later stateless call that
    looked at the kept sessions failed hashing it (``TypeError`` from deep inside)."""
    session = smollm2.session()
    session.respond("Hi", GenerationOptions(max_tokens=2, temperature=0))
    with pytest.raises(TypeError, match="tenant must be a str"):
        smollm2.keep_conversation(session, tenant=["a"], conversation="listed")  # type: ignore[arg-type]
    assert not session.closed and "listed" not in smollm2.conversations()
    assert smollm2.take_conversation("anything") is None
    session.close()


def test_a_slow_start_holds_up_no_other_call_and_its_session_stays_kept_and_busy(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call's start (a large JSON schema checked and compiled took a second) runs once its
    session is chosen, outside the kept sessions' lock: another tenant's call went on waiting
    for it whole. Meanwhile the session it took stays among the kept ones, in its place and
    busy: its conversation is listed, not taken (``take_conversation``), and a call that
    resends the same history answers on another session; after it, the turn is kept as any."""
    history: list[dict[str, Any]] = [{"role": "user", "content": QUESTIONS[0]}]
    first = smollm2.chat(history, GREEDY, tenant="alice", conversation="slow")
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": QUESTIONS[1]}]
    held, release = threading.Event(), threading.Event()
    real = LocalSession.start
    starting: list[LocalSession] = []

    def slow(self: LocalSession, said: Any, options: GenerationOptions, *rest: Any) -> Any:
        if options.json_schema is not None:  # (alice's second turn)
            starting.append(self)
            held.set()
            release.wait(60)
        return real(self, said, options, *rest)

    monkeypatch.setattr(LocalSession, "start", slow)
    schema = GenerationOptions(max_tokens=8, json_schema={"type": "string", "maxLength": 2}, temperature=0)
    replies: list[Any] = []
    alice = threading.Thread(
        target=lambda: replies.append(smollm2.chat(history, schema, tenant="alice", conversation="slow"))
    )
    alice.start()
    try:
        assert held.wait(60)
        bob: list[Any] = []
        other = threading.Thread(target=lambda: bob.append(smollm2.chat(history[:1], GREEDY, tenant="bob")))
        other.start()
        other.join(30)
        assert not other.is_alive() and bob and bob[0].text, "bob's call waited for alice's start"
        assert "slow" in smollm2.conversations()  # (kept in its place while it starts)
        assert smollm2.take_conversation("slow") is None  # (busy: a call is starting on it)
        again = smollm2.chat_stream(history, GREEDY, tenant="alice")  # (the same prefix meanwhile)
        assert again.session is not starting[0]
        assert "".join(step.delta for step in again) and again.reply is not None
    finally:
        release.set()
        alice.join(60)
    assert replies and replies[0].finish_reason == "complete", replies
    assert replies[0].usage.reused_tokens >= first.usage.prompt_tokens, replies[0].usage
    taken = smollm2.take_conversation("slow")
    assert taken is not None and taken[0] is starting[0] and taken[1] == "alice"
    taken[0].close()


@pytest.mark.parametrize("kind", ["choices", "unnamed"])
def test_a_session_starting_counts_as_it_will_be_kept_and_evicts_no_others_main(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Two kept at most: alice's conversation X and bob's Z. A call of alice's takes X's
    session and, while it starts, carol's new conversation is kept. Whatever order the two
    would have had, bob's Z stays: ``n`` choices take the session out of the kept ones at once
    (they keep it again when done), and an unnamed call's session is no conversation's main
    while it starts (it kept X's label and made it a main: Z was closed)."""
    held, release = threading.Event(), threading.Event()
    real = LocalSession.start

    def slow(self: LocalSession, *args: Any) -> Any:
        if threading.current_thread().name == "alice":
            held.set()
            release.wait(60)
        return real(self, *args)

    with Model(smollm2_path, threads=1, stateless_sessions=2) as model:
        asked = [{"role": "user", "content": QUESTIONS[0]}]
        first = model.chat(asked, GREEDY, tenant="alice", conversation="X")
        model.chat([{"role": "user", "content": QUESTIONS[2]}], GREEDY, tenant="bob", conversation="Z")
        again = [
            *asked,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": QUESTIONS[1]},
        ]
        monkeypatch.setattr(LocalSession, "start", slow)

        def alice() -> None:
            if kind == "choices":
                with model.chat_choices(again, GREEDY, n=2, tenant="alice", conversation="X") as choices:
                    for choice in choices:  # (a choice starts when first read)
                        assert "".join(step.delta for step in choice)
            else:
                model.chat(again, GREEDY, tenant="alice")

        thread = threading.Thread(target=alice, name="alice")
        thread.start()
        try:
            assert held.wait(60)
            model.chat([{"role": "user", "content": QUESTIONS[3]}], GREEDY, tenant="carol", conversation="W")
            assert "Z" in model.conversations(), model.conversations()
        finally:
            release.set()
            thread.join(60)
