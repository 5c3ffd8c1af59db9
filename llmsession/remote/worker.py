"""The process an isolated model runs in (``isolated.IsolatedModel``): a real ``Model`` and its
sessions and streams, driven over a socket by the parent's proxies.

llama.cpp ends the process on faults no callback can stop (an RPC server that dies mid-decode:
SIGABRT; one that stops answering: a decode that never returns). Here that ends this process
only; the parent sees the socket close, or hears in the heartbeat that a decode has been running
too long, and raises ``BackendError``.

Messages, both ways pickled tuples: the parent sends ``(request, op, args)`` (request None: no
answer wanted), ``("cancel", stream_id)`` and ``("interrupt",)`` (the caller's Ctrl-C), which
the reader thread applies at once, mid-decode;
this process answers ``("ok" | "error", request, value)`` and sends ``("beat", seconds)`` every
``BEAT_S`` while it works on a request: how long the current native call (a decode, a state
read or written, past what its size is allowed: ``Activity.busy_for``; or the model's load) has
been running.
"""

from __future__ import annotations

import _thread
import itertools
import os
import pickle
import queue
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from llmsession.config import MemoryConfig, ModelConfig, SessionConfig
from llmsession.errors import NativeError
from llmsession.native.cancel import ACTIVITY
from llmsession.options import GenerationOptions
from llmsession.runtime.face import Session, Stream
from llmsession.runtime.local import LocalModel

BEAT_S = 0.25
MODEL_CALLS = frozenset(
    {
        "render",
        "tokenize",
        "detokenize",
        "prompt_tokens",
        "call_tokens",
        "call_size",
        "conversations",
        "identity",
        "projector_identity",
        "memory",
        "embed",
    }
)
SESSION_CALLS = frozenset({"clear_cached_context", "fork", "save", "close"})


def portable(error: BaseException) -> BaseException:
    """The error itself if it pickles (llmsession's do), else a NativeError that names it."""
    try:
        pickle.dumps(error)
    except Exception:
        return NativeError(f"{type(error).__name__}: {error}")
    return error


