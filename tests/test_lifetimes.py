"""Closing a model: every later use is a typed error, never a freed pointer handed to llama.cpp.

The probes that used to crash (SIGSEGV) run in a subprocess that must exit 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import internals
import pytest

from llmsession import GenerationOptions, Model, ModelClosedError

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=REPO
    )


def test_a_session_used_after_its_model_closed_raises(smollm2_path: Path) -> None:
    result = run_python(
        f"""
        from llmsession import GenerationOptions, Model, ModelClosedError
        one = GenerationOptions(max_tokens=2, temperature=0)
        with Model({str(smollm2_path)!r}, threads=2) as model:
            session = model.session()
            session.respond("Hi", one)
        messages = list(session.messages)
        calls = [
            lambda: session.respond("Again", one),
            lambda: session.stream("Again", one),
            lambda: session.clear_cached_context(),
            lambda: model.session(),
            lambda: model.tokenize("Hi"),
            lambda: model.detokenize([1, 2]),
            lambda: model.render([{{"role": "user", "content": "Hi"}}]),
        ]
        for i, call in enumerate(calls):
            try:
                call()
            except ModelClosedError:
                pass
            else:
                raise SystemExit(f"call {{i}} did not raise")
        assert session.messages == messages
        session.close()  # idempotent and harmless
        model.close()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"


def test_a_stream_open_across_close_raises(smollm2_path: Path) -> None:
    result = run_python(
        f"""
        import threading, time
        from llmsession import GenerationOptions, Model, ModelClosedError
        long = GenerationOptions(max_tokens=400, temperature=0.8, seed=1)
        model = Model({str(smollm2_path)!r}, threads=2)
        session = model.session()
        stream = session.stream("Write a long story about a dragon.", long)
        first = next(stream)
        other = model.session()
        seen = {{}}
        def iterate():
            try:
                for snap in other.stream("Write a long poem about the sea.", long):
                    seen["steps"] = seen.get("steps", 0) + 1
            except ModelClosedError:
                seen["error"] = True
        thread = threading.Thread(target=iterate)
        thread.start()
        while seen.get("steps", 0) < 3:
            time.sleep(0.01)
        model.close()  # waits for the running step, then ends both streams
        thread.join(60)
        assert not thread.is_alive()
        assert seen.get("error"), seen
        try:
            next(stream)
        except ModelClosedError:
            pass
        else:
            raise SystemExit("the open stream went on after close")
        stream.close()
        assert session.messages[-1]["role"] == "assistant"
        assert session.messages[-1]["content"].startswith(first.text)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"


def test_a_context_after_its_model_closed_raises(smollm2_path: Path) -> None:
    result = run_python(
        f"""
        from llmsession import ModelClosedError
        from llmsession.native.llama import NativeModel
        from llmsession.native.context import NativeContext
        native = NativeModel({str(smollm2_path)!r})
        context = NativeContext(native, n_ctx=256, n_batch=32, threads=2)
        native.close()
        for call in (lambda: context.decode([1, 2], 0), context.pos_max, context.clear,
                     lambda: native.tokenize("x", add_special=True), lambda: native.piece(1)):
            try:
                call()
            except ModelClosedError:
                pass
            else:
                raise SystemExit("no error")
        print("ok")
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "ok"


def test_the_interpreter_exits_cleanly_while_a_daemon_thread_decodes(smollm2_path: Path) -> None:
    """The main thread ends while a daemon thread's reply (a caller's thread, or ``astream``'s
    pump) is decoding its prompt: the model still open is closed at exit before its native
    objects are freed, so that step ends first. They were freed under the decode (SIGSEGV)."""
    code = f"""
    import asyncio, sys, threading, time
    from llmsession import GenerationOptions, Model, ModelClosedError
    m = Model({str(smollm2_path)!r}, threads=1, anticipate=False)
    long = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 150
    options = GenerationOptions(max_tokens=8, temperature=0)
    if sys.argv[1] == "thread":
        threading.Thread(target=m.session().respond, args=(long, options), daemon=True).start()
    else:
        loop = asyncio.new_event_loop()
        task = loop.create_task(m.session().astream(long, options).__anext__())
        loop.run_until_complete(asyncio.sleep(0.01))
    time.sleep(float(sys.argv[2]))
    print("exits", flush=True)
    """
    for how, delay in (("thread", "0.3"), ("thread", "1.0"), ("astream", "0.5")):
        ended = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), how, delay],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert (ended.returncode, ended.stdout) == (0, "exits\n"), (how, delay, ended.stderr[-1500:])


def test_no_context_is_made_for_a_model_closing(gemma3_path: Path) -> None:
    """Between its engine's close and the model's free (``close`` waits for calls under way
    there), a new session of the small sliding-window layout made a context of its own from
    a model about to be freed; it is refused."""
    with Model(gemma3_path, threads=1) as model:
        internals.local(model).engine.close()  # (what close() does before it frees the model)
        with pytest.raises(ModelClosedError):
            model.session(swa_full=False).respond("Hi", GenerationOptions(max_tokens=1))


