"""``llmsession serve --replicas 2`` on a real local Ray instance (started once for the module,
14-24 s on these machines): conversations pinned to a replica (a session header, or how the
conversation opens), every replica used, resent turns read from the cache, a replica killed with
SIGKILL and every conversation going on, and SIGTERM leaving no process of Ray's behind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from plain_http import HTTP

from llmsession.cluster.keys import conversation_key, preferred, ranked, routing
from llmsession.cluster.metrics import merged
from llmsession.cluster.run import Cluster as RunCluster
from llmsession.commands.bench.cluster import free_port  # (outside Ray's port ranges)
from llmsession.serve.responses_sse import response_id

KEY = "sk-cluster"
REPLICA = "x-llmsession-replica"
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "ServeReplica", "ServeController")


def ray_processes() -> set[int]:
    """Every running process of Ray's (by its command line)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        command = _cmdline(int(entry.name)).replace(b"\0", b" ").decode(errors="replace")
        if any(name in command for name in RAY_PROCESSES):
            found.add(int(entry.name))
    return found


def wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.25)


@dataclass
class Cluster:
    url: str
    process: subprocess.Popen[str]
    before: set[int]  # Ray's processes before it started

    def serving_replicas(self) -> int:
        """Engine replicas up and answering (each posts its metrics every second)."""
        auth = {"Authorization": f"Bearer {KEY}"}
        try:
            text = HTTP.get(f"{self.url}/metrics", headers=auth, timeout=30).text
        except httpx.TransportError:
            return 0
        return sum(1 for name in replica_names(text) if alive(name))

    def chat(self, messages: list[dict[str, Any]], session: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}"}
        if session is not None:
            headers["x-session-id"] = session
        body = {"messages": messages, "max_tokens": 6, "temperature": 0}
        return HTTP.post(f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


@contextlib.contextmanager
def running(path: Path, folder: Path, *options: str) -> Iterator[Cluster]:
    """``serve --replicas`` with two one-thread replicas (and ``options``), until SIGTERM."""
    with alone_with_ray():
        yield from _running(path, folder, *options)


@contextlib.contextmanager
def alone_with_ray() -> Iterator[None]:
    """This machine's Ray to one test cluster at a time: the checks count every Ray process here
    (``ray_processes``), so a cluster in the other pytest-xdist worker (``make test`` runs this
    file and ``test_cluster_moves.py`` on two), or in another run, waits for this one to stop."""
    with open(Path(tempfile.gettempdir()) / "llmsession-tests-ray.lock", "w") as lock:
        wait_for(lambda: _locked(lock.fileno()), 300)  # (the other module takes ~3 min)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _running(path: Path, folder: Path, *options: str) -> Iterator[Cluster]:
    before = ray_processes()
    port = free_port()
    command = [sys.executable, "-m", "llmsession", "serve", "--replicas", "2", "--threads", "1"]
    command += ["--model", str(path), "--port", str(port), "--api-key", KEY, *options]
    # Its output to a file: Ray writes a lot after a replica is killed, and a pipe nobody reads
    # would fill and stop the process (it could not even exit on SIGTERM).
    log = folder / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            return HTTP.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 240)
        yield Cluster(url, process, before)
    finally:
        if process.poll() is None:  # (a test failed before SIGTERM's: stop it as an operator would)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    with running(smollm2_path, folder, "--disk-cache-dir", str(folder / "shared")) as started:
        yield started


def converse(cluster: Cluster, name: str, turns: int, session: str | None) -> list[httpx.Response]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are assistant {name}."}]
    answers = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} of {name}: name a colour."})
        response = cluster.chat(messages, session)
        assert response.status_code == 200, response.text
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        answers.append(response)
    return answers


def test_conversations_are_pinned_to_a_replica_and_read_from_its_cache(cluster: Cluster) -> None:
    seen: set[str] = set()
    for index in range(24):
        session = f"conversation-{index}" if index % 2 == 0 else None  # (odd ones: by their opening)
        answers = converse(cluster, f"c{index}", 3, session)
        replicas = {response.headers[REPLICA] for response in answers}
        assert len(replicas) == 1, (index, replicas)  # every turn on one replica
        for response in answers[1:]:  # resent turns: the history read from that replica's cache
            usage = response.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2, usage
        seen |= replicas
        if len(seen) == 2 and index >= 5:
            break
    assert len(seen) == 2  # (both replicas used: 2^-23 to fail by chance over 24 conversations)


def test_a_response_chain_and_a_claude_session_stay_on_their_replica(cluster: Cluster) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for index in range(6):  # (by chance, all six second turns would find their replica once in 64)
        body = {"model": "m", "input": f"Chain {index}: name a colour.", "max_output_tokens": 6}
        forged = {**auth, "x-llmsession-conversation": "0" * 32}  # (dropped by the front)
        first = HTTP.post(
            f"{cluster.url}/v1/responses", json={**body, "temperature": 0}, headers=forged, timeout=120
        )
        assert first.status_code == 200, first.text
        ident = first.json()["id"]
        assert not ident.startswith("resp_" + "0" * 32) and ident.endswith("_" + first.headers[REPLICA])
        stored = HTTP.get(f"{cluster.url}/v1/responses/{ident}", headers=auth, timeout=30)
        assert stored.status_code == 200 and stored.headers[REPLICA] == first.headers[REPLICA]
        follow = {
            **body,
            "input": "And another?",
            "previous_response_id": first.json()["id"],
            "temperature": 0,
        }
        second = HTTP.post(f"{cluster.url}/v1/responses", json=follow, headers=auth, timeout=120)
        assert second.status_code == 200, second.text  # (a 404 on a replica that did not store it)
        assert second.headers[REPLICA] == first.headers[REPLICA]
        assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    claude = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "x-claude-code-session-id": "cc-1"}
    said: list[dict[str, Any]] = []
    replicas = set()
    for turn in range(3):
        said.append({"role": "user", "content": f"Turn {turn}: name a colour."})
        body = {"model": "m", "max_tokens": 6, "messages": said, "system": "Be brief.", "temperature": 0}
        response = HTTP.post(f"{cluster.url}/v1/messages", json=body, headers=claude, timeout=120)
        assert response.status_code == 200, response.text
        said.append({"role": "assistant", "content": response.json()["content"]})
        replicas.add(response.headers[REPLICA])
    assert len(replicas) == 1 and response.json()["usage"]["cache_read_input_tokens"] > 0


