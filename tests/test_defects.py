"""Regression tests for the defects found by adversarial use of the public API (issue 13).

Each runs on the real library. Where the old code could kill the process, the probe runs in a
subprocess that must exit 0.
"""

from __future__ import annotations

import copy
import gc
import json
import signal
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import internals
import numpy as np
import pytest
from near_ties import DUMP, assert_entries_within_noise, loaded
from test_reuse import batch_noise, check_against_fresh, tolerance_for

from llmsession import (
    ContextOverflowError,
    GenerationOptions,
    Image,
    ImageError,
    Model,
    TemplateError,
)
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel, bindings

GREEDY = GenerationOptions(max_tokens=24, temperature=0)
REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter; the test asserts on its exit code and output."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        # SIGINT as a terminal would deliver it, even when this suite runs in the background of
        # a shell that ignores it (Python then never turns it into KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def generated_tokens(session: Any, reply: Any) -> list[int]:
    start = reply.usage.prompt_tokens  # (after the reply, the next prompt's opening may follow)
    return [int(t) for t in internals.record(session)[start : start + reply.usage.completion_tokens]]


# 1. penalties ------------------------------------------------------------------------------------
REPETITIVE = "Repeat exactly: the cat the cat the cat the cat the cat the cat the cat the cat"


def test_presence_penalty_forbids_every_token_in_its_window(smollm2: Model) -> None:
    plain_session = smollm2.session()
    plain = plain_session.respond(REPETITIVE, GREEDY)
    plain_tokens = generated_tokens(plain_session, plain)
    assert len(set(plain_tokens)) < len(plain_tokens), "without a penalty the reply must repeat tokens"

    session = smollm2.session()
    options = GenerationOptions(max_tokens=24, temperature=0, presence_penalty=1000.0, repeat_last_n=-1)
    reply = session.respond(REPETITIVE, options)
    tokens = generated_tokens(session, reply)
    prompt = set(internals.record(session)[: reply.usage.prompt_tokens])
    assert len(tokens) >= 16
    assert len(set(tokens)) == len(tokens), "a token present in the window was sampled again"
    assert not prompt & set(tokens), "a prompt token was sampled despite repeat_last_n=-1"
    assert session.respond("Go on.", options).usage.reused_tokens > 0, "the context was thrown away"


@pytest.mark.parametrize(
    "values",
    [
        {"repeat_penalty": 1.1},
        {"frequency_penalty": 0.5},
        {"presence_penalty": -0.5},
        {"repeat_penalty": 1.3, "repeat_last_n": 2**31 - 1},
        {"repeat_penalty": 1.3, "repeat_last_n": 0},
    ],
)
def test_every_penalty_samples(smollm2: Model, values: dict[str, Any]) -> None:
    session = smollm2.session(context_size=512)
    reply = session.respond(REPETITIVE, GenerationOptions(max_tokens=8, temperature=0.7, seed=3, **values))
    assert reply.usage.completion_tokens > 0


def test_a_repeat_penalty_changes_the_greedy_reply(smollm2: Model) -> None:
    plain = smollm2.session().respond(REPETITIVE, GREEDY).text
    penalized = smollm2.session().respond(
        REPETITIVE, GenerationOptions(max_tokens=24, temperature=0, repeat_penalty=1.5)
    )
    assert penalized.text != plain


