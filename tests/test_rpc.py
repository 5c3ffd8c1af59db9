"""A model's layers on llama.cpp RPC servers (two local ``ggml-rpc-server`` processes): replies
equal a local run's, prefix reuse works the same, and every fault that kills llama.cpp's
process (a server missing, killed or stopped) is a typed error in ours (``rpc_faults.py``)."""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_reuse import GREEDY, QUESTIONS, check_against_fresh, short_prompt_noise, tolerance_for

from llmsession import GenerationOptions, Image, Model, ModelLoadError
from llmsession.native import rpc
from llmsession.native.rpc import local_servers as servers

FAULTS = Path(__file__).with_name("rpc_faults.py")


@pytest.fixture()
def endpoints(smollm2_path: Path) -> Iterator[list[str]]:
    """Two fresh servers: each takes one client at a time."""
    with servers(2, threads=1) as started:
        yield [endpoint for endpoint, _ in started]


def test_a_chat_on_two_servers_equals_a_local_run(smollm2: Model, endpoints: list[str]) -> None:
    """In this process (isolated=False), so the replies can be checked token by token against a
    local fresh decode when they differ in text."""
    tolerance = tolerance_for(short_prompt_noise(smollm2))
    # (with RPC servers llama.cpp chooses flash attention, on: here as the local model's, off)
    with Model(
        smollm2.path, threads=2, rpc_servers=endpoints, isolated=False, flash_attention=False
    ) as remote:
        assert not remote.isolated
        ours = remote.session(system="You are a helpful assistant.")
        for turn, question in enumerate(QUESTIONS[:2]):
            before = copy.deepcopy(ours.messages)
            reply = ours.respond(question, GREEDY)
            local = smollm2.session()
            local.messages = before
            expected = local.respond(question, GREEDY)
            assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
            if turn:
                assert reply.usage.reused_tokens > 0
            if reply.text != expected.text:
                assert check_against_fresh(ours, reply, tolerance, reference=smollm2) == [], turn


def test_an_isolated_chat_on_two_servers_equals_the_same_chat_in_process(
    smollm2_path: Path, endpoints: list[str]
) -> None:
    """The worker process changes nothing: the same servers, batches and replies, exactly
    (anticipation off, so both decode the same batches)."""
    transcripts = []
    for isolated in (True, False):
        with Model(
            smollm2_path, threads=2, rpc_servers=endpoints, isolated=isolated, anticipate=False
        ) as remote:
            assert remote.isolated == isolated
            session = remote.session(system="You are a helpful assistant.")
            replies = [session.respond(q, GREEDY) for q in QUESTIONS[:2]]
            assert replies[1].usage.reused_tokens > replies[0].usage.prompt_tokens
            fork = session.fork()
            assert fork.messages == session.messages and fork.cached_tokens == session.cached_tokens > 0
            transcripts.append(session.messages)
    assert transcripts[0] == transcripts[1]


def test_images_go_through_the_worker_and_the_servers_as_locally(
    smollm2_path: Path, fixture_path: Callable[[str], Path], endpoints: list[str]
) -> None:
    """The projector runs on this host's CPU; its embeddings are decoded on the servers."""
    options = GenerationOptions(max_tokens=8, temperature=0)
    answers = []
    for remote in (False, True):
        servers_ = {"rpc_servers": endpoints} if remote else {}
        projector = fixture_path("mmproj-tiny.gguf")
        # One flash attention choice on both sides (llama.cpp's own with RPC servers, on; ours, off)
        settings = {"threads": 2, "anticipate": False, "flash_attention": False}
        with Model(smollm2_path, mmproj_path=projector, **settings, **servers_) as model:
            assert model.isolated == remote
            session = model.session()
            first = session.respond(["What is this?", Image(fixture_path("image-red.png"))], options)
            second = session.respond("And its colour?", options)
            assert second.usage.reused_tokens > first.usage.prompt_tokens // 2  # the image is not re-encoded
            answers.append((first.text, second.text, second.usage))
    assert answers[0] == answers[1]


