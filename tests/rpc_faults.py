"""RPC faults that kill llama.cpp's process, survived by this one (run by ``test_rpc.py``).

Usage: ``python tests/rpc_faults.py MODEL``. Each scenario starts its own ``ggml-rpc-server``
processes, loads the model on them (in a worker process: the default with RPC), breaks a server
and expects a typed error, with the session's transcript as it was before the failed exchange.
After each, this same process loads the model locally and chats. Prints one line per scenario; exits 0
only if every one ended as expected (an abort of this process fails the test that runs it).
"""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from llmsession import BackendError, GenerationOptions, Model, ModelLoadError
from llmsession.native.rpc import free_port
from llmsession.native.rpc import local_servers as servers
from llmsession.runtime.session import Session

GREEDY = GenerationOptions(max_tokens=24, temperature=0)
TIMEOUT_S = 3.0


def expect_backend_error(model: Model, session: Session, action: Callable[[], object], label: str) -> float:
    """``action`` must raise BackendError and leave the transcript as it was; returns the time
    it took to raise."""
    before = copy.deepcopy(session.messages)
    began = time.monotonic()
    try:
        action()
    except BackendError as error:
        took = time.monotonic() - began
        assert session.messages == before, f"{label}: the transcript changed"
        assert model.closed and session.closed, f"{label}: the model is not closed after {error}"
        return took
    raise AssertionError(f"{label}: no BackendError")


def nothing_listening(path: str) -> str:
    endpoint = f"127.0.0.1:{free_port()}"
    try:
        Model(path, rpc_servers=[endpoint])
    except ModelLoadError as error:
        assert endpoint in str(error), error
        return f"typed error naming the endpoint: {error}"
    raise AssertionError("no ModelLoadError")


def killed_after_load(path: str) -> str:
    with servers(2, threads=1) as started:
        model = Model(path, rpc_servers=[e for e, _ in started], worker_timeout=TIMEOUT_S)
        session = model.session()
        started[1][1].kill()
        took = expect_backend_error(
            model, session, lambda: session.respond("Hello!", GREEDY), "killed after load"
        )
        return f"BackendError after {took:.2f} s"


def stream_then(path: str, fault: Callable[[subprocess.Popen[bytes]], None], label: str) -> tuple[float, str]:
    with servers(2, threads=1) as started:
        model = Model(path, rpc_servers=[e for e, _ in started], worker_timeout=TIMEOUT_S)
        session = model.session()
        first = session.respond("Name a colour.", GREEDY)
        assert first.text, "the first exchange replied nothing"

        def second() -> None:
            for i, _ in enumerate(session.stream("And another one, in a long sentence?", GREEDY)):
                if i == 2:
                    fault(started[0][1])

        took = expect_backend_error(model, session, second, label)
        model.close()
        return took, first.text


def killed_mid_stream(path: str) -> str:
    took, _ = stream_then(path, lambda server: server.kill(), "killed mid-stream")
    return f"BackendError {took:.2f} s after the stream began"


def stopped_mid_stream(path: str) -> str:
    took, _ = stream_then(path, lambda server: server.send_signal(signal.SIGSTOP), "stopped mid-stream")
    assert took < TIMEOUT_S + 3, f"a hung server was reported after {took:.1f} s (timeout {TIMEOUT_S} s)"
    return f"BackendError {took:.2f} s after the stream began (worker_timeout {TIMEOUT_S} s)"


def stopped_before_a_save(path: str) -> str:
    """A save (or fork, or park) reads the session's state over RPC without decoding: a server
    that stopped answering then hung it past every timeout (only decodes were watched)."""
    with servers(2, threads=1) as started:
        model = Model(path, rpc_servers=[e for e, _ in started], worker_timeout=TIMEOUT_S)
        session = model.session()
        assert session.respond("Name a colour.", GREEDY).text
        started[0][1].send_signal(signal.SIGSTOP)
        with tempfile.TemporaryDirectory() as folder:
            saving = lambda: session.save(f"{folder}/chat.llmsession")  # noqa: E731
            took = expect_backend_error(model, session, saving, "stopped before a save")
        model.close()
    assert took < TIMEOUT_S + 3, f"a hung server was reported after {took:.1f} s (timeout {TIMEOUT_S} s)"
    return f"BackendError {took:.2f} s after the save began (worker_timeout {TIMEOUT_S} s)"


def healthy_local_chat(path: str) -> str:
    with Model(path, threads=2) as model:
        session = model.session()
        session.respond("Hello!", GREEDY)
        second = session.respond("And then?", GREEDY)
        assert second.usage.reused_tokens > 0
        return f"a local chat reused {second.usage.reused_tokens} tokens"


def main() -> int:
    path = sys.argv[1]
    scenarios = (
        nothing_listening,
        killed_after_load,
        killed_mid_stream,
        stopped_mid_stream,
        stopped_before_a_save,
    )
    for scenario in scenarios:
        print(f"{scenario.__name__}: {scenario(path)}; then {healthy_local_chat(path)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
