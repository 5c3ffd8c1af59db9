"""``Model.chat_choices`` / ``complete_choices``: ``n`` answers of one prompt that share its
prefill (the library's, which the server's ``n`` is built on). The prompt is decoded once; each
choice answers on a fork of its state, as a fresh decode would (within the build's noise); a
choice cancelled before it began ends at once; tenants stay apart."""

from __future__ import annotations

import threading
import time

import internals
import pytest
from near_ties import assert_same_within_noise, scored

from llmsession import Choices, GenerationOptions, Model, SessionConfig, Stream

QUESTION = "You are a careful naturalist. List three animals of the Arctic and say why they thrive."
GREEDY = scored(GenerationOptions(max_tokens=12, temperature=0))


def run_all(choices: Choices) -> list[object]:
    """Each choice iterated in a thread of its own, as the server runs them."""
    replies: list[object] = [None] * len(choices)

    def run(index: int, stream: Stream) -> None:
        with stream:
            for _ in stream:
                pass
        replies[index] = stream.reply

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(choices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return replies


def test_the_prompt_is_decoded_once_and_each_choice_answers_as_a_fresh_decode(smollm2: Model) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    prompt = len(smollm2.prompt_tokens(messages))
    choices = smollm2.chat_choices(messages, GREEDY, n=3, tenant="choices-once", share_prefix=False)
    assert len(choices) == 3 and choices.prompt is None  # nothing decodes before a choice runs
    replies = run_all(choices)
    assert choices.prompt is not None and choices.prompt.decoded_prompt_tokens == prompt
    for reply in replies:
        assert reply is not None and reply.usage.prompt_tokens == prompt  # type: ignore[attr-defined]
        assert reply.usage.reused_tokens >= prompt - 1  # type: ignore[attr-defined]  # the fork's
    fresh = smollm2.session(share_prefix=False).respond(QUESTION, GREEDY)
    for reply in replies:
        assert_same_within_noise(smollm2, reply, fresh)
    assert all(stream.session is not None and stream.session.closed for stream in choices)


def test_separate_calls_would_each_decode_the_prompt(smollm2: Model) -> None:
    """The variant that must fail the check above: ``n`` calls of new tenants each prefill."""
    messages = [{"role": "user", "content": QUESTION + " Be brief."}]
    prompt = len(smollm2.prompt_tokens(messages))
    decoded = [
        smollm2.chat(messages, GREEDY, tenant=f"apart-{i}", share_prefix=False).usage.decoded_prompt_tokens
        for i in range(2)
    ]
    assert decoded == [prompt, prompt]


def test_a_raw_prompt_forks_too_and_a_tenant_reuses_its_own_prefill(smollm2: Model) -> None:
    text = "The three largest animals of the Arctic are"
    options = GenerationOptions(max_tokens=6, temperature=0.9, seed=7)
    choices = smollm2.complete_choices(text, options, n=2, tenant="raw-forks", share_prefix=False)
    replies = run_all(choices)
    assert choices.prompt is not None and choices.prompt.decoded_prompt_tokens > 0
    assert all(r is not None and r.usage.reused_tokens >= r.usage.prompt_tokens - 1 for r in replies)  # type: ignore[attr-defined]
    again = smollm2.complete(text + " polar", options, tenant="raw-forks", share_prefix=False)
    assert again.usage.reused_tokens >= choices.prompt.prompt_tokens - 1  # the prefill's session, kept
    other = smollm2.complete(text + " polar", options, tenant="someone-else", share_prefix=False)
    assert other.usage.reused_tokens == 0  # nothing crosses tenants


def test_choices_cancelled_before_they_begin_end_at_once_and_nothing_is_forked(smollm2: Model) -> None:
    choices = smollm2.chat_choices(
        [{"role": "user", "content": "Write a long story about the sea."}],
        GenerationOptions(max_tokens=200, temperature=0.7, seed=1),
        n=2,
        config=SessionConfig(share_prefix=False),
        tenant="cancelled-choices",
    )
    before = len(smollm2.memory().sessions)
    choices.cancel()
    replies = run_all(choices)
    assert [r.finish_reason for r in replies] == ["cancelled", "cancelled"]  # type: ignore[attr-defined]
    assert all(r.usage.completion_tokens == 0 and r.text == "" for r in replies)  # type: ignore[attr-defined]
    assert all(stream.session is None for stream in choices)  # no fork was made
    assert choices.prompt is not None and choices.prompt.decoded_prompt_tokens < choices.prompt.prompt_tokens
    assert len(smollm2.memory().sessions) <= before + 1  # the prefill's session only (kept)
    assert smollm2.chat([{"role": "user", "content": "Hi"}], GenerationOptions(max_tokens=2)).text is not None


def test_a_cancel_during_the_prefill_returns_at_once_and_stops_it(smollm2: Model) -> None:
    """A client that leaves while ``n`` choices share a long prefill: the server cancels every
    choice from its event loop, which must not wait for the prefill (nor let it run on)."""
    long = " ".join(["river bridge lantern harbour meadow orchard"] * 300)  # about 2,100 tokens
    choices = smollm2.chat_choices(
        [{"role": "user", "content": long}], GREEDY, n=2, tenant="cancel-in-prefill", share_prefix=False
    )
    runner = threading.Thread(target=run_all, args=(choices,))
    runner.start()
    time.sleep(0.25)  # inside the prefill (seconds long on 2 cores)
    began = time.monotonic()
    choices.cancel()
    assert time.monotonic() - began < 0.05
    runner.join(60)
    assert not runner.is_alive()
    assert all(c.reply is not None and c.reply.finish_reason == "cancelled" for c in choices)
    assert choices.prompt is not None and choices.prompt.decoded_prompt_tokens < choices.prompt.prompt_tokens


def test_closing_choices_nobody_began_decodes_nothing(smollm2: Model) -> None:
    exchanges = smollm2.memory().counters.exchanges
    choices = smollm2.chat_choices([{"role": "user", "content": "Hello there."}], GREEDY, n=3)
    choices.close()
    assert all(c.reply is None and c.session is None for c in choices) and choices.prompt is None
    assert list(choices[0]) == [] and smollm2.memory().counters.exchanges == exchanges


def test_the_messages_are_read_when_the_choices_are_made(smollm2: Model) -> None:
    """A caller that goes on editing its list (appending the next turn, say) after asking."""
    messages = [{"role": "user", "content": QUESTION}]
    choices = smollm2.chat_choices(messages, GREEDY, n=2, tenant="edited-after", share_prefix=False)
    messages.append({"role": "assistant", "content": "Polar bears."})
    replies = run_all(choices)
    prompt = len(smollm2.prompt_tokens([{"role": "user", "content": QUESTION}]))
    assert all(r.usage.prompt_tokens == prompt for r in replies)  # type: ignore[attr-defined]


def test_bad_arguments_are_refused_before_anything_decodes(smollm2: Model) -> None:
    with pytest.raises(ValueError, match="n: must be between 1 and 128"):
        smollm2.chat_choices([{"role": "user", "content": "Hi"}], n=0)
    with pytest.raises(TypeError, match="unknown session setting"):
        smollm2.chat_choices([{"role": "user", "content": "Hi"}], n=2, **{"context": 9})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="system prompt"):
        smollm2.chat_choices([{"role": "user", "content": "Hi"}], n=2, config=SessionConfig(system="x"))
    # A tenant or a conversation a call refuses, refused as the choices are made (it was at the
    # first choice iterated, and again at each of the others).
    with pytest.raises(TypeError, match="tenant must be"):
        smollm2.chat_choices([{"role": "user", "content": "Hi"}], n=2, tenant=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conversation must have"):
        smollm2.complete_choices("Hi", n=2, conversation="")


def test_a_choice_closed_before_the_forks_are_made_leaves_no_fork_open(smollm2: Model) -> None:
    """Closing one choice before any began, then running another: the closed one's fork is
    closed as soon as it is made (its cells are not held until a garbage collection)."""
    choices = smollm2.chat_choices([{"role": "user", "content": "Name a fruit."}], GREEDY, n=2)
    choices[0].close()
    with choices[1] as stream:
        for _ in stream:
            pass
    assert stream.reply is not None and stream.session is not None and stream.session.closed
    local = internals.local(smollm2)
    kept = set(local.stateless._sessions)
    assert [s for s in local.sessions if not s.closed and s not in kept] == []  # no fork left open


def test_the_bridge_refuses_a_bound_that_would_never_step() -> None:
    from llmsession import AsyncStream

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="ahead"):
            AsyncStream(lambda: iter(()), ahead=bad)  # type: ignore[arg-type, return-value]