# 2. token ids ------------------------------------------------------------------------------------
def test_bad_token_ids_raise_before_llama_cpp_sees_them(smollm2_path: Path) -> None:
    result = run_python(
        f"""
        from llmsession import Model
        from llmsession.api.model import local_model
        with Model({str(smollm2_path)!r}) as model:
            native = local_model(model).native
            n = native.n_vocab
            for bad, kind in [([n], ValueError), ([-5], ValueError), ([2**40], ValueError),
                              (["a"], TypeError), ([1.5], TypeError), ("abc", TypeError)]:
                try:
                    model.detokenize(bad)
                except kind as error:
                    assert kind is TypeError or str(bad[0]) in str(error), error
                else:
                    raise SystemExit(f"no error for {{bad}}")
            for call in (native.piece, native.is_eog, native.token_text):
                try:
                    call(n)
                except ValueError:
                    pass
                else:
                    raise SystemExit(f"no error from {{call.__name__}}")
            assert model.detokenize([n - 1, 0]) is not None
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# 3. threads sharing a model ----------------------------------------------------------------------
QUESTIONS = [
    "Name the planets of the solar system.",
    "What is the capital of Japan? Explain.",
    "List five animals that live in the sea.",
    "Describe how bread is made.",
]


def run_racing(targets: list[Callable[[], object]]) -> None:
    """Run the targets in threads at once, switching between them as often as CPython can."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target) for target in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)


def test_token_pieces_from_many_threads_are_never_mixed_up(smollm2: Model) -> None:
    """The race directly: llama_token_to_piece runs without the GIL, so a buffer shared by the
    threads gets overwritten between the call and the copy."""
    native = internals.local(smollm2).native
    tokens = list(range(0, native.n_vocab, 7))
    expected = {token: native.piece(token) for token in tokens}
    wrong: list[int] = []

    def hammer(seed: int) -> None:
        order = np.random.default_rng(seed).permutation(tokens)
        wrong.extend(int(t) for t in order if native.piece(int(t)) != expected[int(t)])

    run_racing([lambda seed=seed: hammer(seed) for seed in range(4)])
    assert wrong == []


def test_threads_sharing_a_model_get_the_sequential_replies(smollm2: Model) -> None:
    """Racing threads' streams are batched together: each reply is the sequential one, or (where
    the batch noise measured for this build tips a near-tie) every choice it made is within that
    noise of a fresh decode's best."""
    options = GenerationOptions(max_tokens=48, temperature=0)

    def ask(question: str) -> tuple[Any, Any]:
        session = smollm2.session(context_size=512)
        return session, session.respond(question, options)

    sequential = [generated_tokens(*ask(q)) for q in QUESTIONS]
    results: dict[int, tuple[Any, Any]] = {}
    run_racing([lambda i=i, q=q: results.__setitem__(i, ask(q)) for i, q in enumerate(QUESTIONS)])
    tolerance = tolerance_for(batch_noise(smollm2))
    for i, alone in enumerate(sequential):
        session, reply = results[i]
        if generated_tokens(session, reply) != alone:
            assert batch_noise(smollm2) > 0, "batched replies differ where the build is batch-exact"
            assert check_against_fresh(session, reply, tolerance, final=False, at_least=1) == []


# 4. an exception raised inside a native callback ------------------------------------------------
def test_ctrl_c_during_a_prefill_stops_it_and_propagates(smollm2_path: Path, smollm2: Model) -> None:
    result = run_python(
        f"""
        import os, signal, threading, time, copy, json
        from llmsession import Model, GenerationOptions
        GREEDY = GenerationOptions(max_tokens=8, temperature=0, logprobs=5)
        {DUMP}
        with Model({str(smollm2_path)!r}, threads=2) as model:
            session = model.session(context_size=2048, batch_size=64)
            text = " ".join(["river bridge lantern harbour meadow orchard"] * 250)
            seen = {{}}
            def interrupt():
                while session.cached_tokens < 200:
                    time.sleep(0.005)
                seen["at"] = session.cached_tokens
                seen["time"] = time.perf_counter()
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=interrupt, daemon=True).start()
            try:
                session.respond(text, GREEDY)
            except KeyboardInterrupt:
                waited = time.perf_counter() - seen["time"]
            else:
                raise SystemExit("the prefill ran to the end")
            print("positions at the signal", seen["at"], "after", session.cached_tokens, "waited", waited)
            assert session.messages == [], session.messages
            assert session.cached_tokens <= seen["at"] + 64, "more than one batch decoded after Ctrl-C"
            kept = session.cached_tokens
            reply = session.respond("Hi", GREEDY)
            fresh = model.session(context_size=2048).respond("Hi", GREEDY)
            print("SCORED", json.dumps([scored_entries(reply), scored_entries(fresh)]))
            print("kept", kept, "reused", reply.usage.reused_tokens)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Exception ignored" not in result.stderr
    assert result.stdout.strip().endswith("ok")
    reply, fresh = json.loads(result.stdout.split("SCORED ", 1)[1].splitlines()[0])
    assert_entries_within_noise(smollm2, loaded(reply), loaded(fresh))  # (their cells lie elsewhere)


def test_an_exception_in_the_log_callback_propagates(smollm2_path: Path) -> None:
    result = run_python(
        f"""
        import logging
        from llmsession import Model

        class Interrupting(logging.Handler):
            def emit(self, record):
                raise KeyboardInterrupt  # what a signal handler does inside the callback

        log = logging.getLogger("llmsession.native")
        log.setLevel(logging.INFO)
        log.addHandler(Interrupting())
        log.propagate = False
        try:
            Model({str(smollm2_path)!r})
        except KeyboardInterrupt:
            print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "Exception ignored" not in result.stderr
    assert result.stdout.strip() == "ok"


# 5. images are copied ----------------------------------------------------------------------------
def test_an_image_owns_its_pixels() -> None:
    array = np.full((8, 8, 3), 200, dtype=np.uint8)
    image = Image(array)
    digest = image.digest
    array[:] = 7
    assert int(image.pixels.max()) == 200
    assert Image(image.pixels).digest == digest
    with pytest.raises(ValueError):
        image.pixels[0, 0, 0] = 1


def test_a_reused_image_buffer_is_never_answered_from_the_stale_cache(
    smollm2_path: Path, fixture_path: Callable[[str], Path]
) -> None:
    import PIL.Image
    from test_images import last_logits
    from test_reuse import tolerance_for

    with Model(smollm2_path, mmproj_path=fixture_path("mmproj-tiny.gguf"), threads=2) as vision:
        with (
            PIL.Image.open(fixture_path("image-red.png")) as red,
            PIL.Image.open(fixture_path("image-blue.png")) as blue,
        ):
            red_pixels, blue_pixels = np.asarray(red.convert("RGB")), np.asarray(blue.convert("RGB"))
        buffer = red_pixels.copy()
        first = Image(buffer)
        session = vision.session()
        one = GenerationOptions(max_tokens=1, temperature=0)
        session.respond(["Describe:", first], one)
        buffer[:] = blue_pixels  # the caller reuses its array for the next picture
        for content in (["Describe:", Image(buffer)], ["Describe:", first]):
            before = copy.deepcopy(session.messages)
            reply = session.respond(content, one)
            fresh = vision.session()
            fresh.messages = before
            fresh.respond(content, one)
            difference = float(np.abs(last_logits(session) - last_logits(fresh)).max())
            assert difference <= tolerance_for(0.0), f"cached logits differ by {difference:.2f}"
            assert reply.usage.reused_tokens < reply.usage.prompt_tokens


# 6. lifetimes ------------------------------------------------------------------------------------
def test_dropped_sessions_free_their_memory_without_the_cyclic_gc(smollm2: Model) -> None:
    gc.collect()
    gc.disable()
    try:
        before = {s.key for s in smollm2.memory().sessions}
        for _ in range(4):
            session = smollm2.session(context_size=2048)
            session.respond("Hi", GenerationOptions(max_tokens=2, temperature=0))
            assert smollm2.memory().sessions[-1].state == "live"
            del session
        assert {s.key for s in smollm2.memory().sessions} == before
    finally:
        gc.enable()


def test_sessions_dropped_before_their_first_seat_do_not_pile_up(smollm2: Model) -> None:
    """A collected session's place is freed at the engine's next safe point: a seat, or
    ``memory()``, not a new session's lease. Sessions refused before a seat (a prompt too long)
    and dropped kept theirs, each one scanned by every later placement, until some exchange."""
    before = internals.leases(smollm2)
    for _ in range(50):
        session = smollm2.session(context_size=256)
        with pytest.raises(ContextOverflowError):
            session.respond("word " * 400, GenerationOptions(max_tokens=1))
        del session
    assert internals.leases(smollm2) <= before + 1  # (the last one's, freed by the next lease)


def test_a_context_keeps_its_model_alive(smollm2_path: Path) -> None:
    native = NativeModel(smollm2_path)
    model_ref = weakref.ref(native)
    context = NativeContext(native, n_ctx=256, n_batch=64, threads=2)
    tokens = native.tokenize("Hello there", add_special=True)
    del native
    gc.collect()
    assert model_ref() is not None, "the model was freed under its context"
    context.decode(tokens, 0)
    assert bindings()[0].llama_get_logits_ith(context.ptr, -1) != bindings()[1].NULL
    del context
    gc.collect()
    assert model_ref() is None


# 8. typed errors for bad input -------------------------------------------------------------------
def test_out_of_range_numbers_are_value_errors_up_front(smollm2_path: Path, smollm2: Model) -> None:
    with pytest.raises(ValueError, match="gpu_layers"):
        Model(smollm2_path, gpu_layers=2**31)
    with pytest.raises(ValueError, match="threads"):
        Model(smollm2_path, threads=2**31)
    with pytest.raises(TypeError, match="threads"):
        Model(smollm2_path, threads=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_size"):
        smollm2.session(context_size=2**32)
    with pytest.raises(ValueError, match="batch_size"):
        smollm2.session(batch_size=2**32)
    for field in ("top_k", "repeat_last_n", "max_tokens"):
        with pytest.raises(ValueError, match=field):
            GenerationOptions(**{field: 2**31})  # type: ignore[arg-type]


def test_bad_transcripts_and_options_are_typed_errors_before_decoding(smollm2: Model) -> None:
    session = smollm2.session()
    session.messages = ["x"]  # type: ignore[list-item]
    with pytest.raises(TemplateError, match="message 0"):
        session.respond("Hi", GREEDY)
    session.messages = [{"role": "user"}]
    with pytest.raises(TemplateError):
        session.respond("Hi", GREEDY)
    session.messages = []
    with pytest.raises(TypeError, match="GenerationOptions"):
        session.respond("Hi", {"max_tokens": 4})  # type: ignore[arg-type]
    assert session.messages == [] and session.cached_tokens == 0
    with pytest.raises(ValueError, match="stop"):
        GenerationOptions(stop=5)  # type: ignore[arg-type]
    for name, bad in [("max_tokens", -1), ("top_k", 2**31), ("stop", ("",))]:  # (found by the fuzzer)
        forced = GenerationOptions(max_tokens=3)
        object.__setattr__(forced, name, bad)  # (frozen, yet forced: refused before anything runs)
        for call in (session.respond, session.stream):
            with pytest.raises(ValueError, match=f"GenerationOptions.{name}"):
                call("Hi", forced)
        with pytest.raises(ValueError, match=f"GenerationOptions.{name}"):
            smollm2.chat([{"role": "user", "content": "Hi"}], forced)
    assert session.messages == [] and session.cached_tokens == 0


# Found by feeding PIL random bodies behind each format's magic: DDS raised NotImplementedError,
# ICNS SyntaxError.
HOSTILE_IMAGES = [
    b"DDS |\x00\x00\x00\xb7\x00\xef\x00\x00B\x00\xa0\x00\x00\x00o\x96\xf2\x00\x00\x00\x00\x008\x00\x00"
    b"_\x00[\xf8\xc2\x00\xe3\x82\x1e\xa2\x00\x00\x0b,\x1ed\x00\x004\x00\x00\xcb\x00\x00\x00a\x00+\xc6"
    b"\x00\x0ec\xd7\x00\x00\x00\x8d\xa0\xe9\x00\xab\x86\x00\xd6\x00\x00\x00\x04\x00\xbc\x00\xe4\xfdJm"
    b"\x00\xa6\xb7b\x00\x00\x00\xc1\x00\xd4h\x00\xd7Z\x00\xac\x00\xf0\xd8\x00\x00\x00v\x00\x02\xe58"
    b"\x00\xb7\x00\xb1\x00\x00[\x00\x00\x00\xdb]\x00\x00\xe4T",
    b"icns\x00\x00\x00&it32\x00\x00\x00\x1e\x94#UQ\x82V\x8b\x96\xe8\xa4\xfe\xf2:\x0c\x9f\xc5\xaf\xd7`\x847\x81",
]


@pytest.mark.parametrize("data", HOSTILE_IMAGES)
def test_hostile_image_bytes_raise_image_error(data: bytes) -> None:
    with pytest.raises(ImageError):
        Image(data)


# 9. context_size bounds the session --------------------------------------------------------------
@pytest.mark.parametrize("which", ["smollm2", "gemma3", "mamba"])
def test_context_size_is_the_bound_the_user_asked_for(
    which: str, smollm2_path: Path, gemma3_path: Path, fixture_path: Callable[[str], Path]
) -> None:
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path, "mamba": fixture_path("mamba-tiny.gguf")}
    with Model(path[which], threads=2) as model:
        session = model.session(context_size=32)
        reply = session.respond("Hi", GenerationOptions(max_tokens=200, temperature=0.8, seed=1))
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 32
        assert session.cached_tokens <= 32
        if reply.finish_reason == "length":
            assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 32
        before = copy.deepcopy(session.messages)
        try:
            session.respond("And then?", GenerationOptions(max_tokens=200, temperature=0))
        except ContextOverflowError:
            assert session.messages == before
        assert session.cached_tokens <= 32