def test_every_fault_is_a_typed_error_and_the_process_goes_on(smollm2_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(FAULTS), str(smollm2_path)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    names = [
        "nothing_listening",
        "killed_after_load",
        "killed_mid_stream",
        "stopped_mid_stream",
        "stopped_before_a_save",
    ]
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == names, out
    assert all("; then a local chat reused" in line for line in lines), out


def test_the_preflight_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="host:port"):
        rpc.parse_endpoint("localhost")
    with pytest.raises(ValueError, match="twice"):
        rpc.parse_endpoints(["a:1", "a:1"])
    with pytest.raises(TypeError):
        rpc.parse_endpoints("a:1")
    with servers(1, threads=1) as started:
        info = rpc.preflight(rpc.parse_endpoint(started[0][0]), 2.0)
        assert info.version[0] == rpc.PROTO_MAJOR and info.devices >= 1
        started[0][1].kill()
        started[0][1].wait()
        with pytest.raises(ModelLoadError, match=started[0][0]):
            rpc.preflight(rpc.parse_endpoint(started[0][0]), 2.0)


def test_doctor_reports_each_endpoint_and_rpc_server_starts_one() -> None:
    port = rpc.free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "llmsession", "rpc-server", "--port", str(port), "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None and f"serving on 127.0.0.1:{port}" in server.stdout.readline()
        dead = f"127.0.0.1:{rpc.free_port()}"
        for _ in range(200):  # the server binds right after exec
            out = subprocess.run(
                [sys.executable, "-m", "llmsession", "doctor", "--rpc", f"127.0.0.1:{port}", "--rpc", dead],
                capture_output=True,
                text=True,
            )
            if "protocol" in out.stdout:
                break
        assert out.returncode == 1 and dead in out.stderr, out
        assert f"rpc 127.0.0.1:{port}: protocol 7.0.0, 1 device(s)" in out.stdout, out.stdout
        assert "RPC" in out.stdout.splitlines()[-1], out.stdout  # the device llama.cpp sees there
    finally:
        server.kill()
        server.wait()


def test_a_server_whose_port_was_taken_starts_again_on_another(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``local_servers`` hands out a free port that another process may bind first (parallel
    test workers do): that server exits, and it starts again elsewhere, never counting another
    server's answer on the port as its own (here another RPC server's, which answers at once)."""
    with servers(1, threads=1) as ((other, squatter),):
        taken = rpc.parse_endpoint(other).port
        ports = iter([taken])
        free = rpc.free_port
        monkeypatch.setattr(rpc, "free_port", lambda: next(ports, None) or free())
        with servers(1, threads=1) as ((endpoint, process),):
            port = rpc.parse_endpoint(endpoint).port
            assert port != taken and process.poll() is None and rpc.listens(process.pid, port)
            assert not rpc.listens(process.pid, taken) and rpc.listens(squatter.pid, taken)
            rpc.preflight(rpc.parse_endpoint(endpoint), 5.0)


def test_servers_started_here_end_with_a_caller_killed_before_its_finally() -> None:
    """``local_servers`` stopped its servers in a ``finally``: a caller killed first (a test's
    timeout, SIGKILL) left them running for good. They are tied to it now."""
    code = (
        "import time\nfrom llmsession.native.rpc import local_servers\n"
        "with local_servers(1, threads=1) as started:\n"
        "    print(started[0][1].pid, flush=True)\n    time.sleep(120)\n"
    )
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert caller.stdout is not None
    server = int(caller.stdout.readline())
    assert Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")[0].endswith(b"rpc-server")
    ignored = next(
        line for line in Path(f"/proc/{server}/status").read_text().splitlines() if "SigIgn" in line
    )
    lost = int(ignored.split()[1], 16) & ((1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1)))
    assert lost == 0, ignored  # (SIGPIPE and SIGXFSZ as started alone: Python's ignoring reset)
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server}").exists() and Path(f"/proc/{server}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the server outlived its caller"
        time.sleep(0.05)


def test_a_state_being_moved_is_allowed_its_size_before_it_counts_as_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's heartbeat reports how long native work has run (``busy_for``): a decode as
    it runs; a state read or written (a save, a park, over RPC a transfer of gigabytes for a
    big model) only past what its size takes at ``STATE_BYTES_S``, so a healthy one is not
    taken for a stopped server, and a stopped one still is."""
    from llmsession.native import cancel

    now = [100.0]
    monkeypatch.setattr(cancel.time, "monotonic", lambda: now[0])
    activity = cancel.Activity()
    with activity.moving(int(10 * cancel.STATE_BYTES_S)):  # (ten seconds' worth)
        now[0] += 9.0
        assert activity.busy_for() == 0.0
        now[0] += 6.0
        assert activity.busy_for() == 5.0
    assert activity.busy_for() == 0.0
    with activity:  # (a decode: no allowance)
        now[0] += 2.0
        assert activity.busy_for() == 2.0
