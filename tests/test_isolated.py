"""``Model(..., isolated=True)`` on a local model: the public API behaves as in-process, and a
worker that dies or goes silent is a ``BackendError`` with the transcript intact."""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import internals
import pytest
from near_ties import DUMP, assert_entries_within_noise, assert_same_within_noise, loaded, scored
from test_defects import run_python
from test_reuse import GREEDY, QUESTIONS

from llmsession import (
    BackendError,
    ContextOverflowError,
    GenerationOptions,
    Model,
    ModelClosedError,
    ReplyMismatchError,
    Session,
    SessionConfig,
    Stream,
    TemplateError,
    UnsupportedFeatureError,
)
from llmsession.remote.isolated import IsolatedModel


@pytest.fixture(scope="module")
def isolated(smollm2_path: Path) -> Iterator[Model]:
    """Anticipation off: then it decodes the same batches as an in-process twin, exactly."""
    with Model(smollm2_path, threads=2, isolated=True, anticipate=False) as model:
        yield model


def test_it_answers_as_the_model_in_process(isolated: Model, smollm2_path: Path) -> None:
    assert isolated.isolated and isinstance(isolated.session(), Session)
    with Model(smollm2_path, threads=2, anticipate=False) as local:
        ours, theirs = isolated.session("Be brief."), local.session("Be brief.")
        for question in QUESTIONS[:2]:
            reply, expected = ours.respond(question, GREEDY), theirs.respond(question, GREEDY)
            assert (reply.text, reply.usage) == (expected.text, expected.usage)
        assert ours.messages == theirs.messages and reply.usage.reused_tokens > 0
        assert ours.cached_tokens == theirs.cached_tokens
        for session in (ours, theirs):  # a stream dropped unfinished keeps what it said
            stream = session.stream(QUESTIONS[2], GREEDY)
            next(stream), next(stream)
            del stream
            session.respond(QUESTIONS[3], GREEDY)
        assert ours.messages == theirs.messages and len(ours.messages) == 9
        assert isolated.tokenize("Hello") == local.tokenize("Hello")
        assert isolated.render(ours.messages) == local.render(theirs.messages)
    assert isolated.memory().live_sessions >= 1


def test_a_cancelled_stream_keeps_what_it_said_and_the_session_goes_on(isolated: Model) -> None:
    session = isolated.session()
    stream = session.stream("Write a long story.", GenerationOptions(max_tokens=200, temperature=0))
    for i, _ in enumerate(stream):
        if i == 3:
            stream.cancel()
    assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
    assert session.messages[-1] == {"role": "assistant", "content": stream.reply.text}
    assert session.respond("Shorter, please.", GREEDY).usage.reused_tokens > 0


def test_edits_forks_saves_and_stateless_calls(isolated: Model, smollm2: Model, tmp_path: Path) -> None:
    session = isolated.session()
    first = session.respond(QUESTIONS[0], scored(GREEDY))
    twin = session.fork()
    assert twin.messages == session.messages and twin is not session
    del session.messages[-2:]  # an undo, made here: the worker sees it on the next call
    again = session.respond(QUESTIONS[0], scored(GREEDY))  # (its cells elsewhere: within the noise)
    assert again.usage.reused_tokens > 0
    assert_same_within_noise(smollm2, again, first)  # (the noise of its weights, in this process)
    session.save(tmp_path / "s.llms")
    loaded = isolated.load_session(tmp_path / "s.llms")
    assert loaded.messages == session.messages
    assert loaded.respond(QUESTIONS[1], GREEDY).usage.restored_tokens > 0
    history = [*copy.deepcopy(session.messages), {"role": "user", "content": QUESTIONS[1]}]
    assert isolated.chat(history, GREEDY).text
    reply = asyncio.run(session.arespond(QUESTIONS[2], GREEDY))
    assert session.messages[-1]["content"] == reply.text


def test_a_dead_worker_is_a_typed_error_and_a_new_model_takes_over(smollm2_path: Path) -> None:
    model = Model(smollm2_path, threads=2, isolated=True)
    session = model.session()
    session.respond(QUESTIONS[0], GREEDY)
    before = copy.deepcopy(session.messages)
    assert model.isolated
    os.kill(internals.worker(model).process.pid, signal.SIGKILL)
    with pytest.raises(BackendError, match="SIGKILL"):
        session.respond(QUESTIONS[1], GREEDY)
    assert session.messages == before and model.closed
    with pytest.raises(ModelClosedError):
        model.session()
    model.close()
    with Model(smollm2_path, threads=2, isolated=True) as again:
        fresh = again.session()
        fresh.messages = session.messages
        assert fresh.respond(QUESTIONS[1], GREEDY).text


