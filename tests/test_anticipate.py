"""Anticipatory prefill on the real library: after a reply the next prompt's opening decodes in
the background; the next exchange then decodes only the user's words, and answers exactly what a
fresh session answers. A wrong guess, a new exchange, another session or the model's close stop
it; a recurrent model without checkpoints is not anticipated for. Where a test needs a long
opening (to stop it halfway), it starts one on a new session with a long system prompt, the same
code path with more to decode."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import internals
import pytest
from test_reuse import GREEDY, assert_same_as_fresh, check_against_fresh, paragraph, short_prompt_noise

from llmsession import CheckpointConfig, Model, Session, Usage
from llmsession.engine import anticipate
from llmsession.engine.prefix import common_prefix
from llmsession.engine.seat import Seat


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    """No anticipation left over from another test competes with this one's (they give way)."""
    anticipate.stop_all()
    yield
    anticipate.stop_all()


def settled_ahead(session: Session) -> anticipate.Ahead:
    ahead = session._ahead
    assert ahead is not None, "nothing was anticipated"
    ahead.wait()
    return ahead


def decoding(session: Session) -> anticipate.Ahead:
    """A new anticipation of the session, once it has decoded something (it is running); one
    that gave way before that (to another test's background work) is started again."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        session._look_ahead()
        ahead = session._ahead
        assert ahead is not None, "nothing was anticipated"
        while ahead.decoded == 0 and ahead._thread.is_alive():
            time.sleep(0.002)
        if ahead.decoded > 0:
            return ahead
    raise AssertionError("the anticipation never began decoding")


def test_the_next_exchange_decodes_only_the_users_words_and_equals_fresh(smollm2: Model) -> None:
    session = smollm2.session(system="You are a helpful assistant.")
    assert session._ahead is None  # only a reply starts one
    session.respond("Hello!", GREEDY)
    ahead = settled_ahead(session)  # after the reply: its end of turn, the next user header
    assert ahead.target is not None and ahead.decoded >= 4
    assert internals.record(session) == ahead.target
    text = internals.local(smollm2).native.detokenize(
        [int(t) for t in ahead.target[-ahead.decoded :]], special=True
    )
    assert text.endswith("<|im_start|>user\n"), text
    question = "Tell me about the history of Paris."
    before = internals.record(session)
    prompt = internals.local(smollm2).prompt(
        [*session.messages, {"role": "user", "content": question}], own=session.replies
    )
    reply = assert_same_as_fresh(session, question)
    usage = reply.usage
    assert usage.reused_tokens == len(before) and usage.anticipated_tokens == ahead.decoded
    assert usage.decoded_prompt_tokens == len(prompt.items) - len(before)


def test_a_wrongly_decoded_opening_is_caught(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The differential's teeth: an anticipation that records its tokens but decodes others
    (its first one, over and over) must fail the same check the real one passes."""
    original = Seat.decode

    def wrong(self: Seat, tokens: Sequence[int], pos: int, **kwargs: object) -> int:
        if threading.current_thread().name == "llmsession-ahead":
            self.context.decode([tokens[0]] * len(tokens), pos, seq=self.seq)
            self.lease.cache.extend(tokens)
            return -1
        return original(self, tokens, pos, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Seat, "decode", wrong)
    session = smollm2.session(system="You are a helpful assistant.")
    session.respond("Tell me about the history of Paris.", GREEDY)
    settled_ahead(session)
    reply = session.respond("Now describe its museums, one by one.", GREEDY)
    assert reply.usage.anticipated_tokens > 0
    assert check_against_fresh(session, reply, 2 * short_prompt_noise(smollm2) + 0.05) != []


def test_a_new_exchange_stops_an_anticipation_it_does_not_need(smollm2: Model) -> None:
    """A long system prompt decodes ahead in small batches; an edit that changes it stops the
    anticipation within a batch, and the reply equals a fresh session's."""
    session = smollm2.session(system=paragraph(smollm2, 1, 600), batch_size=16)
    session._look_ahead()
    ahead = session._ahead
    assert ahead is not None
    session.messages[0]["content"] = "You are brief."
    reply = assert_same_as_fresh(session, "Tell me about the history of Paris.", batch_size=16)
    assert ahead.cancelled.is_set() and ahead.decoded < 600
    assert reply.usage.anticipated_tokens == 0


def test_a_new_exchange_that_needs_it_waits_for_it(smollm2: Model) -> None:
    """Once it decodes, that is: one that has not begun is stopped, and the exchange decodes the
    opening in its own batch (cheaper than a batch of its own; see the next test)."""
    session = smollm2.session(system=paragraph(smollm2, 2, 300), batch_size=16)
    ahead = decoding(session)
    reply = session.respond("Tell me about the history of Paris.", GREEDY)
    assert ahead.target is not None and ahead.decoded == len(ahead.target)
    assert reply.usage.anticipated_tokens == ahead.decoded
    assert reply.usage.reused_tokens == len(ahead.target)


