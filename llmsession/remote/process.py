"""The parent's end of a model's worker process (``remote.isolated``): requests sent one at a
time, each answered or failed within its time limit, and the process killed and reaped on any
failure."""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from llmsession.errors import BackendError


class WorkerProcess:
    """The parent's end of a worker: one request at a time, each answered or failed in time."""

    def __init__(self, timeout: float) -> None:
        ours, theirs = socket.socketpair()
        # ggml's abort handler would attach gdb to print a backtrace: slow, and nothing for us
        env = {"GGML_NO_BACKTRACE": "1", **os.environ}
        with theirs:
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "llmsession.remote.worker", str(theirs.fileno())],
                    pass_fds=[theirs.fileno()],
                    stdout=sys.__stderr__.fileno() if sys.__stderr__ else subprocess.DEVNULL,  # never ours
                    env=env,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the caller, who passes it on
                )
            except BaseException:  # (no process: our end is nobody's)
                ours.close()
                raise
        self.conn = Connection(ours.detach())
        self.timeout = timeout
        self.lock, self.send_lock = threading.Lock(), threading.Lock()
        self.queued: collections.deque[tuple[Any, ...]] = collections.deque()
        self.requests = itertools.count()
        self.failure: str | None = None
        self.unread: dict[int, str] = {}  # requests whose caller stopped waiting (a Ctrl-C): their ops

    def call(self, op: str, *args: Any, limit: float | None = None) -> Any:
        with self.lock:
            if self.failure is not None:
                raise BackendError(self.failure)
            request = next(self.requests)
            self.send((request, op, args))
            try:
                return self.answer(request, limit or self.timeout)
            except KeyboardInterrupt:  # (its answer comes later, to nobody: ``_unread``)
                self.unread[request] = op
                raise

    def tell(self, *message: Any) -> None:
        """A message that wants no answer (a cancel, an interrupt, an object dropped here),
        lost if the worker is. It never waits for the pipe: a finalizer may call it on the very
        thread that holds the pipe inside ``send`` (a collection runs it there), so it is queued
        and sent at once if the pipe is free, else by the thread that has it, when it lets go."""
        self.queued.append(message)
        self.flush()

    def flush(self) -> None:
        """Sends the queued messages unless another send holds the pipe: that one flushes them
        after it lets go (so a message queued while it held the pipe is never left behind)."""
        while self.queued and self.failure is None and self.send_lock.acquire(blocking=False):
            try:
                self._send_queued()
            except OSError:
                self.queued.clear()
            finally:
                self.send_lock.release()

    def _send_queued(self) -> None:
        """The queued messages, in order (``send_lock`` held; a message queued meanwhile too)."""
        while self.queued:
            self.conn.send(self.queued.popleft())

    def send(self, message: tuple[Any, ...]) -> None:
        data = picklable(message)
        try:
            with self.send_lock:
                self._send_queued()  # (queued before it: the worker reads them first, as they came)
                self.conn.send_bytes(data)
        except OSError:
            self.fail(self.death())
        self.flush()

    def answer(self, request: int, limit: float) -> Any:
        while True:
            if not self.conn.poll(limit):
                self.fail(f"the model's worker process sent nothing for {limit:g} s")
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                self.fail(self.death())
            except BaseException:  # (a Ctrl-C inside a message: the next read would start mid-way)
                self.failure = (
                    "a read of the worker's answer was interrupted; the model is closed (load it again)"
                )
                self.stop()
                raise
            message = pickle.loads(data)  # (whole: an error unpickling it leaves the pipe in step)
            if message[0] == "beat":
                if message[1] > limit:
                    self.fail(
                        f"a llama.cpp call (a decode, a state read) in the model's worker process has "
                        f"not returned for {message[1]:.1f} s (worker_timeout {limit:g} s): an RPC "
                        "server stopped answering?"
                    )
                continue
            kind, answered, value = message
            if answered == request:
                if kind == "error":
                    raise value
                return value
            op = self.unread.pop(answered, None)
            if op is not None and kind == "ok":
                for letting_go in let_go(op, value):
                    self.tell(*letting_go)

    def death(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the model's worker process closed its connection"
        how = f"signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        return f"the model's worker process died ({how}; an RPC server lost?)"

    def fail(self, why: str) -> NoReturn:
        self.failure = f"{why}; the model is closed (load it again)"
        self.stop()
        raise BackendError(self.failure)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


def let_go(op: str, value: Any) -> list[tuple[Any, ...]]:
    """What lets go of the objects an answer nobody read made in the worker (a session's or a
    stream's key: they stayed there until the model closed, a stream's exchange unfinished)."""
    if op in ("session", "load_session"):
        return [(None, "drop", (value[0],))]
    if op == "take_conversation" and value is not None:
        return [(None, "drop", (value[0][0],))]
    if op in ("chat_stream", "complete_stream"):
        return [(None, "close_stream", (value,))]
    if op == "stream":
        return [(None, "close_stream", (value[0],))]
    if op == "session_call" and isinstance(value[0], tuple):  # (a fork's handle)
        return [(None, "drop", (value[0][0],))]
    return []


def _signal_name(number: int) -> str:
    """A signal's name; a real-time one (34 and on) has none in Python: its number."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def picklable(message: tuple[Any, ...]) -> bytes:
    """A request as bytes for the worker, or a TypeError that says why it cannot travel (a
    lambda, a class defined inside a function, an open file...)."""
    try:
        return pickle.dumps(message)
    except (pickle.PicklingError, AttributeError, TypeError, RecursionError) as error:
        raise TypeError(
            "an isolated model runs in a worker process, so every argument must pickle "
            f"(no lambdas, local classes or open files): {error}"
        ) from None
