"""Encoder-decoder models (the T5 fixture): each exchange encodes its whole prompt in a context of
its own and decodes from the decoder's start token; streaming, cancelling and errors behave as
for any model, and nothing reaches llama.cpp that would abort the process."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import internals
import pytest

from llmsession import ContextOverflowError, GenerationOptions, Model, UnsupportedFeatureError
from llmsession.engine.seat import Seat

GREEDY = GenerationOptions(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def t5(fixture_path: Callable[[str], Path]) -> Iterator[Model]:
    with Model(fixture_path("t5-tiny.gguf"), threads=2) as model:
        assert internals.local(model).native.has_encoder and internals.local(model).native.has_decoder
        yield model


def test_respond_and_stream_agree_and_a_second_exchange_works(t5: Model) -> None:
    session = t5.session(system="You are a helpful assistant.")
    first = session.respond("Hello there, who are you?", GREEDY)
    assert first.usage.completion_tokens == 16 and first.text
    assert first.usage.decoded_prompt_tokens == first.usage.prompt_tokens
    twin = t5.session(system="You are a helpful assistant.")
    stream = twin.stream("Hello there, who are you?", GREEDY)
    snapshots = list(stream)
    assert stream.reply is not None and stream.reply.text == first.text == snapshots[-1].text
    second = session.respond("And what can you do?", GREEDY)
    assert second.usage.reused_tokens == 0 and second.usage.prompt_tokens > first.usage.prompt_tokens
    fresh = t5.session()
    fresh.messages = copy.deepcopy(session.messages[:-2])
    assert fresh.respond("And what can you do?", GREEDY).text == second.text
    assert session.cached_tokens == 0  # its context lived for one exchange


def test_the_encoded_prompt_decides_the_reply(t5: Model) -> None:
    replies = {t5.session().respond(q, GREEDY).text for q in ("Hello", "Tell me about rivers", "Bye now")}
    assert len(replies) == 3


def test_cancel_while_generating_and_while_encoding(t5: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    session = t5.session()
    stream = session.stream("Count to ten.", GenerationOptions(max_tokens=64, temperature=0))
    for _ in stream:
        stream.cancel()
    assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
    assert stream.reply.usage.completion_tokens == 1

    encode = Seat.encode

    def cancelled_mid_graph(seat: Seat, tokens: Any) -> None:
        seat.cancelled.set()  # as Stream.cancel() from another thread during the encoder's graph
        encode(seat, tokens)

    monkeypatch.setattr(Seat, "encode", cancelled_mid_graph)
    reply = session.respond("A question cancelled while it is encoded.", GREEDY)
    monkeypatch.undo()
    assert reply.finish_reason == "cancelled" and reply.text == ""
    assert session.respond("Still there?", GREEDY).usage.completion_tokens == 16


def test_a_prompt_past_the_context_is_refused_before_it_encodes(t5: Model) -> None:
    session = t5.session(context_size=32)
    with pytest.raises(ContextOverflowError):
        session.respond("word " * 64, GREEDY)
    assert session.respond("Hi", GenerationOptions(max_tokens=4, temperature=0)).usage.completion_tokens == 4


def test_stateless_chat_and_fork(t5: Model) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    assert t5.chat(messages, GREEDY).text == t5.session().respond("Hello", GREEDY).text
    session = t5.session()
    session.respond("Hello", GREEDY)
    assert session.fork().respond("More?", GREEDY).text == session.respond("More?", GREEDY).text


def test_an_encoder_model_with_a_projector_is_refused(fixture_path: Callable[[str], Path]) -> None:
    with pytest.raises(UnsupportedFeatureError, match="images"):
        Model(fixture_path("t5-tiny.gguf"), mmproj_path=fixture_path("mmproj-tiny.gguf"))


def test_closing_the_engine_closes_an_exchange_s_own_context_under_its_gate(
    fixture_path: Callable[[str], Path],
) -> None:
    """An exchange's own context is the engine's to close: freed only by the model's close, which
    does not take the gate, it was freed under a step that a session missed by the close (made as
    it began) was decoding in it (a use-after-free). Closed by the engine, its next step is a
    ModelClosedError."""
    import threading

    from llmsession import ModelClosedError

    with Model(fixture_path("t5-tiny.gguf"), threads=1) as model:
        engine = internals.local(model).engine
        lease = engine.lease(swa_full=True, batch_size=64)
        with engine.single_use(lease, 64, threading.Event()) as seat:
            seat.encode(model.tokenize("Hello there", add_special=False))
            engine.close()
            assert seat.context.closed
            with pytest.raises(ModelClosedError):
                seat.encode(model.tokenize("Hello", add_special=False))
