"""Sessions and live streaming on the real library (SmolLM2-135M-Instruct; Gemma 3 where noted)."""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import internals
import pytest
from llama_cffi import abort_check
from near_ties import assert_same_within_noise, scored

from llmsession import (
    ContextOverflowError,
    GenerationOptions,
    Model,
    ModelLoadError,
    Reply,
    SessionBusyError,
    SessionConfig,
    TemplateError,
    Transcript,
)
from llmsession.native.context import NativeContext
from llmsession.text.detokenize import IncrementalDetokenizer

GREEDY = GenerationOptions(max_tokens=24, temperature=0)


def test_respond_and_stream_agree_at_temperature_zero(smollm2: Model) -> None:
    a = smollm2.session(system="You are terse.").respond("Name three colours.", scored(GREEDY))
    stream = smollm2.session(system="You are terse.").stream("Name three colours.", scored(GREEDY))
    deltas = [snap.delta for snap in stream]
    assert stream.reply is not None
    assert stream.reply.text == "".join(deltas)
    assert_same_within_noise(smollm2, stream.reply, a)  # (the two sessions' cells lie elsewhere)
    if stream.reply.text == a.text:
        assert a.usage == stream.reply.usage
    assert a.text.strip()


def test_a_fixed_seed_reproduces_a_sampled_reply(smollm2: Model) -> None:
    sampled = GenerationOptions(max_tokens=24, temperature=1.2, top_k=100, top_p=1.0, min_p=0.0, seed=1234)
    first = smollm2.session().respond("Tell me a story.", sampled).text
    second = smollm2.session().respond("Tell me a story.", sampled).text
    other = smollm2.session().respond(
        "Tell me a story.", GenerationOptions(**{**sampled.__dict__, "seed": 99})
    )
    assert first == second
    assert other.text != first


def test_snapshots_arrive_while_generation_is_still_running(smollm2: Model) -> None:
    session = smollm2.session()
    stream = session.stream(
        "Count from one to twenty in words.", GenerationOptions(max_tokens=40, temperature=0)
    )
    positions, texts = [], []
    for snap in stream:
        positions.append(session.cached_tokens)  # what the context has decoded so far
        texts.append(snap.text)
    assert stream.reply is not None
    assert len(positions) > 10
    assert positions[0] < positions[-1], "the first snapshot must come before the later tokens decode"
    assert positions == sorted(positions)
    assert texts[-1] == stream.reply.text
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))


def multi_token_characters(model: Model) -> list[str]:
    """Characters that SmolLM2's byte-level vocabulary splits across several tokens."""
    found = []
    for char in "🦙🐍🧪㊗𝔘ꙮ":
        pieces = [internals.local(model).native.piece(t) for t in model.tokenize(char, add_special=False)]
        if len(pieces) > 1 and any(_invalid_alone(p) for p in pieces):
            found.append(char)
    return found