def test_a_reply_cut_inside_a_character_holds_no_replacement_character(smollm2: Model) -> None:
    prompt = "Say: 🦙🦙🦙 🐍🐍🐍"
    system = "Repeat the user's message exactly."  # (a reply of emoji, each several tokens)
    session = smollm2.session(system=system)
    full = session.respond(prompt, GenerationOptions(max_tokens=30, temperature=0))
    tokens = [int(t) for t in internals.record(session)[full.usage.prompt_tokens :]]
    pieces = b""
    cuts = []
    for n, token in enumerate(tokens, start=1):
        pieces += internals.local(smollm2).native.piece(token)
        try:
            pieces.decode("utf-8")
        except UnicodeDecodeError as error:
            if error.reason == "unexpected end of data":
                cuts.append((n, pieces[: error.start].decode("utf-8")))
    assert cuts, f"no reply token ends inside a character: {full.text!r}"
    for n, expected in cuts[:3]:
        reply = smollm2.session(system=system).respond(prompt, GenerationOptions(max_tokens=n, temperature=0))
        assert reply.finish_reason == "length"
        assert "\ufffd" not in reply.text
        assert reply.text == expected


TINY = GenerationOptions(max_tokens=2, temperature=0)


@pytest.fixture(params=[False, True], ids=["in-process", "isolated"])
def either(request: pytest.FixtureRequest, smollm2_path: Path) -> Iterator[Model]:
    """A model of its own in this process, then in a worker: the two must behave alike."""
    with Model(smollm2_path, threads=1, kv_tokens=2048, isolated=request.param) as model:
        yield model


def test_a_session_kept_by_its_model_is_no_longer_its_callers(either: Model, tmp_path: Path) -> None:
    """After ``keep_conversation`` the model owns the session: the caller's handle is closed
    (its transcript readable, its unfinished stream finished first) and refuses every use."""
    session = either.session()
    session.respond("Hi", TINY)
    stream = session.stream("Name a colour.", TINY)
    next(stream)
    either.keep_conversation(session, tenant=None, conversation="c")
    assert list(stream) == [] and stream.reply is not None  # (finished when it was kept)
    assert session.closed and session.cached_tokens == 0 and len(session.messages) == 4
    for use in (
        lambda: session.respond("Again", TINY),
        lambda: session.stream("Again", TINY),
        session.fork,
        lambda: session.save(tmp_path / "kept.llmsession"),
        session.clear_cached_context,
        lambda: either.keep_conversation(session, tenant=None, conversation="d"),
    ):
        with pytest.raises(ModelClosedError, match="keep_conversation"):
            use()
    session.close()  # (harmless: the model's session stays kept)
    assert either.conversations() == ["c"]
    asked = [*session.messages, {"role": "user", "content": "Again"}]
    assert either.chat(asked, TINY, conversation="c").usage.reused_tokens > 0


def test_a_closed_session_is_not_kept(either: Model) -> None:
    session = either.session()
    session.respond("Hi", TINY)
    session.close()
    with pytest.raises(ModelClosedError, match="closed"):
        either.keep_conversation(session, tenant=None, conversation="c")
    assert either.conversations() == []


def test_every_use_of_a_closed_model_raises_and_what_stays_readable(either: Model, tmp_path: Path) -> None:
    """After ``close()`` the model answers nothing but its settings and ``closed``; a session
    keeps ``messages``, ``config``, ``closed`` and ``cached_tokens`` (0: it holds no state)."""
    session = either.session()
    session.respond("Hi", TINY)
    session.save(tmp_path / "saved.llmsession")
    assert session.cached_tokens > 0
    either.close()
    for use in (
        either.memory,
        either.identity,
        either.projector_identity,
        either.conversations,
        lambda: either.take_conversation("c"),
        lambda: either.keep_conversation(session, tenant=None, conversation="c"),
        lambda: either.embed("Hi"),
        lambda: either.load_session(tmp_path / "saved.llmsession"),
    ):
        with pytest.raises(ModelClosedError):
            use()
    assert either.closed and either.threads == 1 and either.pooling is None
    assert session.closed and session.cached_tokens == 0
    assert len(session.messages) == 2 and session.config.context_size == 512


def test_a_context_that_fails_half_built_is_freed_and_its_model_closes(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A context was its model's child before it was whole: one that failed after (its batch
    refused memory) and was kept alive by the error made the model's ``close`` stop at it (an
    AttributeError: no batch), its weights never freed; its context and thread pool stayed
    until collected. Half-built, both are freed at once and it is no child."""
    from llmsession.native import context as context_module
    from llmsession.native.context import NativeContext
    from llmsession.native.llama import NativeModel
    from llmsession.native.threadpool import ThreadPool

    freed: list[ThreadPool] = []
    free = ThreadPool.free

    def counted(pool: ThreadPool) -> None:
        freed.append(pool)
        free(pool)

    def refused(*args: object) -> None:
        raise MemoryError("a batch (injected)")

    native = NativeModel(str(smollm2_path))
    try:
        monkeypatch.setattr(ThreadPool, "free", counted)
        monkeypatch.setattr(context_module, "Batch", refused)
        with pytest.raises(MemoryError) as failed:
            NativeContext(native, n_ctx=256, n_batch=32, threads=2)
        assert len(freed) == 1 and native.children() == []
        monkeypatch.undo()
    finally:
        native.close()  # (raised here before, the error's frame holding the half-built context)
    assert native.closed and failed.value is not None