def test_making_choices_copies_no_message_each_choice_copies_its_own(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chat_choices`` checks the messages and returns: a server calls it on its event loop,
    where copying them (a message of 300,000 parts, under 8 MiB, took 0.75 s) stalled every
    stream. Each choice makes its own copy as it starts, in its own thread; a transcript with
    nothing to answer is still refused at once."""
    from llmsession.runtime import local

    copied: list[str] = []
    real = local.split
    monkeypatch.setattr(
        local, "split", lambda t: (copied.append(threading.current_thread().name), real(t))[1]
    )
    choices = smollm2.chat_choices([{"role": "user", "content": QUESTION}], GREEDY, n=2, tenant="copies")
    assert copied == []
    replies = run_all(choices)
    assert all(replies) and len(copied) == 2 and threading.current_thread().name not in copied
    with pytest.raises(Exception, match="user message or tool results"):
        smollm2.chat_choices([{"role": "assistant", "content": ""}], GREEDY, n=2)


def test_a_choices_time_to_first_token_counts_the_prefill_it_shares(smollm2: Model) -> None:
    """A choice's time to first token runs from the choices' call, as an exchange's does from
    its own: it was the fork's alone (a one-token prefill), the prompt's decode left out, and
    the server's time-to-first-token histogram said every ``n`` request answered at once."""
    long = " ".join([QUESTION] * 12)  # (~250 tokens: its decode is most of a first token's time)
    messages = [{"role": "user", "content": long}]
    alone = smollm2.session(share_prefix=False).respond(long, GREEDY).timings
    replies = run_all(smollm2.chat_choices(messages, GREEDY, n=2, tenant="choices-ttft", share_prefix=False))
    for reply in replies:
        timings = reply.timings  # type: ignore[attr-defined]
        assert timings.time_to_first_token_s >= timings.prefill_s >= 0.5 * alone.prefill_s, (timings, alone)
        assert timings.time_to_first_token_s >= 0.5 * alone.time_to_first_token_s, (timings, alone)
