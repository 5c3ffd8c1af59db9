"""A scale-down on a real local Ray instance moves conversations with their state:
``serve --replicas 2`` under Ray's autoscaling (``--min-replicas 1``, a target no load reaches,
``--downscale-delay``) with a shared ``--disk-cache-dir``. Ray removes one replica; it saves the
conversations it kept there before it stops, and their next turns, on the replica left, decode
only what is new. A file changed in the folder meanwhile is refused: that conversation's turn
decodes its whole prompt, and still answers. Ray's start and the delay make this module take
about a minute; ``test_cluster.py`` has the fixed-size cluster's tests."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plain_http import HTTP
from test_cluster import KEY, REPLICA, Cluster, metric, ray_processes, running, wait_for

from llmsession.cluster.keys import conversation_key, ranked

CONVERSATIONS = 6
DOWNSCALE_S = 25  # (from when Ray's autoscaler first sees the idle replicas: after start-up)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cluster-moves")


@pytest.fixture(scope="module")
def scaling(smollm2_path: Path, shared: Path) -> Iterator[Cluster]:
    options = ["--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "64"]
    options += ["--downscale-delay", str(DOWNSCALE_S), "--disk-cache-dir", str(shared / "disk")]
    with running(smollm2_path, shared, *options) as started:
        yield started


def turn(cluster: Cluster, said: list[dict[str, Any]], session: str) -> httpx.Response:
    response = cluster.chat(said, session)
    assert response.status_code == 200, response.text
    said.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    return response


def test_a_scale_down_moves_conversations_with_their_state(scaling: Cluster, shared: Path) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    talks: dict[str, list[dict[str, Any]]] = {}
    firsts: dict[str, httpx.Response] = {}
    wait_for(lambda: len(_serving(scaling)) == 2, 60)  # (both report: their names are known)
    replicas = sorted(_serving(scaling))
    owners = {f"moving-{i}": ranked(_key(f"moving-{i}"), replicas)[0] for i in range(100)}
    names = [n for n in owners if owners[n] == replicas[0]][: CONVERSATIONS // 2]
    names += [n for n in owners if owners[n] == replicas[1]][: CONVERSATIONS // 2]  # (half on each)
    for index, name in enumerate(names):
        talks[name] = [
            {"role": "system", "content": f"You are assistant {index}. " * 12},
            {"role": "user", "content": "Name a colour."},
        ]
        firsts[name] = turn(scaling, talks[name], name)
    first_replicas = {response.headers[REPLICA] for response in firsts.values()}

    def scaled_down() -> bool:
        text = HTTP.get(f"{scaling.url}/metrics", headers=auth, timeout=30).text
        return "llmsession_cluster_replicas 1\n" in text

    wait_for(scaled_down, 180)
    folder = shared / "disk" / "conversations"
    saved = sorted(folder.glob("*.conversation"))
    moved = [name for name, response in firsts.items() if response.headers[REPLICA] not in _serving(scaling)]
    assert len(first_replicas) == 2 and moved, "both replicas answered, and one was removed"
    assert len(saved) == len(moved)  # (every conversation the removed replica kept)
    spoiled = saved[0]
    data = bytearray(spoiled.read_bytes())
    data[len(data) // 2] ^= 0x10  # (a byte of one state: its checksum no longer holds)
    spoiled.write_bytes(bytes(data))
    for name, said in talks.items():
        said.append({"role": "user", "content": "And another?"})
        usage = turn(scaling, said, name).json()["usage"]
        before = firsts[name].json()["usage"]
        new = usage["prompt_tokens"] - before["prompt_tokens"] - before["completion_tokens"]
        decoded = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        if _key(name) == spoiled.name.removesuffix(".conversation"):
            assert name in moved and decoded == usage["prompt_tokens"], usage  # (refused: from scratch)
        else:  # (held, or moved with its state: only what is new)
            assert 0 < decoded <= new + 1, (name, name in moved, before, usage)

    def counted() -> bool:  # (replicas post their metrics every second)
        text = HTTP.get(f"{scaling.url}/metrics", headers=auth, timeout=30).text
        restored = metric(text, "llmsession_cluster_conversations_restored_total")
        refused = metric(text, "llmsession_cluster_conversations_refused_total")
        return restored == len(moved) - 1 and refused == 1

    wait_for(counted, 30)
    assert list(folder.glob("*.conversation")) == []  # (claimed: removed once loaded, or refused)


def _key(session: str) -> str:
    headers = {"authorization": f"Bearer {KEY}", "x-session-id": session}
    return conversation_key("/v1/chat/completions", headers, b"{}")


def _serving(cluster: Cluster) -> set[str]:
    text = HTTP.get(f"{cluster.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return {line.split('replica="')[1].split('"')[0] for line in text.splitlines() if 'replica="' in line}


def test_sigterm_saves_the_conversations_and_stops_every_process(scaling: Cluster, shared: Path) -> None:
    assert ray_processes() - scaling.before, "Ray is not running: the test proves nothing"
    scaling.process.send_signal(signal.SIGTERM)
    assert scaling.process.wait(120) == 0
    wait_for(lambda: not (ray_processes() - scaling.before), 60)
    kept = list((shared / "disk" / "conversations").glob("*.conversation"))
    assert len(kept) == CONVERSATIONS  # (the last replica saved all it kept, for the next start)