def test_a_worker_killed_by_a_signal_without_a_name_is_a_typed_error(smollm2_path: Path) -> None:
    """A real-time signal (35) has no name in Python: naming it raised ValueError before the
    worker was marked failed, so every later call raised ValueError and the model stayed open."""
    model = Model(smollm2_path, threads=1, isolated=True)
    session = model.session()
    os.kill(internals.worker(model).process.pid, signal.SIGRTMIN + 1)
    for _ in range(2):
        with pytest.raises(BackendError, match=f"signal {int(signal.SIGRTMIN) + 1}"):
            session.respond(QUESTIONS[0], GREEDY)
    assert model.closed
    model.close()


def test_a_ctrl_c_inside_an_answer_being_read_closes_the_model(smollm2_path: Path) -> None:
    """A Ctrl-C while the parent read an answer's bytes left the rest in the pipe: the next call
    read them as a message's length and waited forever. The model is closed then (a typed error
    for every later call, the worker stopped); the interrupt goes on. (A ``recv`` that raises
    stands in for the signal landing inside one: a big answer's read takes a while. An error
    unpickling a whole answer leaves the pipe in step: it does not close the model.)"""
    model = Model(smollm2_path, threads=1, isolated=True)
    worker = internals.worker(model)
    loads, failed = pickle.loads, []

    def unreadable(data: bytes) -> Any:  # (an answer read whole that does not unpickle, once)
        if not failed:
            failed.append(data)
            raise TypeError("an error class that cannot be rebuilt")
        return loads(data)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(pickle, "loads", unreadable)
        with pytest.raises(TypeError):
            model.tokenize("hi")
    assert not model.closed and model.tokenize("hi")
    real = worker.conn.recv_bytes

    def interrupted() -> Any:
        worker.conn.recv_bytes = real  # type: ignore[method-assign]
        raise KeyboardInterrupt

    worker.conn.recv_bytes = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        model.tokenize("hello " * 1000)
    with pytest.raises(BackendError, match="interrupted"):
        model.tokenize("hi")
    assert model.closed and worker.process.poll() is not None
    model.close()


def test_an_open_stream_of_a_closed_model_closes_quietly_as_in_process(smollm2_path: Path) -> None:
    """``stream.close()`` (and leaving ``with stream``) after ``model.close()`` asked the closed
    model to finish it: ModelClosedError, replacing whatever the ``with`` block raised. In
    process it does nothing; a next step raises, as there."""
    for isolated in (False, True):
        model = Model(smollm2_path, threads=1, isolated=isolated)
        stream = model.session().stream(QUESTIONS[0], GREEDY)
        next(stream)
        model.close()
        stream.close()
        with stream:
            pass
        with pytest.raises(ModelClosedError):
            next(stream)


def test_a_session_dropped_while_its_thread_sends_is_dropped_after_the_send(smollm2_path: Path) -> None:
    """A collection can run a dropped session's finalizer inside ``send_bytes``, on the thread
    that holds the pipe. Its message must wait for that send, not for itself (a deadlock once,
    found by a suite run). Its own model: a deadlocked one could not be closed."""
    model = Model(smollm2_path, threads=2, isolated=True)
    worker = internals.worker(model)
    doomed = [model.session()]
    key = doomed[0]._key  # type: ignore[attr-defined]
    assert worker.call("cached_tokens", key) == 0  # live in the worker
    real = worker.conn.send_bytes

    def sending(data: bytes) -> None:
        real(data)
        worker.conn.send_bytes = real  # type: ignore[method-assign]
        doomed.clear()  # its last reference: its finalizer runs here, with the pipe held

    worker.conn.send_bytes = sending  # type: ignore[method-assign]
    caller = threading.Thread(target=model.tokenize, args=("Hello",), daemon=True)
    caller.start()
    caller.join(timeout=30)
    if caller.is_alive():  # deadlocked: leave the model to the process's end
        worker.process.kill()
        pytest.fail("the finalizer waited for the pipe its own thread held")
    assert not doomed
    with pytest.raises(KeyError):  # the drop reached the worker after the call's bytes
        worker.call("cached_tokens", key)
    assert model.tokenize("Hello")
    model.close()


