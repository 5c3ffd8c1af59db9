"""Every decode of a model goes through its one loop (``engine.batching``): prompt chunks, forced
tokens and anticipated openings as stretches of tokens, generation steps with or without drafts,
and the work that decodes by itself (an image's embeddings, an encoder pass) as units of their
own; nothing reaches ``llama_decode``, ``llama_encode`` or libmtmd any other way. An image that
arrives while streams generate is decoded by the loop between their steps, and every reply
still answers as a fresh decode does; an image that fails fails alone."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from near_ties import assert_same_within_noise, scored
from test_mixed_batches import streams_and_an_arrival
from test_reuse import batch_noise, check_against_fresh, tolerance_for

from llmsession import GenerationOptions, Image, Model, NativeError, Session
from llmsession.engine.batching import Batcher
from llmsession.engine.work import Step
from llmsession.native.context import NativeContext
from llmsession.native.projector import Projector

GREEDY = GenerationOptions(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def vision(smollm2_path: Path, fixture_path: Callable[[str], Path]) -> Iterator[Model]:
    with Model(smollm2_path, mmproj_path=fixture_path("mmproj-tiny.gguf"), threads=2) as model:
        yield model


@pytest.fixture(scope="module")
def t5(fixture_path: Callable[[str], Path]) -> Iterator[Model]:
    with Model(fixture_path("t5-tiny.gguf"), threads=2) as model:
        yield model


@pytest.fixture(scope="module")
def red(fixture_path: Callable[[str], Path]) -> Image:
    return Image(fixture_path("image-red.png"))


class Doors:
    """What reaches the loop (each step's kind, and on which thread the loop decoded it), and
    any native decode that did not come through it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kinds: list[str] = []
        self.native_threads: list[str] = []
        self.bypassed: list[str] = []
        self._inside = threading.local()
        run, decode, native = Batcher.run, Batcher._decode, Batcher._native

        def recording(batcher: Batcher, step: Step) -> int:
            self.kinds.append(kind(step))
            return run(batcher, step)

        def decoding(batcher: Batcher, *args: Any, **kwargs: Any) -> None:
            with self.inside():
                decode(batcher, *args, **kwargs)

        def natively(context: NativeContext, step: Step) -> None:
            self.native_threads.append(threading.current_thread().name)
            native(context, step)

        monkeypatch.setattr(Batcher, "run", recording)
        monkeypatch.setattr(Batcher, "_decode", decoding)
        monkeypatch.setattr(Batcher, "_native", staticmethod(natively))
        for owner, name in (
            (NativeContext, "decode"),
            (NativeContext, "decode_many"),
            (NativeContext, "encode"),
        ):
            monkeypatch.setattr(owner, name, self.guarded(name, getattr(owner, name)))
        monkeypatch.setattr(Projector, "eval_image", self.guarded("eval_image", Projector.eval_image))

    def inside(self) -> Any:
        doors = self

        class Inside:
            def __enter__(self) -> None:
                doors._inside.depth = getattr(doors._inside, "depth", 0) + 1

            def __exit__(self, *_exc: object) -> None:
                doors._inside.depth -= 1

        return Inside()

    def guarded(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*args: Any, **kwargs: Any) -> Any:
            if not getattr(self._inside, "depth", 0):
                self.bypassed.append(name)
            return call(*args, **kwargs)

        return checked


def kind(step: Step) -> str:
    if step.native is not None:
        return "native"
    if step.prompt:
        return "tokens"
    return "drafted step" if step.drafts else "step"


def test_every_kind_of_decode_goes_through_the_one_loop(
    smollm2: Model, vision: Model, t5: Model, red: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    doors = Doors(monkeypatch)
    copy = "Repeat exactly: the lantern on the old tower burns all night, the lantern on the old tower."
    drafted = smollm2.session(share_prefix=False).respond(
        copy, GenerationOptions(max_tokens=30, temperature=0, draft="prompt_lookup")
    )
    text, doors.kinds = doors.kinds, []
    pictured = vision.session().respond(["Describe:", red], GREEDY)
    image, doors.kinds = doors.kinds, []
    encoded = t5.session().respond("Hello there, who are you?", GREEDY)
    monkeypatch.undo()
    assert drafted.usage.drafted_tokens > 0 and pictured.text and encoded.text
    assert {"tokens", "drafted step"} <= set(text)  # the prompt, the drafted steps
    assert {"tokens", "native", "step"} <= set(image)  # "Describe:", the image, the reply
    assert {"native", "tokens", "step"} <= set(doors.kinds)  # the encoder's pass, the decoder's start
    assert doors.bypassed == [], f"decoded outside the loop: {doors.bypassed}"


def test_an_image_arriving_mid_stream_is_decoded_by_the_loop_and_every_reply_equals_fresh(
    vision: Model, red: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    doors = Doors(monkeypatch)
    sessions, replies = streams_and_an_image(vision, red)
    monkeypatch.undo()
    assert doors.bypassed == []
    assert "llmsession-decode" in doors.native_threads, "the image was not decoded between the streams' steps"
    tolerance = tolerance_for(batch_noise(vision))
    for session, reply in zip(sessions[:2], replies[:2], strict=True):
        assert check_against_fresh(session, reply, tolerance, final=False) == []
    alone = vision.session(share_prefix=False).respond(["Describe:", red], scored(GREEDY))
    assert_same_within_noise(vision, replies[2], alone)


def test_an_image_that_fails_mid_stream_fails_alone(
    vision: Model, red: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant with a fault: the image's evaluation fails in the loop; the streams beside it
    answer as fresh decodes do, and the session that sent it answers its next turn."""
    evaluate = Projector.eval_image

    def failing(projector: Projector, context: NativeContext, *args: Any, **kwargs: Any) -> int:
        if threading.current_thread().name == "llmsession-decode":
            raise NativeError("evaluating an image chunk failed (injected)")
        return int(evaluate(projector, context, *args, **kwargs))

    monkeypatch.setattr(Projector, "eval_image", failing)
    sessions, replies = streams_and_an_image(vision, red)
    monkeypatch.undo()
    assert isinstance(replies[2], NativeError), replies[2]
    tolerance = tolerance_for(batch_noise(vision))
    for session, reply in zip(sessions[:2], replies[:2], strict=True):
        assert check_against_fresh(session, reply, tolerance, final=False) == []
    again = sessions[2].respond(["Describe:", red], scored(GREEDY))
    assert_same_within_noise(
        vision, again, vision.session(share_prefix=False).respond(["Describe:", red], scored(GREEDY))
    )


def streams_and_an_image(model: Model, image: Image) -> tuple[list[Session], list[Any]]:
    """Two streams generating; once both have replied a few tokens, an image prompt arrives in a
    third session (its reply scored, or the error it raised)."""
    sessions = [model.session(share_prefix=False) for _ in range(3)]

    def arrive(session: Session) -> Any:
        try:
            return session.respond(["Describe:", image], scored(GREEDY))
        except NativeError as error:
            return error

    return sessions, streams_and_an_arrival(sessions, arrive)