def test_probes_and_listings_are_never_held_conversations(cluster: Cluster) -> None:
    """A health probe (no key needed) or a model list under a fresh session header holds no
    conversation: counted as one, a flood of them flushed every tenant's routing memory. Among
    them one conversation turn, which must be counted exactly once."""
    auth = {"Authorization": f"Bearer {KEY}"}

    def counted() -> float:
        text = HTTP.get(f"{cluster.url}/metrics", headers=auth, timeout=30).text
        lines = [line for line in text.splitlines() if line.startswith("llmsession_cluster_requests_total{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    def settled() -> float:  # (the replicas post their counts every second, after the engine's lock)
        readings = [counted()]
        while len(readings) < 3 or len(set(readings[-3:])) > 1:
            assert len(readings) < 120, readings
            time.sleep(1.0)
            readings.append(counted())
        return readings[-1]

    before = settled()
    for i in range(6):
        assert HTTP.get(f"{cluster.url}/health", headers={"x-session-id": f"probe {i}"}).status_code == 200
        listed = HTTP.get(f"{cluster.url}/v1/models", headers={**auth, "x-session-id": f"list {i}"})
        assert listed.status_code == 200
    converse(cluster, "probed", 1, "probed")
    wait_for(lambda: counted() > before, 30)
    assert settled() == before + 1


def test_metrics_show_every_replica(cluster: Cluster) -> None:
    converse(cluster, "counted", 2, "counted")  # (its second turn: a request its replica held)
    auth = {"Authorization": f"Bearer {KEY}"}

    def held(text: str) -> float:
        prefix = 'llmsession_cluster_requests_total{held="true"'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    def reported() -> bool:  # (replicas post theirs every second)
        text = HTTP.get(f"{cluster.url}/metrics", headers=auth, timeout=30).text
        return "llmsession_cluster_replicas 2" in text and held(text) >= 1

    wait_for(reported, 30)
    text = HTTP.get(f"{cluster.url}/metrics", headers=auth, timeout=30).text
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines() if 'replica="' in line}
    assert len(replicas) == 2
    assert text.count("# TYPE llmsession_requests_total counter") == 1
    assert HTTP.get(f"{cluster.url}/metrics", timeout=30).status_code == 401  # (a replica refuses)


def metric(text: str, name: str) -> float:
    """A counter summed over the cluster's replicas (and its other labels)."""
    lines = [line for line in text.splitlines() if line.startswith((name + "{", name + " "))]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_a_turn_sent_from_a_busy_replica_takes_its_state_along(cluster: Cluster) -> None:
    """The replica holding a conversation has 8 requests in flight: its next turn goes to the
    other replica, which asks the holder for the conversation (saved to the shared folder) and
    restores it, so the turn decodes only what is new."""
    auth = {"Authorization": f"Bearer {KEY}"}
    said: list[dict[str, Any]] = [
        {"role": "system", "content": "You are the assistant that moves. " * 12},
        {"role": "user", "content": "Name a colour."},
    ]
    first = cluster.chat(said, "moving")
    assert first.status_code == 200, first.text
    holder, used = first.headers[REPLICA], first.json()["usage"]
    wait_for(lambda: len(replica_names(HTTP.get(f"{cluster.url}/metrics", headers=auth).text)) == 2, 30)
    names = sorted(replica_names(HTTP.get(f"{cluster.url}/metrics", headers=auth).text))
    busy = [f"busy-{i}" for i in range(200) if ranked(_key(f"busy-{i}"), names)[0] == holder][:10]
    done = threading.Event()
    streams = [threading.Thread(target=_long_stream, args=(cluster, session, done)) for session in busy]
    for stream in streams:
        stream.start()
    time.sleep(2.5)  # (they run on the holder, which reports them within a second)
    said += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And another?"},
    ]
    second = cluster.chat(said, "moving")
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert second.headers[REPLICA] != holder
    held = used["prompt_tokens"] + used["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= held - 1, (used, usage)
    done.set()  # (the busy streams are closed: their replica cancels them)
    for stream in streams:
        stream.join(60)

    def counted() -> bool:
        text = HTTP.get(f"{cluster.url}/metrics", headers=auth, timeout=30).text
        handed = 'llmsession_cluster_conversations_moved_total{why="handed"'
        moved = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(handed))
        restored = metric(text, "llmsession_cluster_conversations_restored_total")
        return moved >= 1 and restored >= 1 and metric(text, "llmsession_cluster_routed_for_load_total") >= 1

    wait_for(counted, 30)