def test_a_silent_worker_is_reported_within_the_timeout(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2, isolated=True, worker_timeout=1.0) as model:
        session = model.session()
        assert model.isolated
        os.kill(internals.worker(model).process.pid, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(BackendError, match="sent nothing for 1 s"):
            session.respond(QUESTIONS[0], GREEDY)
        assert time.monotonic() - began < 3
        assert session.messages == []


def test_a_wait_for_ever_and_a_relative_path_are_as_in_process(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``worker_timeout=inf`` waits for ever: every call raised a bare OverflowError (a poll's
    limit in milliseconds is an int) and the model's close left its worker running. A relative
    path named the worker's working directory, the one of the model's load."""
    with Model(smollm2_path, threads=1, isolated=True, worker_timeout=float("inf")) as model:
        monkeypatch.chdir(tmp_path)
        session = model.session()
        session.respond("Hi", GenerationOptions(max_tokens=2, temperature=0.0))
        session.save("here.llms")
        assert (tmp_path / "here.llms").is_file()
        assert model.load_session(Path("here.llms")).messages == session.messages
        with pytest.raises(TypeError, match="must be a str or a Path"):
            session.save(b"here.llms")  # type: ignore[arg-type]
        worker = internals.worker(model).process
    assert worker.poll() is not None or worker.wait(10) is not None


def face_problems(face: type, implementation: type) -> list[str]:
    """What keeps ``implementation`` from being one side of ``face``: it must derive from the
    face alone (not from the other implementation, overriding it whole) and leave nothing
    abstract."""
    problems = []
    if implementation.__bases__ != (face,):
        problems.append(
            f"{implementation.__name__} derives from {implementation.__bases__}, not {face.__name__} alone"
        )
    if getattr(implementation, "__abstractmethods__", None):
        problems.append(
            f"{implementation.__name__} leaves {sorted(implementation.__abstractmethods__)} abstract"
        )
    return problems


def test_one_face_each_for_sessions_and_streams_two_implementations_side_by_side() -> None:
    """``Session`` and ``Stream`` are faces: the in-process and worker implementations each
    derive from the face only, and both backends answer every call ``Model`` makes. Variants
    that must fail: a worker session that inherits the local one, and one left abstract."""
    from llmsession.api.backend import Backend
    from llmsession.remote.proxies import WorkerSession, WorkerStream
    from llmsession.runtime.local import LocalModel
    from llmsession.runtime.session import LocalSession
    from llmsession.runtime.stream import LocalStream

    calls = {name for name, value in vars(Backend).items() if callable(value) or isinstance(value, property)}
    for backend in (IsolatedModel, LocalModel):  # ``Model`` holds one or the other
        missing = {name for name in calls if not name.startswith("_") and not hasattr(backend, name)}
        assert not missing, f"{backend.__name__} lacks {sorted(missing)}"
    for face, sides in ((Session, (LocalSession, WorkerSession)), (Stream, (LocalStream, WorkerStream))):
        for side in sides:
            assert face_problems(face, side) == []

    class Overriding(LocalSession):  # the old shape: a proxy inheriting the local session
        pass

    class Unfinished(Session):
        pass

    assert face_problems(Session, Overriding) and face_problems(Session, Unfinished)
    with pytest.raises(TypeError, match=r"model\.session"):
        Session()


def test_ctrl_c_stops_an_isolated_prefill_and_keeps_the_transcript(
    smollm2_path: Path, smollm2: Model
) -> None:
    """As in-process (``test_defects``): KeyboardInterrupt propagates, the worker's decode stops
    within a batch, the transcript is as it was, and the next exchange reuses what was decoded."""
    result = run_python(
        f"""
        import os, signal, threading, time, json
        from llmsession import Model, GenerationOptions
        GREEDY = GenerationOptions(max_tokens=8, temperature=0, logprobs=5)
        {DUMP}
        with Model({str(smollm2_path)!r}, threads=2, isolated=True, anticipate=False) as model:
            session = model.session(context_size=2048, batch_size=64)
            text = " ".join(["river bridge lantern harbour meadow orchard"] * 250)
            def interrupt():
                time.sleep(1.0)  # inside the prefill of about 1,500 tokens (several seconds)
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=interrupt, daemon=True).start()
            began = time.perf_counter()
            try:
                session.respond(text, GREEDY)
            except KeyboardInterrupt:
                waited = time.perf_counter() - began - 1.0
            else:
                raise SystemExit("the prefill ran to the end")
            assert session.messages == [], session.messages
            kept = session.cached_tokens
            assert 0 < kept < len(model.prompt_tokens([{{"role": "user", "content": text}}])), kept
            reply = session.respond("Hi", GREEDY)
            assert session.messages[0] == {{"role": "user", "content": "Hi"}}, session.messages
            fresh = model.session(context_size=2048).respond("Hi", GREEDY)
            print("SCORED", json.dumps([scored_entries(reply), scored_entries(fresh)]))
            print("kept", kept, "after the signal", round(waited, 3), "s")
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    reply, fresh = json.loads(result.stdout.split("SCORED ", 1)[1].splitlines()[0])
    assert_entries_within_noise(smollm2, loaded(reply), loaded(fresh))
    assert "kept" in result.stdout


def test_n_choices_on_a_worker_model_are_n_calls_checked_at_once(isolated: Model) -> None:
    asked = [{"role": "user", "content": "Name a colour."}]
    choices = isolated.chat_choices(asked, GenerationOptions(max_tokens=4, temperature=0.9, seed=3), n=2)
    asked.append({"role": "assistant", "content": "Blue."})  # (read when the choices were made)
    for choice in choices:
        with choice:
            texts = [snapshot.delta for snapshot in choice]
        assert choice.reply is not None and choice.reply.text == "".join(texts)
        assert choice.reply.usage.prompt_tokens == len(isolated.prompt_tokens(asked[:1]))
    assert choices.prompt is None  # (n calls: no shared prefill to report)
    with pytest.raises(ValueError, match="system prompt"):
        isolated.chat_choices(asked[:1], n=2, config=SessionConfig(system="Be brief."))
    with pytest.raises(UnsupportedFeatureError, match="n choices"):
        isolated.chat_choices(asked, n=2)  # it ends with the assistant's text: no choices continue it
    with pytest.raises(TemplateError):
        isolated.chat_choices([*asked[:1], {"role": "assistant", "content": ""}], n=2)  # (nothing to answer)


def test_a_tenant_counts_its_prompt_as_its_call_decodes_it(isolated: Model, smollm2: Model) -> None:
    """``prompt_tokens(tenant=...)`` and ``prompt_size`` through the worker: the call's own
    reply spliced in, as the in-process model counts it; each equal to what the next call
    decodes and reuses."""
    kept = SessionConfig(share_prefix=False)
    for model in (isolated, smollm2):
        asked = [{"role": "user", "content": "Name a bird."}]
        first = model.chat(asked, GenerationOptions(max_tokens=12, temperature=0), tenant="t", config=kept)
        asked += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
        counted = model.prompt_tokens(asked, tenant="t", config=kept)
        size = model.prompt_size(asked, tenant="t", config=kept)  # (the worker's count, images too)
        reply = model.chat(asked, GenerationOptions(max_tokens=2), tenant="t", config=kept)
        assert len(counted) == size == reply.usage.prompt_tokens
        prefilled = [*asked, {"role": "assistant", "content": "Because"}]  # (the call continues it)
        size = model.prompt_size(prefilled, tenant="t", config=kept)
        assert (
            size
            == model.chat(
                prefilled, GenerationOptions(max_tokens=2), tenant="t", config=kept
            ).usage.prompt_tokens
        )
        assert reply.usage.reused_tokens >= reply.usage.prompt_tokens - 16


def test_a_conversation_is_taken_and_kept_through_the_worker(isolated: Model, tmp_path: Path) -> None:
    """``conversation`` labels cross the process; a session taken out is the caller's, and one
    kept again is the model's (its handle closed here)."""
    kept = SessionConfig(share_prefix=False)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    first = isolated.chat(messages, GREEDY, tenant="alice", conversation="c-1", config=kept)
    assert "c-1" in isolated.conversations()
    taken = isolated.take_conversation("c-1")
    assert taken is not None and taken[1] == "alice" and "c-1" not in isolated.conversations()
    session = taken[0]
    assert session.cached_tokens > 0
    session.save(tmp_path / "c-1.llmsession")
    isolated.keep_conversation(session, tenant="alice", conversation="c-1")
    assert session.closed and "c-1" in isolated.conversations()
    assert session.cached_tokens == 0  # (as a closed one in-process)
    for use in (
        lambda: session.respond("Hi"),
        session.fork,
        lambda: isolated.keep_conversation(session, tenant=None, conversation="c"),
    ):
        with pytest.raises(ModelClosedError, match="keep_conversation"):  # (the worker's KeyError, once)
            use()
    answered = {"role": "assistant", "content": first.text}
    asked = [*messages, answered, {"role": "user", "content": QUESTIONS[1]}]
    again = isolated.chat(asked, GREEDY, tenant="alice", conversation="c-1", config=kept)
    assert again.usage.reused_tokens > 0
    assert isolated.take_conversation("nobody") is None


def test_a_reply_refused_after_it_was_recorded_is_in_the_stream_and_transcript(
    isolated: Model, smollm2: Model
) -> None:
    """A reply that breaks a schema keyword checked after the reply (``uniqueItems``) raises
    ReplyMismatchError once its exchange is recorded: in process the stream holds the reply and
    the transcript the exchange; isolated, the error came alone (no reply, no exchange, and an
    edit of that transcript then overwrote the worker's)."""
    schema = {
        "type": "array",
        "items": {"type": "integer", "enum": [1]},
        "minItems": 2,
        "maxItems": 2,
        "uniqueItems": True,
    }
    options = GenerationOptions(max_tokens=16, temperature=0, json_schema=schema)
    seen = []
    for model in (smollm2, isolated):
        session = model.session()
        stream = session.stream("Two ones, as a JSON list.", options)
        with pytest.raises(ReplyMismatchError):
            list(stream)
        assert stream.reply is not None and stream.reply.text.startswith("[1")
        seen.append((stream.reply.text, [m["role"] for m in session.messages]))
        with pytest.raises(StopIteration):
            next(stream)
    assert seen[0] == seen[1] and seen[0][1] == ["user", "assistant"], seen


def test_a_stream_its_next_exchange_finished_changes_no_later_edit(isolated: Model, smollm2: Model) -> None:
    """A stream left open is finished by its session's next exchange; read to its end later,
    the isolated one set the transcript to the worker's, undoing an edit made meanwhile (the
    next exchange then answered the unedited one). In process it changes nothing."""
    seen = []
    for model in (smollm2, isolated):
        session = model.session()
        old = session.stream(QUESTIONS[0], GREEDY)
        next(old)
        session.respond(QUESTIONS[1], GREEDY)
        session.messages = session.messages[:2]  # (the caller drops the last exchange)
        list(old)
        seen.append((len(session.messages), session.respond("And?", GREEDY).usage.prompt_tokens))
        # (the same when the next exchange fails after finishing it: a prompt too long)
        old = session.stream(QUESTIONS[0], GREEDY)
        next(old)
        with pytest.raises(ContextOverflowError):
            session.respond("word " * 40_000, GREEDY)
        session.messages = session.messages[:2]
        list(old)
        seen.append((len(session.messages), session.respond("And?", GREEDY).usage.prompt_tokens))
    assert seen[:2] == seen[2:] and seen[0][0] == seen[1][0] == 2, seen


def test_an_edit_sent_with_a_failed_exchange_can_be_undone(isolated: Model, smollm2: Model) -> None:
    """The worker takes an edited transcript with the exchange that carries it, even one that
    fails there: undoing the edit afterwards (equal to what the worker held before) is sent
    too, as in-process, where the next reply reads the transcript as it stands."""
    for model in (smollm2, isolated):
        session = model.session("You are a helpful assistant.", context_size=256)
        session.respond("Hi", GREEDY)
        good = copy.deepcopy(session.messages)
        session.messages[0]["content"] = "You are a pirate."
        with pytest.raises(ContextOverflowError):
            session.respond("word " * 400, GREEDY)
        session.messages = copy.deepcopy(good)
        reply = session.respond("Who are you?", GREEDY)
        assert session.messages[:3] == good and reply.usage.prompt_tokens < 100, model.isolated


def test_an_exchange_finished_by_a_call_that_failed_stays_in_the_transcript(
    isolated: Model, smollm2: Model
) -> None:
    """A new call first finishes the session's open stream (its exchange recorded), then fails:
    with no edit sent, the worker's transcript, which holds that exchange, is the one that goes
    on (the reviewer's case: a later call sent ours, without it)."""
    for model in (smollm2, isolated):
        session = model.session("Be brief.", context_size=256)
        session.respond("Hi", GREEDY)
        stream = session.stream("Tell me a story.", GenerationOptions(max_tokens=40, temperature=0))
        next(stream)
        with pytest.raises(ContextOverflowError):
            session.respond("word " * 400, GREEDY)
        session.respond("Again", GREEDY)
        asked = [m["content"] for m in session.messages if m["role"] == "user"]
        assert asked == ["Hi", "Tell me a story.", "Again"], (model.isolated, asked)
        del stream


def test_a_stream_dropped_unfinished_is_in_the_transcript_as_in_process(
    isolated: Model, smollm2: Model
) -> None:
    """Dropped, the stream's exchange is finished (cancelled) and recorded in its session, as
    in-process at once: trimming it away is then an edit like any other."""
    for model in (smollm2, isolated):
        session = model.session("Be brief.")
        session.respond("Hi", GREEDY)
        stream = session.stream("Tell me a story.", GenerationOptions(max_tokens=40, temperature=0))
        next(stream), next(stream)
        del stream
        gc.collect()
        assert [m["role"] for m in session.messages] == ["system", "user", "assistant"] * 1 + [
            "user",
            "assistant",
        ]
        session.messages = session.messages[:3]
        session.respond("Again", GREEDY)
        asked = [m["content"] for m in session.messages if m["role"] == "user"]
        assert asked == ["Hi", "Again"], (model.isolated, asked)


def test_what_a_call_made_for_a_caller_who_stopped_waiting_is_let_go(smollm2_path: Path) -> None:
    """A Ctrl-C while the parent waited (before any byte of the answer came) left the worker to
    answer nobody: the session it made for the call stayed in the worker until the model
    closed. The next call reads that answer and lets its objects go."""
    with Model(smollm2_path, threads=1, isolated=True) as model:
        worker = internals.worker(model)
        before = len(model.memory().sessions)
        poll = worker.conn.poll

        def interrupted(*args: Any) -> bool:
            worker.conn.poll = poll  # type: ignore[method-assign]
            time.sleep(0.3)  # (the worker answers meanwhile: its answer waits in the pipe)
            raise KeyboardInterrupt

        worker.conn.poll = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            model.session()
        assert not model.closed and model.tokenize("hi")  # (reads the unread answer, lets it go)
        deadline = time.monotonic() + 10
        while len(model.memory().sessions) != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(model.memory().sessions) == before


def test_a_worker_that_cannot_start_leaves_no_socket_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our end of the socket pair stayed open when the process could not be started, for as
    long as the error was kept (its traceback holds the frame that held it)."""
    import subprocess

    from llmsession.remote.process import WorkerProcess

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no such executable (injected)")

    monkeypatch.setattr(subprocess, "Popen", refused)
    before, kept = len(os.listdir("/proc/self/fd")), []
    for _ in range(3):
        with pytest.raises(OSError, match="injected") as failed:
            WorkerProcess(timeout=1)
        kept.append(failed.value)  # (as a caller that reports it later keeps it)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_stream_another_threads_call_finished_tells_its_reader_as_in_process(isolated: Model) -> None:
    """As in-process (``test_session``): a worker session's stream read by another thread is
    finished for this thread's call, and its reader's next step raises ``SessionBusyError``
    (it ended as if the reply were over); a stream of the caller's own ends quietly."""
    from llmsession import SessionBusyError, SessionFileError

    session = isolated.session()
    options = GenerationOptions(max_tokens=6, temperature=0)
    stream = session.stream("Tell me about Paris.", options)
    reader = threading.Thread(target=next, args=(stream,))
    reader.start()
    reader.join()
    assert session.respond("Hi", options).text
    with pytest.raises(SessionBusyError, match="finished by another call"):
        next(stream)
    assert stream.reply is not None and stream.reply.finish_reason == "cancelled"  # (as far as it got)
    with pytest.raises(SessionBusyError):  # (each later step says it too)
        next(stream)
    read = session.stream("Count to ten.", options)
    reader = threading.Thread(target=next, args=(read,))
    reader.start()
    reader.join()
    with pytest.raises(SessionFileError):  # (refused before it finished the stream: cut nothing)
        session.save("/no/such/folder/x.llmsession")
    assert list(read) and read.reply is not None and read.reply.finish_reason == "length"
    own = session.stream("Once more.", options)
    next(own)
    assert session.respond("And again.", options).text
    assert list(own) == []
    said = [m["content"] for m in session.messages if m["role"] == "user"]
    assert said == ["Tell me about Paris.", "Hi", "Count to ten.", "Once more.", "And again."], said