class Worker:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.requests: queue.SimpleQueue[tuple[Any, str, tuple[Any, ...]]] = queue.SimpleQueue()
        self.objects: dict[int, Session | Stream] = {}
        self.ids = itertools.count(1)
        self.model: LocalModel | None = None
        self.loading_since: float | None = None
        self.busy = False  # a request that wants an answer is running
        self.interrupts = threading.Lock()  # ``busy`` changes, and the reader interrupts, under it

    def send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(message)

    def read(self) -> None:
        """The reader thread: cancels at once, everything else in order on the main thread."""
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "cancel":
                    stream = self.objects.get(message[1])
                    if isinstance(stream, Stream):
                        stream.cancel()
                elif message[0] == "interrupt":  # the caller's Ctrl-C, for the step it waited for
                    with self.interrupts:
                        if self.busy:
                            _thread.interrupt_main()
                else:
                    self.requests.put(message)
        except (EOFError, OSError):  # the parent is gone: so is the reason to finish anything
            os._exit(0)
        except BaseException:  # (a message torn by the parent's Ctrl-C: nothing more can be read)
            os._exit(1)

    def beat(self) -> None:
        """While a request runs (idle, there is nobody to tell, and nobody reads)."""
        while True:
            time.sleep(BEAT_S)
            if not self.busy:
                continue
            since = self.loading_since
            stuck = time.monotonic() - since if since is not None else ACTIVITY.busy_for()
            try:
                self.send(("beat", stuck))
            except OSError:
                os._exit(0)

    def run(self) -> None:
        threading.Thread(target=self.read, daemon=True).start()
        threading.Thread(target=self.beat, daemon=True).start()
        while True:
            try:
                if not self.serve_one():
                    return
            except KeyboardInterrupt:  # an interrupt that came as its step ended: it is over
                self.busy = False

    def serve_one(self) -> bool:
        """Run the next request and answer it; False after ``close``."""
        request, op, args = self.requests.get()
        with self.interrupts:
            self.busy = request is not None
        try:
            outcome: tuple[str, Any] = ("ok", getattr(self, f"op_{op}")(*args))
        except BaseException as caught:  # returned to the caller, who raises it
            outcome = ("error", caught)
        while True:  # (nothing between the step's end and here calls: no interrupt is taken)
            try:
                self.settle()
                break
            except KeyboardInterrupt:  # (asked for as the step ended, taken as ``settle`` began)
                pass
        if request is not None:
            kind, value = outcome
            self.send((kind, request, value if kind == "ok" else portable(value)))
        return op != "close"

    def settle(self) -> None:
        """No interrupt after this: none is asked for once ``busy`` is off, and one asked for
        as the step ended is taken here (it came later, between the step and its answer: the
        answer was lost, the caller waiting out the whole timeout, or torn halfway written)."""
        with self.interrupts:
            self.busy = False
        try:
            for _ in range(2):  # (a pending interrupt is raised at a jump back)
                pass
        except KeyboardInterrupt:
            pass

    def keep(self, thing: Session | Stream) -> int:
        key = next(self.ids)
        self.objects[key] = thing
        return key

    def session(self, key: int) -> Session:
        session = self.objects[key]
        assert isinstance(session, Session)
        return session

    def stream(self, key: int) -> Stream:
        stream = self.objects[key]
        assert isinstance(stream, Stream)
        return stream

    def edited(self, key: int, messages: list[Any] | None) -> Session:
        """The session, given the caller's edited transcript (None: it keeps its own)."""
        session = self.session(key)
        if messages is not None:
            session.messages = messages
        return session

    def ended(self, key: int, stream: Stream) -> tuple[Any, ...]:
        """A stream that is over, forgotten: its reply and its session's transcript."""
        del self.objects[key]
        session = stream.session
        return ("end", stream.reply, session.messages if session is not None else [])

    def handle(self, session: Session) -> tuple[int, SessionConfig, list[Any]]:
        """What the parent's proxy of a session is made from."""
        return self.keep(session), session.config, session.messages

    # -- operations ---------------------------------------------------------------------------
    def op_load(self, path: str, config: ModelConfig, memory: MemoryConfig) -> dict[str, Any]:
        self.loading_since = time.monotonic()
        try:
            self.model = model = LocalModel(path, config, memory)
        finally:
            self.loading_since = None
        names = (
            "threads",
            "use_jinja",
            "flash_attention",
            "kv_type",
            "anticipate",
            "template",
            "renderer",
            "media_marker",
            "pooling",
        )
        return {name: getattr(model, name) for name in names}

    def op_model(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self.model is not None and name in MODEL_CALLS
        return getattr(self.model, name)(*args, **kwargs)

    def op_session(self, config: SessionConfig) -> Any:
        assert self.model is not None
        return self.handle(self.model.session(config))

    def op_load_session(self, path: str, overrides: dict[str, Any]) -> Any:
        assert self.model is not None
        return self.handle(self.model.load_session(path, overrides))

    def op_stream(
        self, key: int, messages: list[Any] | None, content: Any, options: GenerationOptions
    ) -> tuple[int, list[Any]]:
        session = self.edited(key, messages)
        stream = session.stream(content, options)  # finishes an unfinished one first
        return self.keep(stream), session.messages

    def op_chat_stream(
        self, messages: list[Any], options: Any, tenant: str | None, config: SessionConfig, label: str | None
    ) -> int:
        assert self.model is not None
        return self.keep(self.model.chat_stream(messages, options, tenant, config, conversation=label))

    def op_complete_stream(
        self, prompt: str, options: Any, tenant: str | None, config: SessionConfig, label: str | None
    ) -> int:
        assert self.model is not None
        return self.keep(self.model.complete_stream(prompt, options, tenant, config, conversation=label))

    def op_take_conversation(self, conversation: str, tenants: list[str | None] | None = None) -> Any:
        assert self.model is not None
        taken = self.model.take_conversation(conversation, tenants=tenants)
        return None if taken is None else (self.handle(taken[0]), taken[1])

    def op_keep_conversation(self, key: int, tenant: str | None, conversation: str) -> None:
        assert self.model is not None
        self.model.keep_conversation(self.session(key), tenant, conversation)
        self.objects.pop(key, None)  # (the model's now, not the caller's handle's)

    def op_next(self, key: int) -> tuple[Any, ...]:
        """The stream's next snapshot, else its end; an error raised once its exchange was
        recorded (a reply that breaks a schema keyword checked after it) comes with the end, so
        the caller's stream and transcript hold the reply, as in process."""
        stream = self.stream(key)
        try:
            return ("snapshot", next(stream))
        except StopIteration:
            return self.ended(key, stream)
        except Exception as error:
            if stream.reply is None:
                raise
            return (*self.ended(key, stream), portable(error))

    def op_close_stream(self, key: int) -> tuple[Any, ...]:
        stream = self.stream(key)
        stream.close()
        return self.ended(key, stream)

    def op_session_call(self, key: int, messages: list[Any] | None, name: str, args: tuple[Any, ...]) -> Any:
        assert name in SESSION_CALLS
        session = self.edited(key, messages)
        value = getattr(session, name)(*args)
        if isinstance(value, Session):
            value = self.handle(value)
        return value, session.messages

    def op_cached_tokens(self, key: int) -> int:
        return self.session(key).cached_tokens

    def op_messages(self, key: int) -> list[Any]:
        return self.session(key).messages

    def op_drop(self, key: int) -> None:
        self.objects.pop(key, None)

    def op_close(self) -> None:
        if self.model is not None:
            self.model.close()


def main() -> int:
    conn = Connection(int(sys.argv[1]))
    Worker(conn).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