def test_a_response_id_moves_its_conversation_only_for_its_own_tenant(cluster: Cluster) -> None:
    """A response's id names its conversation's key and replica: another tenant who has seen it
    (bob, under the same API key: another user) can send a request to either replica under that
    key, but the conversation moves only for alice's. The variant that must move: alice's own
    id pointed at the other replica takes the conversation there (a 400 after: nothing stored
    there), so the count is seen to change; bob's request that would bring it back does not."""
    auth = {"Authorization": f"Bearer {KEY}"}
    said = [{"role": "user", "content": "Tenant check: name three colours. " * 8}]
    body = {"model": "m", "max_output_tokens": 6, "temperature": 0, "store": False, "user": "alice"}
    first = HTTP.post(f"{cluster.url}/v1/responses", json={**body, "input": said}, headers=auth, timeout=120)
    assert first.status_code == 200, first.text
    ident, holder = first.json()["id"], first.headers[REPLICA]
    wait_for(lambda: len(replica_names(HTTP.get(f"{cluster.url}/metrics", headers=auth).text)) == 2, 30)
    (other,) = replica_names(HTTP.get(f"{cluster.url}/metrics", headers=auth).text) - {holder}

    def moves() -> float:
        text = HTTP.get(f"{cluster.url}/metrics", headers=auth, timeout=30).text
        return metric(text, "llmsession_cluster_conversations_moved_total")

    def settled() -> float:  # (earlier tests' moves all posted: two readings two periods apart agree)
        readings = [moves()]
        while len(readings) < 2 or readings[-1] != readings[-2]:
            assert len(readings) < 20, readings
            time.sleep(2.0)
            readings.append(moves())
        return readings[-1]

    before = settled()
    pointed = {**body, "input": "And another?", "previous_response_id": ident.rsplit("_", 1)[0] + "_" + other}
    moved = HTTP.post(f"{cluster.url}/v1/responses", json=pointed, headers=auth, timeout=120)
    assert moved.status_code == 400 and moved.headers[REPLICA] == other, moved.text  # (not found)
    wait_for(lambda: moves() == before + 1, 30)  # (alice's: the conversation went with it)
    for user in ("bob", None):  # (another user; no user at all: another tenant too)
        back = {**body, "input": "And another?", "previous_response_id": ident, "user": user}
        refused = HTTP.post(f"{cluster.url}/v1/responses", json=back, headers=auth, timeout=120)
        assert refused.status_code == 400 and refused.headers[REPLICA] == holder, refused.text
        assert refused.json()["error"]["code"] == "previous_response_not_found", refused.text
    resent = [*said, *first.json()["output"], {"role": "user", "content": "And another?"}]
    again = HTTP.post(
        f"{cluster.url}/v1/responses", json={**body, "input": resent}, headers=auth, timeout=120
    )
    assert again.status_code == 200 and again.headers[REPLICA] == other, again.text
    assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    time.sleep(2.5)  # (a move made for bob's request would be posted by now)
    assert moves() == before + 1


def _key(session: str) -> str:
    headers = {"authorization": f"Bearer {KEY}", "x-session-id": session}
    return conversation_key("/v1/chat/completions", headers, b"{}")


def _long_stream(cluster: Cluster, session: str, done: threading.Event) -> None:
    said = [{"role": "user", "content": f"Write a long story about {session}."}]
    body = {"messages": said, "max_tokens": 300, "temperature": 1.0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "x-session-id": session}
    with HTTP.stream(
        "POST", f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=180
    ) as r:
        for _ in r.iter_lines():
            if done.is_set():
                return