def _invalid_alone(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_split_characters_never_show_replacement_characters(smollm2: Model) -> None:
    chars = multi_token_characters(smollm2)
    assert chars, "no multi-token character found: the test would prove nothing"
    text = "llama " + "".join(chars) + " done"
    detokenizer = IncrementalDetokenizer()
    seen = ""
    for token in smollm2.tokenize(text, add_special=False):
        seen += detokenizer.push(internals.local(smollm2).native.piece(token))
        assert "\ufffd" not in seen
    assert seen + detokenizer.flush() == text


def test_generated_emoji_stream_without_replacement_characters(smollm2: Model) -> None:
    session = smollm2.session(system="Repeat the user's message exactly.")
    prompt = "Say: 🦙🦙🦙 🐍🐍🐍"
    stream = session.stream(prompt, GenerationOptions(max_tokens=30, temperature=0))
    snapshots = [snap.text for snap in stream]
    assert stream.reply is not None
    split = [c for c in set(stream.reply.text) if c in multi_token_characters(smollm2)]
    assert split, f"the model did not emit a multi-token character: {stream.reply.text!r}"
    assert not any("\ufffd" in text for text in snapshots)


def test_stop_strings_cut_exactly(smollm2: Model) -> None:
    question = "Count from one to ten in words, separated by commas."
    full = smollm2.session().respond(question, GenerationOptions(max_tokens=40, temperature=0)).text
    assert len(full) >= 12, full
    stop = full[len(full) // 2 : len(full) // 2 + 5]  # likely to straddle a token boundary
    stopped = smollm2.session().stream(question, GenerationOptions(max_tokens=40, temperature=0, stop=[stop]))
    deltas = [snap.delta for snap in stopped]
    assert stopped.reply is not None
    assert stopped.reply.text == full[: full.index(stop)]
    assert "".join(deltas) == stopped.reply.text
    assert stopped.reply.finish_reason == "stop"


def test_end_of_generation_tokens_never_appear(smollm2: Model) -> None:
    reply = smollm2.session().respond("Say hi.", GenerationOptions(max_tokens=64, temperature=0))
    assert reply.finish_reason == "stop"
    assert "<|im_end|>" not in reply.text and "<|endoftext|>" not in reply.text


def test_length_finish_reason(smollm2: Model) -> None:
    reply = smollm2.session().respond(
        "Write a long essay about rivers.", GenerationOptions(max_tokens=5, temperature=0)
    )
    assert reply.finish_reason == "length"
    assert reply.usage.completion_tokens == 5


def test_cancel_mid_generation_stops_within_one_token(smollm2: Model) -> None:
    session = smollm2.session()
    stream = session.stream(
        "Write a long essay about rivers.", GenerationOptions(max_tokens=200, temperature=0)
    )
    for i, _snap in enumerate(stream):
        if i == 4:
            at_cancel = session.cached_tokens
            canceller = threading.Thread(target=stream.cancel)
            canceller.start()
            canceller.join()  # cancelled from another thread before the next step
    assert stream.reply is not None
    assert stream.reply.finish_reason == "cancelled"
    assert session.cached_tokens <= at_cancel + 1
    assert session.messages[-1] == {"role": "assistant", "content": stream.reply.text}
    again = session.respond("Summarise that in three words.", GenerationOptions(max_tokens=12, temperature=0))
    assert again.finish_reason in ("stop", "length") and again.text


def test_break_and_drop_stop_decoding(smollm2: Model) -> None:
    session = smollm2.session()
    for i, _snap in enumerate(
        session.stream("Write a long essay about rivers.", GenerationOptions(max_tokens=200))
    ):
        if i == 2:
            break
    # the for loop held the only reference: the stream is finished as cancelled and recorded
    assert session.messages[-1]["role"] == "assistant"
    held = session.cached_tokens  # nothing decodes in the background: the break ended the exchange
    reply = session.respond("Thanks.", GenerationOptions(max_tokens=8, temperature=0))
    assert reply.text and reply.usage.reused_tokens >= held - 1  # the cancelled reply stayed cached


def test_close_keeps_what_was_generated(smollm2: Model) -> None:
    session = smollm2.session()
    with session.stream("Write a long essay about rivers.", GenerationOptions(max_tokens=200)) as stream:
        first = next(stream)
    assert stream.reply is not None
    assert stream.reply.finish_reason == "cancelled"
    assert stream.reply.text == first.text
    assert session.messages[-1]["content"] == first.text


def long_prompt(model: Model, n_tokens: int) -> str:
    words = [
        "the",
        "river",
        "flows",
        "past",
        "the",
        "old",
        "mill",
        "and",
        "under",
        "the",
        "stone",
        "bridge",
        "toward",
        "the",
        "sea",
    ]
    text, i = "", 0
    while len(model.tokenize(text, add_special=False)) < n_tokens:
        text += " ".join(words[j % len(words)] for j in range(i, i + 200)) + " "
        i += 200
    return text


@pytest.mark.parametrize("thread", ["main", "worker"])
def test_cancel_during_a_long_prefill_stops_inside_the_batch_in_flight(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch, thread: str
) -> None:
    """cancel() from another thread 20 ms into a 128-token batch (which takes far longer): the
    abort callback stops that batch, so nothing after the cancel is recorded. Were the check
    between batches all there is, the batch would finish and 128 more tokens would count. On the
    main thread the check is a Python callback (a Ctrl-C raises there); on any other it is the
    native one, which reads the cancel flag's word without the GIL."""
    prompt = long_prompt(smollm2, 600)
    session = smollm2.session(context_size=2048, batch_size=128, share_prefix=False)  # all to decode
    stream = session.stream(prompt, GenerationOptions(max_tokens=8, temperature=0))
    at_cancel: list[int] = []
    checks: set[str] = set()
    decode_many = NativeContext.decode_many  # (every decode goes through it: ``batching``)

    def cancelled_into(self: NativeContext, *args: Any, **kwargs: Any) -> list[int]:
        if not at_cancel and session.cached_tokens >= 300:
            at_cancel.append(session.cached_tokens)
            threading.Timer(0.02, stream.cancel).start()
        rows = decode_many(self, *args, **kwargs)
        installed = self._abort_installed
        checks.add("native" if installed and installed[0] == abort_check() else "python")
        return rows

    monkeypatch.setattr(NativeContext, "decode_many", cancelled_into)
    snapshots: list[Any] = []
    if thread == "main":
        snapshots = list(stream)
    else:
        worker = threading.Thread(target=lambda: snapshots.extend(stream))
        worker.start()
        worker.join()
    assert checks == {"python" if thread == "main" else "native"}
    assert stream.reply is not None
    assert snapshots == []
    assert stream.reply.finish_reason == "cancelled"
    assert stream.reply.usage.prompt_tokens >= 600
    (held,) = at_cancel
    assert stream.reply.usage.decoded_prompt_tokens == held  # the batch in flight left no trace
    assert session.cached_tokens == held
    monkeypatch.undo()
    after = session.respond("Hello!", GenerationOptions(max_tokens=8, temperature=0))
    assert after.text


def test_a_session_used_from_two_threads_raises_busy(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    session = smollm2.session()
    stream = session.stream(long_prompt(smollm2, 1500), GenerationOptions(max_tokens=4, temperature=0))
    errors: list[BaseException] = []
    inside, tried, decode_many = threading.Event(), threading.Event(), NativeContext.decode_many

    def held(self: NativeContext, *args: Any, **kwargs: Any) -> list[int]:
        rows = decode_many(self, *args, **kwargs)
        inside.set()
        assert tried.wait(60)  # the exchange stays open until the other thread has tried
        return rows

    monkeypatch.setattr(NativeContext, "decode_many", held)
    worker = threading.Thread(target=list, args=(stream,))
    worker.start()
    assert inside.wait(60)
    try:
        session.respond("Hi", GenerationOptions(max_tokens=2))
    except SessionBusyError as error:
        errors.append(error)
    stream.cancel()  # the rest of the prefill is not this test's business
    tried.set()
    worker.join()
    assert errors, "a second thread must get SessionBusyError"


def test_a_stream_dropped_in_one_thread_is_finished_before_another_threads_call(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream dropped mid-reply is finished by its finalizer in the thread that dropped it,
    outside the session's guard; a call from another thread meanwhile waits for that to end
    (the reply recorded) instead of starting without it (a prompt missing that turn, and the
    transcript out of order). The finishing is slowed here to make the race certain."""
    import llmsession.runtime.exchange as exchange

    unhold = exchange.unhold  # (``engine.drafting``'s, as the exchange imports it)

    def slow_unhold(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "dropper":
            threading.Event().wait(0.5)
        unhold(*args, **kwargs)

    monkeypatch.setattr(exchange, "unhold", slow_unhold)
    session = smollm2.session("Be brief.")
    options = GenerationOptions(max_tokens=4, temperature=0)
    dropped = threading.Event()

    def drop() -> None:
        stream = session.stream("hi", options)
        next(stream)
        dropped.set()
        del stream  # (finished here, by its finalizer)

    dropper = threading.Thread(target=drop, name="dropper")
    dropper.start()
    assert dropped.wait(60)
    threading.Event().wait(0.1)
    reply = session.respond("yo", options)
    dropper.join()
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["hi", "yo"], session.messages
    assert session.messages[-1]["content"] == reply.text


def test_a_kept_session_whose_dropped_stream_is_finishing_is_not_taken(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stateless variant: while a dropped ``chat_stream``'s finishing runs in the thread
    that dropped it, its kept session is not idle, so another thread's call does not take it
    (it set the session's history, then the finishing appended the old turn to it). The
    finishing is slowed where the reply is recorded: the exchange is done, the transcript not."""
    from llmsession.runtime.core import ModelCore

    remember = ModelCore.remember_reply

    def slow_remember(self: ModelCore, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "dropper":
            threading.Event().wait(0.5)
        return remember(self, *args, **kwargs)

    monkeypatch.setattr(ModelCore, "remember_reply", slow_remember)
    options = GenerationOptions(max_tokens=4, temperature=0)
    said = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    dropped = threading.Event()

    def drop() -> None:
        stream = smollm2.chat_stream(said, options, tenant="dropping", conversation="c")
        next(stream)
        dropped.set()
        del stream

    dropper = threading.Thread(target=drop, name="dropper")
    dropper.start()
    assert dropped.wait(60)
    threading.Event().wait(0.1)
    reply = smollm2.chat(said, options, tenant="dropping", conversation="c")
    dropper.join()
    taken = smollm2.take_conversation("c")
    assert taken is not None
    session, _ = taken
    try:
        assert [m["content"] for m in session.messages] == ["Be brief.", "hi", reply.text], session.messages
    finally:
        session.close()


def test_a_stream_a_garbage_collection_drops_is_finished_in_a_thread_of_its_own(smollm2: Model) -> None:
    """A stream kept alive by a reference cycle is freed by the cyclic collector, in whichever
    thread allocates then: here one holding the lock where replies are recorded, which the
    finishing takes (it waited on itself forever). The finishing now runs elsewhere; the
    session's next call waits for it, and the cut reply is in the transcript. Run in a thread
    of its own, so a hang fails the test instead of hanging it."""
    session, options = smollm2.session("Be brief."), GenerationOptions(max_tokens=8, temperature=0)
    lock, outcome = internals.local(smollm2).replies._lock, list[object]()

    def drop() -> None:
        stream = session.stream("hi", options)
        next(stream)
        stream.cycle = stream  # type: ignore[attr-defined]  # (what a kept traceback does)
        gc.disable()  # (no collection frees it before the one under the lock)
        try:
            del stream
            with lock:  # (a thread inside ``ReplyTokens.remember`` when the collector runs)
                gc.collect()
        finally:
            gc.enable()
        outcome.append("collected")

    dropper = threading.Thread(target=drop, daemon=True)
    dropper.start()
    dropper.join(30)
    assert outcome == ["collected"], "the collection waited on a lock its own thread held"
    reply = session.respond("yo", options)
    roles = [(m["role"], m["content"]) for m in session.messages]
    assert [content for role, content in roles if role == "user"] == ["hi", "yo"], roles
    assert roles[-1] == ("assistant", reply.text) and roles[-3][0] == "assistant", roles


def test_a_session_collected_with_its_stream_lives_until_the_stream_has_finished(
    smollm2: Model, caplog: pytest.LogCaptureFixture
) -> None:
    """Collected in one pass with its unfinished stream, a session went at once, its lease
    freed by the next seat (another session's exchange) while the stream's queued finishing
    still held a seat of it; it lives until that finishing has run, and nothing fails."""
    import weakref

    from llmsession.runtime import dropped

    options = GenerationOptions(max_tokens=8, temperature=0)
    session = smollm2.session("Be brief.")
    stream = session.stream("hi", options)
    next(stream)
    stream.cycle = stream  # type: ignore[attr-defined]
    gone, hold, ended = weakref.ref(session), threading.Event(), stream.ended  # type: ignore[attr-defined]
    dropped._jobs.put(hold.wait)  # (the reaper's turn comes only when the test says)
    gc.disable()
    try:
        del stream, session
        gc.collect()
    finally:
        gc.enable()
    try:
        assert gone() is not None, "the session went before its stream's finishing ran"
        other = smollm2.session("Be brief.").respond("hello", options)  # (a seat: the engine reaps)
    finally:
        hold.set()
    assert ended.wait(30) and other.text and "failed to finish" not in caplog.text
    deadline = time.monotonic() + 10  # (the reaper lets go of it once its finishing has run)
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert gone() is None, "the reaper kept the session alive after its stream had finished"


def test_two_sessions_in_two_threads_run_concurrently(smollm2: Model) -> None:
    """Each reply equals a lone session's within the measured noise (their cells lie elsewhere,
    and the two threads' steps may be decoded in one batch)."""
    results: dict[int, Reply] = {}
    options = scored(GenerationOptions(max_tokens=16, temperature=0))
    expected = smollm2.session(share_prefix=False).respond("Name a fruit.", options)

    def chat(i: int) -> None:  # (apart: one sharing the other's prompt would decode other batches)
        results[i] = smollm2.session(share_prefix=False).respond("Name a fruit.", options)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1]
    for reply in results.values():
        assert_same_within_noise(smollm2, reply, expected)


# -- errors, each from a real trigger ---------------------------------------------------------
def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        Model(tmp_path / "nope.gguf")


def test_directory_instead_of_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        Model(tmp_path)


def test_non_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("just some text, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(path)


@pytest.mark.parametrize("keep", [4, 1000, 3_000_000, 60_000_000])
def test_truncated_gguf(tmp_path: Path, smollm2_path: Path, keep: int) -> None:
    path = tmp_path / "truncated.gguf"
    with smollm2_path.open("rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(ModelLoadError):
        Model(path)


@pytest.mark.parametrize("offset", [8, 16, 24, 200])
def test_corrupt_gguf_header(tmp_path: Path, smollm2_path: Path, offset: int) -> None:
    data = bytearray(smollm2_path.read_bytes()[:2_000_000])
    data[offset : offset + 8] = b"\xff" * 8
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError):
        Model(path)


def test_prompt_longer_than_the_context(smollm2: Model) -> None:
    session = smollm2.session(context_size=64)
    with pytest.raises(ContextOverflowError):
        session.respond(long_prompt(smollm2, 100))
    assert session.messages == []
    reply = session.respond("Hi", GenerationOptions(max_tokens=4, temperature=0))
    assert reply.text and reply.usage.prompt_tokens <= 64 and reply.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("temperature", -1.0), ("top_k", -3), ("top_p", 0.0), ("min_p", 2.0),
     ("repeat_penalty", 0.0), ("repeat_last_n", -5), ("seed", -1), ("stop", ("",)),
     ("temperature", float("nan")),
     # finite in Python, not in llama.cpp's float32 (0, or infinite: sampling then picks by NaN)
     ("temperature", 1e-40), ("temperature", 1e39), ("presence_penalty", -1e39),
     ("frequency_penalty", 1e31), ("repeat_penalty", 1e-46)],
)  # fmt: skip
def test_bad_option_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        GenerationOptions(**{field: value})  # type: ignore[arg-type]


def test_unknown_template_raises_template_error(fixture_path: object) -> None:
    """A template llama.cpp's matcher does not know renders through jinja by default; without
    jinja it is a TemplateError naming the way out."""
    path = fixture_path("smollm2-unknown-template.gguf")  # type: ignore[operator]
    with Model(path, use_jinja=False) as model, pytest.raises(TemplateError, match="use_jinja=True"):
        model.session().respond("Hi")
    with Model(path, kv_tokens=1024) as model:
        assert model.render([{"role": "user", "content": "Hi"}]) == "<<USER>> Hi\n<<ASSISTANT>> "


def test_nul_characters_are_never_silently_truncated(smollm2: Model) -> None:
    session = smollm2.session()
    with pytest.raises(TemplateError, match="must not contain NUL"):
        session.respond("before\0after", GenerationOptions(max_tokens=2))
    assert session.messages == []


def test_a_sessions_settings_are_read_only(smollm2: Model) -> None:
    """Its settings were plain attributes its exchanges read, checked only when it was made:
    ``batch_size = 4096`` cut prompts into batches llama.cpp refuses (a bare ValueError, and its
    cache cleared), ``share_prefix = False`` was half taken, a worker's ignored them all. They
    read ``config``, and cannot be assigned."""
    with smollm2.session(config=SessionConfig(context_size=1024, batch_size=64)) as session:
        assert (
            (session.context_size, session.batch_size)
            == (1024, 64)
            == (
                session.config.context_size,
                session.config.batch_size,
            )
        )
        assert session.share_prefix is session.config.share_prefix and session.thinking is False
        for name, value in (("batch_size", 4096), ("context_size", 10**6), ("share_prefix", False)):
            with pytest.raises(AttributeError):
                setattr(session, name, value)
        assert session.respond("Hi.", GenerationOptions(max_tokens=2)).text is not None


def test_messages_set_to_a_transcript_or_a_tuple_take_the_reply_and_others_fail_first(
    smollm2: Model, tmp_path: Path
) -> None:
    """``messages`` is the caller's to edit: a Transcript or a tuple set there decoded the whole
    reply, then failed to add it (a bare TypeError, the reply in no transcript); a message no
    file can hold failed inside a save, after the state was read."""
    options = GenerationOptions(max_tokens=2, temperature=0.0)
    with smollm2.session() as session:
        for given in (
            Transcript([{"role": "system", "content": "Be terse."}]),
            ({"role": "system", "content": "Hi."},),
        ):
            session.messages = given  # type: ignore[assignment]
            reply = session.respond("Hi", options)
            assert session.messages[-1]["content"] == reply.text and len(session.messages) == 3
        session.messages = None  # type: ignore[assignment]
        with pytest.raises(TypeError, match="must be a list of messages"):
            session.respond("Hi", options)
        for bad in ("hi", {"role": "user", "content": "\ud800"}):
            session.messages = [{"role": "user", "content": "Hi"}, bad]  # type: ignore[list-item]
            with pytest.raises(TemplateError):
                session.save(tmp_path / "s.llms")
        assert not (tmp_path / "s.llms").exists()


def test_another_threads_stream_finished_for_a_call_tells_its_reader(smollm2: Model) -> None:
    """A call from one thread while another reads a stream of the session between two steps
    finishes that stream first (as it always did), and its reader was not told: its loop ended
    as if the reply were over. Its next step now raises ``SessionBusyError``; the reply is kept
    as far as it got, and the call goes on. A stream set aside by its own thread, or made on one
    pool thread and left for a call from another (each step of a pool's caller may run on any
    of its threads), is finished for the next call as before."""
    session = smollm2.session()
    options = GenerationOptions(max_tokens=6, temperature=0)
    stream = session.stream("Tell me about Paris.", options)
    stepped, called = threading.Event(), threading.Event()
    told: list[BaseException] = []

    def read() -> None:
        next(stream)
        stepped.set()
        assert called.wait(60)
        try:
            for _ in stream:
                pass
        except SessionBusyError as error:
            told.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    assert stepped.wait(60)
    try:
        assert session.respond("Hi", options).text
    finally:
        called.set()
        reader.join()
    assert told and "finished by another call" in str(told[0]), told
    assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
    with pytest.raises(SessionBusyError):  # (each later step says it too)
        next(stream)
    set_aside = session.stream("Once more.", options)
    next(set_aside)
    assert session.respond("And again.", options).text  # (this thread's own: finished quietly)
    assert list(set_aside) == [] and set_aside.reply is not None
    with (  # (a pool's threads, each step on any of them: none is ever gone)
        concurrent.futures.ThreadPoolExecutor(1) as one,
        concurrent.futures.ThreadPoolExecutor(1) as another,
    ):
        pooled = one.submit(session.stream, "Bye.", options).result()
        one.submit(next, pooled).result()
        assert another.submit(session.respond, "Again.", options).result().text
    assert pooled.reply is not None and pooled.reply.finish_reason == "cancelled"
    said = [m["content"] for m in session.messages if m["role"] == "user"]
    assert said == ["Tell me about Paris.", "Hi", "Once more.", "And again.", "Bye.", "Again."], said


@pytest.mark.parametrize("kind", [tuple, Transcript])
def test_messages_set_as_a_tuple_or_transcript_while_a_stream_runs_keep_its_exchange(
    smollm2: Model, kind: Any
) -> None:
    """``session.messages`` may be set to a tuple or a ``Transcript`` (the next call takes it as
    a list): set while a stream ran, its last step raised a TypeError and the exchange was lost
    from the transcript (its tokens cached)."""
    session = smollm2.session("sys")
    stream = session.stream("Hi", GenerationOptions(max_tokens=4, temperature=0))
    next(stream)
    session.messages = kind(session.messages)
    for _ in stream:
        pass
    assert stream.reply is not None
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.messages[-1]["content"] == stream.reply.text