def test_one_that_has_not_begun_is_not_waited_for(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Questions back to back (a script): the exchange does not wait for an anticipation still
    rendering its probes; it stops it, and decodes the opening in its own batch."""
    rendering, release = threading.Event(), threading.Event()
    slow_opening = anticipate.opening

    def slow(guess: anticipate.Guess) -> tuple[object, ...]:
        if guess.lease is session.lease:  # (not another test's session's)
            rendering.set()
            release.wait(30)
        return slow_opening(guess)

    monkeypatch.setattr(anticipate, "opening", slow)
    session = smollm2.session(system="You are a helpful assistant.")
    session.respond("Tell me about the history of Paris.", GREEDY)
    ahead = session._ahead
    assert ahead is not None and rendering.wait(5)
    reply = session.respond("Now describe its museums, one by one.", GREEDY)
    assert ahead._thread.is_alive()  # not waited for
    assert reply.usage.anticipated_tokens == 0 and reply.usage.decoded_prompt_tokens > 10
    release.set()
    ahead.wait()
    assert ahead.decoded == 0 and not ahead.started  # it saw it was stopped


def test_it_gives_way_to_another_sessions_exchange(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The anticipation's batches after its first (at position 0: memory is empty) wait, holding
    the engine, until another thread waits for it, so the other exchange comes while it runs
    however fast this machine decodes."""
    original, engine = Seat.decode, internals.local(smollm2).engine
    first: list[threading.Thread] = []  # the anticipation that began at position 0
    waited_in_vain: list[int] = []  # where it waited for a waiter that never came

    def patient(self: Seat, tokens: Sequence[int], pos: int, **kwargs: object) -> int:
        me = threading.current_thread()
        if me.name == "llmsession-ahead" and pos == 0 and not first:
            first.append(me)
        elif first and me is first[0]:
            deadline = time.monotonic() + 10
            while not engine.contended:
                if time.monotonic() > deadline:
                    waited_in_vain.append(pos)  # the other exchange took the engine uncounted
                    break
                time.sleep(0.001)
        return original(self, tokens, pos, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Seat, "decode", patient)
    slow = smollm2.session(system=paragraph(smollm2, 3, 200), batch_size=32)
    ahead = decoding(slow)
    smollm2.session().respond("Hello!", GREEDY)
    ahead.wait()
    assert not waited_in_vain
    assert not threading.Event.is_set(ahead.cancelled)  # nobody cancelled it: it gave way
    assert ahead.target is not None and 0 < ahead.decoded < len(ahead.target)
    held = internals.record(slow)
    assert held == ahead.target[: len(held)]
    reply = assert_same_as_fresh(slow, "Tell me about the history of Paris.", batch_size=32)
    assert reply.usage.reused_tokens == len(held) and reply.usage.anticipated_tokens == ahead.decoded


def test_what_a_fork_stopped_is_still_counted_where_the_exchange_reuses_it(smollm2: Model) -> None:
    """A fork stops the anticipation, but what it decoded stays in memory and the next exchange
    reuses it: ``anticipated_tokens`` says so (it said 0)."""
    session = smollm2.session(system="You are a helpful assistant.")
    session.respond("Hello!", GREEDY)
    ahead = settled_ahead(session)
    session.fork().close()
    reply = session.respond("Tell me about the history of Paris.", GREEDY)
    assert ahead.decoded > 0 and reply.usage.anticipated_tokens == ahead.decoded
    assert reply.usage.reused_tokens == ahead.start + ahead.decoded


def test_it_evicts_no_one(smollm2_path: Path) -> None:
    """One live sequence: a session parked by another's exchange is not brought back (and the
    other parked) for an anticipation; only exchanges move states."""
    with Model(smollm2_path, threads=2, max_live_sessions=1) as model:
        first, second = model.session(), model.session()
        first.respond("Hello!", GREEDY)
        pending = first._ahead
        assert pending is not None
        second.respond("Hi there!", GREEDY)  # parks the first
        pending.wait()
        settled_ahead(second)
        states = {s.key: s.state for s in model.memory().sessions}
        assert states[first.lease.key] == "parked" and states[second.lease.key] == "live"
        assert model.memory().counters.parks == 1


def test_an_undo_still_reuses_exactly_the_longest_common_prefix(smollm2: Model) -> None:
    session = smollm2.session(system="You are a helpful assistant.")
    session.respond("Tell me about the history of Paris.", GREEDY)
    session.respond("Now describe its museums, one by one.", GREEDY)
    settled_ahead(session)
    held = internals.record(session)
    del session.messages[-2:]
    question = "Which rivers should a visitor see?"
    prompt = internals.local(smollm2).prompt(
        [*session.messages, {"role": "user", "content": question}], own=session.replies
    )
    reply = assert_same_as_fresh(session, question)
    assert reply.usage.reused_tokens == min(common_prefix(held, prompt.items), len(prompt.items) - 1)


def test_close_fork_and_save_during_an_anticipation(smollm2_path: Path, tmp_path: Path) -> None:
    with Model(smollm2_path, threads=2) as model:
        session = model.session(system=paragraph(model, 4, 300), batch_size=16)
        decoding(session)
        twin = session.fork()  # stops it: the fork copies what memory holds then
        assert session._ahead is None
        held = internals.record(session)
        assert 0 < len(held) < 300 and internals.record(twin) == held
        decoding(session)
        session.save(tmp_path / "s.json")  # stops it too
        saved = internals.record(session)
        assert len(held) < len(saved) < 300
        loaded = model.load_session(tmp_path / "s.json")
        reply = loaded.respond("Hello!", GREEDY)
        assert reply.usage.restored_tokens == len(saved) and reply.usage.reused_tokens >= len(saved)
        busy = model.session(system=paragraph(model, 5, 300), batch_size=16)
        ahead = decoding(busy)
        began = time.perf_counter()
    assert time.perf_counter() - began < 1.0  # close stopped it within a batch
    assert not ahead._thread.is_alive() and ahead.decoded < 300


EXIT_MID_DECODE = """
import sys, time
from llmsession import Model
model = Model(sys.argv[1], threads=2)  # never closed: the interpreter's exit frees it
session = model.session(system="word " * 600, batch_size=16)
session._look_ahead()
while session._ahead.decoded == 0:
    time.sleep(0.002)
"""


def test_the_process_exits_cleanly_with_an_anticipation_decoding(smollm2_path: Path) -> None:
    """At exit the finalizers free the contexts: every anticipation must have stopped first
    (it segfaulted when its exit hook ran after theirs)."""
    done = subprocess.run([sys.executable, "-c", EXIT_MID_DECODE, str(smollm2_path)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_stateless_call_reuses_what_was_decoded_ahead(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2) as model:
        history = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi!"}]
        first = model.chat(history, GREEDY)
        (kept,) = internals.local(model).stateless._sessions
        settled_ahead(kept)
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And you?"}]
        ahead = kept._ahead
        assert ahead is not None and ahead.target is not None
        second = model.chat(history, GREEDY)
        assert second.usage.anticipated_tokens == ahead.decoded >= 4
        assert second.usage.decoded_prompt_tokens == second.usage.prompt_tokens - len(ahead.target)


@pytest.fixture(scope="module")
def mamba(fixture_path: Callable[[str], Path]) -> Iterator[Model]:
    with Model(fixture_path("mamba-tiny.gguf"), threads=2) as model:
        yield model


def test_recurrent_a_wrong_guess_resumes_from_the_checkpoint_at_the_reply_end(mamba: Model) -> None:
    session = mamba.session(system="You are a helpful assistant.")
    session.respond("Question 1: what do you know about item 7?", GREEDY)
    ahead = settled_ahead(session)
    assert ahead.target is not None and ahead.decoded > 0
    reply_end = len(ahead.target) - ahead.decoded
    session.messages.append({"role": "system", "content": "Answer briefly."})  # not a user turn
    reply = assert_same_as_fresh(session, "Question 2: and item 14?")
    assert reply.usage.from_checkpoint and reply.usage.reused_tokens == reply_end


def measured_wrong_guess(model: Model, monkeypatch: pytest.MonkeyPatch, force: bool) -> Usage:
    """Decoded prompt tokens for a turn whose prompt is not a user turn after the reply."""
    if force:
        monkeypatch.setattr(anticipate, "worth_it", lambda guess: True)
    session = model.session(system="You are a helpful assistant.")
    session.respond("Question 1: what do you know about item 7?", GREEDY)
    internals.settled(session)
    session.messages.append({"role": "system", "content": "Answer briefly."})
    return session.respond("Question 2: and item 14?", GREEDY).usage


def test_recurrent_without_checkpoints_is_not_anticipated_for(
    fixture_path: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured, not assumed: forced on, a wrong guess costs the whole transcript again;
    without it, the same turn decodes only its own tail."""
    off = CheckpointConfig(max_count=0)
    with Model(fixture_path("mamba-tiny.gguf"), threads=2, checkpoints=off) as model:
        session = model.session()
        assert session._ahead is None
        session.respond("Hello!", GREEDY)
        assert session._ahead is None
        skipped = measured_wrong_guess(model, monkeypatch, force=False)
        forced = measured_wrong_guess(model, monkeypatch, force=True)
    assert forced.reused_tokens == 0 and forced.decoded_prompt_tokens == forced.prompt_tokens
    assert skipped.reused_tokens > 0 and skipped.decoded_prompt_tokens < forced.decoded_prompt_tokens / 2