def test_a_client_cannot_name_the_replica(cluster: Cluster) -> None:
    headers = {"Authorization": f"Bearer {KEY}", REPLICA: "forged", "x-llmsession-anything": "x"}
    response = HTTP.get(f"{cluster.url}/v1/models", headers=headers, timeout=30)
    assert response.status_code == 200 and response.headers[REPLICA] != "forged"
    assert response.headers.get_list(REPLICA) == [response.headers[REPLICA]]
    assert HTTP.get(f"{cluster.url}/v1/models", timeout=30).status_code == 401  # (auth still holds)
    # A body without a key is dropped by the front as it comes: the replica's 401, in each
    # door's words, to a client that asked for the connection to close too (its body all read).
    body = {"messages": [{"role": "user", "content": "Hi " * 500_000}], "max_tokens": 1}
    closing = {"Connection": "close"}
    refused = HTTP.post(f"{cluster.url}/v1/chat/completions", json=body, headers=closing, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    wrong = {"x-api-key": "sk-wrong", "anthropic-version": "2023-06-01"}
    refused = HTTP.post(f"{cluster.url}/v1/messages", json=body, headers=wrong, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def test_a_replica_killed_mid_run_and_every_conversation_goes_on(cluster: Cluster) -> None:
    """Conversations on both replicas (so the one killed held some: which process is which
    replica is not known here); each goes on (``converse`` checks every answer), those of the
    killed replica on another, the killed one answering none again."""
    holders: dict[str, str] = {}
    for index in range(12):
        name = f"held-{index}"
        holders[name] = converse(cluster, name, 1, name)[0].headers[REPLICA]
        if len(holders) >= 3 and len(set(holders.values())) == 2:
            break
    assert len(set(holders.values())) == 2, holders
    replicas = engine_processes()
    assert len(replicas) == 2, replicas
    os.kill(replicas[0], signal.SIGKILL)
    for index in range(6):  # new conversations, while Ray replaces the replica
        converse(cluster, f"after-kill-{index}", 2, f"after-kill-{index}")
    after = {name: converse(cluster, name, 2, name)[-1].headers[REPLICA] for name in holders}
    gone = set(holders.values()) - set(after.values())
    assert len(gone) == 1, (holders, after)  # (its conversations went on elsewhere)
    wait_for(lambda: cluster.serving_replicas() == 2, 120)  # (Ray replaced it)


def test_a_replica_killed_mid_stream_cuts_that_stream(cluster: Cluster) -> None:
    """The stream is cut, not ended as if finished (no ``[DONE]``) and not left hanging; the
    conversation goes on elsewhere."""
    said = [{"role": "user", "content": "Write a very long story about the sea."}]
    body = {"messages": said, "max_tokens": 2000, "temperature": 1.0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "x-session-id": "killed-mid-stream"}
    began = time.monotonic()
    rest: list[str] = []
    with HTTP.stream(
        "POST", f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(replica_pid(r.headers[REPLICA]), signal.SIGKILL)
        with pytest.raises(httpx.TransportError):  # (cut: a stream that merely ended would look finished)
            rest.extend(lines)
    assert time.monotonic() - began < 90
    assert "data: [DONE]" not in rest
    assert converse(cluster, "killed-mid-stream", 1, "killed-mid-stream")[0].status_code == 200
    wait_for(lambda: cluster.serving_replicas() == 2, 120)  # (Ray replaced it)


def replica_names(metrics: str) -> set[str]:
    return {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines() if 'replica="' in line}


def alive(name: str) -> bool:
    try:
        replica_pid(name)
    except AssertionError:
        return False
    return True


def replica_pid(name: str) -> int:
    """The process of the engine replica ``name`` (the one with its Serve log file open)."""
    for pid in engine_processes():
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if f"replica_llmsession_engine_{name}." in os.readlink(fd):
                        return pid
    raise AssertionError(f"no process for replica {name}")


def engine_processes() -> list[int]:
    """The engine replicas' processes (one starting counts too)."""
    return [pid for pid in ray_processes() if b"ServeReplica:llmsession:engine" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_sigterm_stops_every_process_it_started(cluster: Cluster) -> None:
    assert ray_processes() - cluster.before, "Ray is not running: the test proves nothing"
    cluster.process.send_signal(signal.SIGTERM)
    assert cluster.process.wait(120) == 0
    wait_for(lambda: not (ray_processes() - cluster.before), 60)


# -- the routing's pure parts ----------------------------------------------------------------------
def test_a_conversation_key_is_its_session_else_its_opening_within_its_tenant() -> None:
    alpha, beta = {"authorization": "Bearer a"}, {"authorization": "Bearer b"}
    chat = b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}'
    longer = (
        b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},'
        b' {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]}'
    )
    path = "/v1/chat/completions"
    assert conversation_key(path, alpha, chat) == conversation_key(path, alpha, longer)  # (resent)
    assert conversation_key(path, alpha, chat) != conversation_key(path, beta, chat)  # (tenants apart)
    with_session = {**alpha, "x-session-id": "s1"}
    assert conversation_key(path, with_session, chat) != conversation_key(
        path, with_session | {"x-session-id": "s2"}, chat
    )
    claude = {**alpha, "x-claude-code-session-id": "s1"}
    assert conversation_key("/v1/messages", claude, b"{}") == conversation_key("/v1/messages", claude, b"[1]")
    anthropic = b'{"system": "S", "messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}]}'
    responses = b'{"instructions": "S", "input": [{"role": "user", "content": "U"}], "prompt_cache_key": "k"}'
    assert conversation_key("/v1/messages", alpha, anthropic) != conversation_key(path, alpha, chat)
    assert conversation_key("/v1/responses", alpha, responses) == conversation_key(
        "/v1/responses", alpha, b'{"prompt_cache_key": "k"}'
    )
    assert conversation_key(path, alpha, b"\xff not json") == conversation_key(path, alpha, b"[]")
    # The tenant as the server names it: the key it authorizes (a Bearer token, else x-api-key)
    # and the user the body names; one user's conversation never shares another's key.
    users = [json.dumps({"user": name, "messages": []}).encode() for name in ("u1", "u2")]
    assert conversation_key(path, with_session, users[0]) != conversation_key(path, with_session, users[1])
    assert conversation_key(path, with_session, users[0]) != conversation_key(path, with_session, b"{}")
    nameless = json.dumps({"user": "", "messages": []}).encode()  # (the server's tenant differs too)
    assert conversation_key(path, with_session, nameless) != conversation_key(path, with_session, b"{}")
    said = [json.dumps({"metadata": {"user_id": name}}).encode() for name in ("u1", "u2")]
    assert conversation_key("/v1/messages", claude, said[0]) != conversation_key(
        "/v1/messages", claude, said[1]
    )
    safety = [json.dumps({"safety_identifier": name, "input": "U"}).encode() for name in ("u1", "u2")]
    assert conversation_key("/v1/responses", alpha, safety[0]) != conversation_key(
        "/v1/responses", alpha, safety[1]
    )
    basic = {"authorization": "Basic x", "x-session-id": "s1"}
    assert conversation_key(path, basic | {"x-api-key": "a"}, chat) != conversation_key(
        path, basic | {"x-api-key": "b"}, chat
    )
    assert conversation_key(path, {"x-api-key": "a"}, chat) == conversation_key(path, alpha, chat)
    # A response made under a key carries it: the next turn's previous_response_id routes there.
    made = response_id(conversation_key("/v1/responses", alpha, responses))
    chained = json.dumps({"previous_response_id": made, "input": "next"}).encode()
    assert conversation_key("/v1/responses", alpha, chained) == conversation_key(
        "/v1/responses", alpha, responses
    )
    assert len(response_id("not-a-key")) == len(response_id(None)) == len("resp_") + 32  # (no key in it)
    pinned = response_id("ab" * 16, "r1x")
    assert routing(f"/v1/responses/{pinned}", alpha, b"") == ("ab" * 16, "r1x")
    chain = json.dumps({"previous_response_id": pinned}).encode()
    assert routing("/v1/responses", alpha, chain) == ("ab" * 16, "r1x")
    for door in ("/v1/chat/completions", "/v1/messages", "/v1/completions"):  # (the field is no one's there)
        key, pinned_to = routing(door, alpha, chain)
        assert pinned_to is None and key != "ab" * 16, door
    assert response_id("ab" * 16, "bad name!").count("_") == 1  # (a name that is not one is left out)


def test_rendezvous_moves_only_the_keys_a_change_must_move() -> None:
    keys = [f"k{i}" for i in range(2000)]
    three, two = ["a", "b", "c"], ["a", "b"]
    before = {key: ranked(key, three)[0] for key in keys}
    after = {key: ranked(key, two)[0] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert all(before[key] == "c" for key in moved)  # only the removed replica's keys move
    assert 500 < sum(owner == "c" for owner in before.values()) < 834  # (about a third each)
    assert preferred("k1", three, ["c"])[0] == "c"  # a replica holding the state comes first
    assert preferred("k1", three, []) == ranked("k1", three)


def test_without_ray_the_command_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmsession.commands.cli import parser
    from llmsession.commands.serve_cluster import serve_replicas
    from llmsession.config import MemoryConfig, ModelConfig

    monkeypatch.setitem(sys.modules, "ray", None)  # (import ray: ModuleNotFoundError)
    args = parser().parse_args(["serve", "--replicas", "2"])
    assert serve_replicas(args, Path("model.gguf"), ModelConfig(), MemoryConfig(), {}) == 2
    assert "pip install 'llmsession[cluster]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "threads"),
    [([], 4), (["--max-replicas", "4"], 2), (["--max-replicas", "8"], 1)],
)
def test_the_cores_are_shared_among_the_most_replicas_that_may_run(
    monkeypatch: pytest.MonkeyPatch, options: list[str], threads: int
) -> None:
    """Autoscaling up to 4 replicas on 8 cores gave each 8 threads (the cores split by
    ``--replicas`` alone): 32 threads on 8 cores once scaled up."""
    from llmsession.cluster import run as running
    from llmsession.commands.cli import parser
    from llmsession.commands.serve_cluster import serve_replicas
    from llmsession.config import MemoryConfig, ModelConfig
    from llmsession.native import machine

    ran: list[RunCluster] = []
    monkeypatch.setattr(machine, "usable_cores", lambda: 8)
    monkeypatch.setattr(running, "run", ran.append)
    args = parser().parse_args(["serve", "--replicas", "2", *options])
    serve_replicas(args, Path("model.gguf"), ModelConfig(), MemoryConfig(), {})
    assert [cluster.config.threads for cluster in ran] == [threads]


def test_the_board_forgets_replicas_that_stopped_posting() -> None:
    """Its texts were only filtered when read: with autoscaling, it held every replica ever."""
    from llmsession.cluster.deployment import Boarded
    from llmsession.cluster.metrics import STALE_S

    board = Boarded()
    board.texts["gone"] = (time.monotonic() - STALE_S - 1, "m 1\n")
    board.put("r1", "m 2\n")
    assert list(board.texts) == ["r1"] and board.fresh() == {"r1": "m 2\n"}


def test_a_restore_its_client_left_during_is_still_told_once_it_brought_the_conversation() -> None:
    """The client gone while the state was restored here: the restore went on and the state
    came, but the replica never said it held the conversation (the one it left had let it go);
    and the client's retry at once ran beside it (found the file claimed, and began cold): it
    waits for the restore its first try left."""
    from types import SimpleNamespace

    from llmsession.cluster.handoff import Tenant
    from llmsession.cluster.peers import Mover

    go = threading.Event()
    order: list[str] = []

    def restore(key: str, tenant: Tenant) -> bool:
        order.append(f"begin {tenant.name}")
        if tenant.name == "first":
            go.wait(10)
        order.append(f"end {tenant.name}")
        return True

    handoff = SimpleNamespace(spill=SimpleNamespace(announce=lambda: None), restore=restore)
    mover = Mover(handoff, "r2", ("engine", "app"), asks=False)  # type: ignore[arg-type]
    told: list[str] = []

    async def leave_and_retry() -> bool:
        first = asyncio.ensure_future(
            mover.arrive("k" * 32, None, Tenant("first"), lambda: told.append("held"))
        )
        await asyncio.sleep(0.2)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        retry = asyncio.ensure_future(mover.arrive("k" * 32, None, Tenant("retry")))
        await asyncio.sleep(0.2)
        go.set()
        return await retry

    assert asyncio.run(leave_and_retry())
    assert told == ["held"] and order == ["begin first", "end first", "begin retry", "end retry"]
    assert mover._locks == {}


def test_plain_serve_imports_no_ray() -> None:
    code = (
        "import sys; from llmsession.commands.cli import parser; parser().parse_args(['serve']); "
        "import llmsession.serve.app, llmsession.commands.serve; assert 'ray' not in sys.modules, 'ray'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_replicas_metrics_merge_with_a_replica_label() -> None:
    one = '# HELP m_total M\n# TYPE m_total counter\nm_total{path="/a"} 3\nplain 1\n'
    two = '# HELP m_total M\n# TYPE m_total counter\nm_total{path="/a"} 4\n'
    text = merged({"r1": one, 'r"2': two})
    assert text.count("# TYPE m_total counter") == 1
    assert 'm_total{path="/a",replica="r1"} 3' in text and 'm_total{path="/a",replica="r\\"2"} 4' in text
    assert 'plain{replica="r1"} 1' in text and merged({}) == ""


def test_autoscaling_options_go_to_ray_and_a_bad_range_is_refused() -> None:
    base = RunCluster(Path("m.gguf"), None, None, {}, replicas=2, replica_cpus=1.0, host="h", port=1)
    assert base.engine_options()["num_replicas"] == 2 and "autoscaling_config" not in base.engine_options()
    scaled = dataclasses.replace(base, max_replicas=4, target_ongoing=2.0).engine_options()
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 2,
        "target_ongoing_requests": 2.0,
    }
    with pytest.raises(ValueError, match="within"):
        dataclasses.replace(base, min_replicas=3).engine_options()


def test_a_prefix_router_is_given_the_conversation_as_text() -> None:
    from llmsession.cluster.keys import prompt_text

    parts = b'[{"type": "text", "text": "U"}]'
    chat = b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": ' + parts + b"}]}"
    assert prompt_text("/v1/chat/completions", chat) == "S\nU"
    anthropic = b'{"system": "S", "messages": [{"role": "user", "content": "U"}]}'
    assert prompt_text("/v1/messages", anthropic) == "S\nU"
    assert prompt_text("/v1/responses", b'{"instructions": "I", "input": "U"}') == "I\nU"
    assert prompt_text("/v1/completions", b'{"prompt": "P"}') == "P"
    assert prompt_text("/v1/models", b"") == "/v1/models"  # (never empty: that router cannot route "")
    assert prompt_text("/x", b"[1, 2]") == "/x"


def test_the_cluster_bench_counts_a_turn_elsewhere_as_a_move() -> None:
    from llmsession.commands.bench.cluster import moves

    def request(conversation: int, turn: int, replica: str, prompt: int, cached: int) -> dict[str, Any]:
        return {"conversation": conversation, "turn": turn, "replica": replica, "sent_s": float(turn),
                "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 10}  # fmt: skip

    requests = [
        request(0, 1, "a", 600, 0),
        request(0, 2, "a", 640, 610),
        request(0, 3, "b", 680, 650),  # (moved with its state: decoded 30 of the 30 it added)
        request(1, 1, "b", 600, 0),
        request(1, 2, "a", 640, 0),  # (moved cold: decoded 640 of 30)
    ]
    found = {(m["conversation"], m["turn"]): m for m in moves(requests)}
    assert set(found) == {(0, 3), (1, 2)}
    assert found[0, 3]["added"] == 30 and found[0, 3]["ratio"] == 1.0
    assert found[1, 2]["decoded"] == 640 and found[1, 2]["ratio"] == 640 / 30


class Relayed:
    """A stand-in for a replica's answer as the front reads it (``DeploymentResponseGenerator``):
    its messages, and a cancel."""

    def __init__(self, messages: Any) -> None:
        self.messages, self.cancelled = messages, 0

    def __aiter__(self) -> Relayed:
        return self

    async def __anext__(self) -> Any:
        return await self.messages.__anext__()

    def cancel(self) -> None:
        self.cancelled += 1


def test_the_front_reads_no_body_of_a_caller_without_a_key() -> None:
    """The front kept, parsed (a thread's ``json.loads`` of up to the body limit) and shipped
    to a replica every request's body before a replica checked its key: 24 callers without one
    sending 8 MiB each took the front to 1.5 GiB. Now a caller who presents none of the
    servers' keys has its body read and dropped (not left unread: Ray's proxy would queue it)
    and is passed on without it (the replica answers the 401); a keyed caller's body is read
    and passed on whole. (The engine here is a stand-in that records what it is handed;
    ``test_a_client_cannot_name_the_replica`` has the real one's 401s.)"""
    import asyncio

    from llmsession.cluster.front import Front
    from llmsession.serve.access import Access

    handed: list[bytes] = []

    class Answer:
        def remote(self, scope: Any, body: bytes, *_: Any) -> Any:
            handed.append(body)

            async def messages() -> Any:
                yield {"type": "http.response.start", "status": 401, "headers": []}
                yield {"type": "http.response.body", "body": b"{}"}

            return Relayed(messages())

    class Engine:
        def options(self, **_: Any) -> Any:
            return type("Handle", (), {"answer": Answer()})()

    body = b'{"messages": [' + b" " * (1 << 20) + b"]}"
    pieces = [body[i : i + (1 << 18)] for i in range(0, len(body), 1 << 18)]

    def post(front: Front, key: str) -> tuple[int, int]:
        """(messages the front received, the status it sent) for a 1 MiB body in 5 pieces."""
        received: list[int] = []
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if len(received) == len(pieces):  # (as ASGI's past the body: nothing until a disconnect)
                await asyncio.Event().wait()
            received.append(1)
            return {"type": "http.request", "body": pieces[len(received) - 1], "more_body": len(received) < 5}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"authorization", f"Bearer {key}".encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
        asyncio.run(front.asgi(scope, receive, send))
        return len(received), sent[0]["status"]

    front = Front(Engine(), 8 << 20, board=None, access=Access(KEY, "sk-operator"))
    assert len(pieces) == 5 and post(front, "sk-wrong") == (5, 401) and handed == [b""]
    for key in (KEY, "sk-operator"):
        assert post(front, key) == (5, 401) and handed[-1] == body
    small = Front(Engine(), 1 << 19, board=None, access=Access(KEY, "sk-operator"))
    # (past the size: its 401 all the same; 3 pieces read for the body, a 4th by the front's
    # watch for the client leaving, which a piece ends)
    assert post(small, "sk-wrong") == (4, 401) and handed[-1] == b""
    assert post(small, KEY)[1] == 413
    open_front = Front(Engine(), 8 << 20, board=None, access=Access(None, "sk-operator"))
    post(open_front, "sk-wrong")
    assert handed[-1] == body  # (chat open to all: every body is passed on)


async def posted(front: Any, sent: list[Any]) -> None:
    """A chat request of ``{}`` through ``front`` (no key), what it sends back into ``sent``."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    await front.asgi(scope, receive, send)


def test_a_client_that_leaves_mid_answer_cancels_the_replicas_run() -> None:
    """Ray cancels the front's task for a client that left, not the replica's generator the
    front relays (its handle's stream): the replica decoded on to the end for nobody, its slot
    and its conversation busy. The front cancels the stream however its relay ends. (The engine
    is a stand-in whose stream records its cancel, as ``DeploymentResponseGenerator.cancel``.)"""
    from llmsession.cluster.front import Front

    class Stream:
        def __init__(self, endless: bool) -> None:
            self.endless, self.cancelled, self.sent = endless, 0, 0

        def __aiter__(self) -> Stream:
            return self

        async def __anext__(self) -> dict[str, Any]:
            self.sent += 1
            if self.sent == 1:
                return {"type": "http.response.start", "status": 200, "headers": []}
            if not self.endless and self.sent > 3:
                raise StopAsyncIteration
            await asyncio.sleep(0 if not self.endless else 0.01)
            return {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}

        def cancel(self) -> None:
            self.cancelled += 1

    streams: list[Stream] = []

    class Engine:
        def options(self, **_: Any) -> Any:
            class Answer:
                @staticmethod
                def remote(*_: Any) -> Stream:
                    streams.append(Stream(endless=len(streams) == 0))
                    return streams[-1]

            return type("Handle", (), {"answer": Answer()})()

    async def asked(leaves: bool) -> int:
        sent: list[Any] = []
        task = asyncio.ensure_future(posted(Front(Engine(), 1 << 20, board=None), sent))
        if leaves:
            while len(sent) < 3:
                await asyncio.sleep(0.01)
            task.cancel()  # (as Ray's proxy does for a client gone)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        else:
            await task
        return len(sent)

    assert asyncio.run(asked(leaves=True)) >= 3 and streams[0].cancelled == 1
    assert asyncio.run(asked(leaves=False)) == 3 and streams[1].cancelled == 1  # (ended: a no-op)


def handing(handed: list[bytes]) -> Any:
    """An engine deployment's stand-in whose replica answers every request a 401, keeping the
    bodies it was handed in ``handed``."""

    class Engine:
        def options(self, **_: Any) -> Any:
            class Answer:
                @staticmethod
                def remote(scope: Any, body: bytes, *_: Any) -> Any:
                    handed.append(body)

                    async def messages() -> Any:
                        yield {"type": "http.response.start", "status": 401, "headers": []}
                        yield {"type": "http.response.body", "body": b"{}"}

                    return Relayed(messages())

            return type("Handle", (), {"answer": Answer()})()

    return Engine


def test_a_caller_without_a_key_is_not_waited_for_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front read a keyless caller's body (to drop it) for as long as a keyed one's, a
    minute: a trickle of bytes on each connection held every place of the front. It is read
    for ``UNKEYED_BODY_S`` at most, then passed on without it (the replica's 401)."""
    from llmsession.cluster import front as front_module
    from llmsession.cluster.front import Front
    from llmsession.serve.access import Access

    monkeypatch.setattr(front_module, "UNKEYED_BODY_S", 0.3)
    handed: list[bytes] = []

    Engine = handing(handed)

    async def trickled(key: str) -> tuple[float, int]:
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(0.05)  # (a byte now and then, never the end)
            return {"type": "http.request", "body": b" ", "more_body": True}

        async def send(message: Any) -> None:
            sent.append(message)

        headers = [(b"authorization", f"Bearer {key}".encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
        began = time.monotonic()
        await asyncio.wait_for(
            Front(Engine(), 1 << 20, board=None, access=Access(KEY)).asgi(scope, receive, send), 30
        )
        return time.monotonic() - began, sent[0]["status"]

    took, status = asyncio.run(trickled("sk-wrong"))
    assert status == 401 and took < 3 and handed == [b""], (took, status)


def test_a_request_no_replica_takes_is_a_json_503() -> None:
    """Ray's own failures before an answer began (no replica yet, a replica's task failing)
    went past the front to Ray's proxy: a bare text 500. They are a 503 in JSON."""
    from llmsession.cluster.front import Front

    class Failing:
        cancelled = 0

        def __aiter__(self) -> Failing:
            return self

        async def __anext__(self) -> Any:
            raise RuntimeError("Deployment 'engine' has no replicas")  # (as Ray's own errors)

        def cancel(self) -> None:
            self.cancelled += 1

    failing = Failing()

    class Engine:
        def options(self, **_: Any) -> Any:
            answer = type("Answer", (), {"remote": staticmethod(lambda *_: failing)})()
            return type("Handle", (), {"answer": answer})()

    sent: list[Any] = []
    asyncio.run(posted(Front(Engine(), 1 << 20, board=None), sent))
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["error"]["code"] == 503
    assert failing.cancelled == 1


def test_the_router_makes_a_replicas_held_set_once_a_report() -> None:
    """The routing of every request looked each replica's reported conversations up in a set
    made again (4,096 keys: ~0.1 ms a replica, every routing round, on the front's loop): it is
    made once a report now, and a new report (Ray's: a new dict) is read at once."""
    from llmsession.cluster.router import ConversationRouter

    @dataclass
    class Replica:  # (what the router reads of Ray's RunningReplica)
        replica_id: str
        routing_stats: dict[str, Any]

    router = ConversationRouter.__new__(ConversationRouter)  # (Ray's base state is not read here)
    router._sets = {}
    replica = Replica("r1", {"conversations": [f"k{i}" for i in range(4096)]})
    first = router._held(replica)
    assert "k7" in first and router._held(replica) is first  # (the same report: the same set)
    replica.routing_stats = {"conversations": ["new"]}
    assert router._held(replica) == {"new"}
    replica.routing_stats = {"conversations": "not a list"}
    assert router._held(replica) == frozenset()


def test_a_client_that_leaves_is_heard_when_its_request_asked_ray_not_to() -> None:
    """A client's ``x-request-disconnect-disabled: ?1`` turns off Ray's proxy's cancel of the
    front for a client gone (the proxy reads it before the front sees the request): a reply
    then decoded on to the end for nobody. The front hears the disconnect itself, past the
    body, and cancels the replica's stream. (Stand-ins: an endless replica stream that records
    its cancel, a receive that says the client left after the body.)"""
    from llmsession.cluster.front import Front

    class Endless:
        cancelled = 0

        def __aiter__(self) -> Endless:
            return self

        async def __anext__(self) -> dict[str, Any]:
            await asyncio.sleep(0.01)
            return (
                {"type": "http.response.start", "status": 200, "headers": []}
                if not sent
                else {
                    "type": "http.response.body",
                    "body": b"data: x\n\n",
                    "more_body": True,
                }
            )

        def cancel(self) -> None:
            self.cancelled += 1

    stream, sent = Endless(), []

    class Engine:
        def options(self, **_: Any) -> Any:
            answer = type("Answer", (), {"remote": staticmethod(lambda *_: stream)})()
            return type("Handle", (), {"answer": answer})()

    bodies = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

    async def receive() -> dict[str, Any]:
        message = next(bodies, None)
        if message is None:
            await asyncio.sleep(0.3)  # (the client reads a while, then leaves)
            return {"type": "http.disconnect"}
        return message

    async def send(message: Any) -> None:
        sent.append(message)

    async def asked() -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await asyncio.wait_for(Front(Engine(), 1 << 20, board=None).asgi(scope, receive, send), 5)

    began = time.monotonic()
    asyncio.run(asked())
    assert time.monotonic() - began < 2 and stream.cancelled == 1 and len(sent) > 3, (
        len(sent),
        stream.cancelled,
    )


def test_keyless_uploads_never_hold_the_places_keyed_requests_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front's places in Ray were the replicas' (64 each) and a keyless body held one while
    it was read (5 s): 128 slow keyless uploads every 5 s held them all. Keyless bodies are read
    beside the answers now (``UNKEYED_READERS`` of them, places of their own in Ray), one past
    them not read at all, and a keyed request never waits for them."""
    from llmsession.cluster import front as front_module
    from llmsession.cluster.front import Front
    from llmsession.serve.access import Access

    monkeypatch.setattr(front_module, "UNKEYED_READERS", 2)
    handed: list[bytes] = []

    Engine = handing(handed)

    async def request(front: Front, key: str, trickle: bool) -> float:
        async def receive() -> dict[str, Any]:
            if trickle:
                await asyncio.sleep(0.05)  # (a byte now and then, never the end)
                return {"type": "http.request", "body": b" ", "more_body": True}
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(_: Any) -> None:
            pass

        headers = [(b"authorization", f"Bearer {key}".encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
        began = time.monotonic()
        await asyncio.wait_for(front.asgi(scope, receive, send), 30)
        return time.monotonic() - began

    async def flooded() -> tuple[list[float], float, float]:
        front = Front(Engine(), 1 << 20, board=None, access=Access(KEY), answers=1)
        slow = [asyncio.ensure_future(request(front, "sk-wrong", trickle=True)) for _ in range(2)]
        await asyncio.sleep(0.2)
        past = await request(front, "sk-wrong", trickle=True)  # (a third: not read)
        keyed = await request(front, KEY, trickle=False)  # (the one answer's place is free)
        return await asyncio.gather(*slow), past, keyed

    slow, past, keyed = asyncio.run(flooded())
    assert past < 0.5 and keyed < 0.5 and all(took > 4 for took in slow), (slow, past, keyed)
    assert sorted(handed) == [b"", b"", b"", b"{}"], handed
