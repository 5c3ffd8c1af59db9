"""A stored response while it streams, over real HTTP on the default SmolLM2 model: ``GET``
returns it ``in_progress`` (to its key only), a ``previous_response_id`` naming it is a 400,
``DELETE`` forgets it (it is not kept when it ends), and a client that leaves leaves nothing in
progress behind."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import KEY, OTHER_KEY, Served, serving

# A long reply (a count runs on), so the requests below land while it streams.
COUNTING = {"model": "m", "input": "Count from 1 to 300, separated by commas.", "max_output_tokens": 300}


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[Served]:
    with serving(smollm2_path) as served:
        yield served


def http(served: Served, key: str = KEY) -> httpx.Client:
    auth = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=served.url.removesuffix("/v1"), headers=auth, timeout=120)


def events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    return (json.loads(line[6:]) for line in lines if line.startswith("data: "))


def test_a_response_streaming_is_retrieved_in_progress_and_kept_once_it_ends(served: Served) -> None:
    with http(served) as client, http(served, OTHER_KEY) as other:
        with client.stream("POST", "/v1/responses", json={**COUNTING, "stream": True}) as streamed:
            seen = events(streamed.iter_lines())
            created = next(seen)
            assert created["type"] == "response.created"
            ident = created["response"]["id"]
            during = client.get(f"/v1/responses/{ident}")
            assert during.status_code == 200, during.text
            assert during.json() == created["response"] and during.json()["status"] == "in_progress"
            assert other.get(f"/v1/responses/{ident}").status_code == 404  # (another key's: unknown)
            assert other.delete(f"/v1/responses/{ident}").status_code == 404
            refused = client.post(
                "/v1/responses", json={"model": "m", "input": "Hi", "previous_response_id": ident}
            )
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
            assert "in progress" in refused.json()["error"]["message"]
            last = list(seen)[-1]
        assert last["type"] in ("response.completed", "response.incomplete"), last
        kept = client.get(f"/v1/responses/{ident}").json()
        assert kept == last["response"] and kept["status"] != "in_progress" and kept["output"]
        continued = client.post(
            "/v1/responses",
            json={"model": "m", "input": "Thanks.", "previous_response_id": ident, "max_output_tokens": 4},
        )
        assert continued.status_code == 200, continued.text


def test_a_response_deleted_while_it_streams_is_not_kept(served: Served) -> None:
    with http(served) as client:
        with client.stream("POST", "/v1/responses", json={**COUNTING, "stream": True}) as streamed:
            seen = events(streamed.iter_lines())
            ident = next(seen)["response"]["id"]
            deleted = client.delete(f"/v1/responses/{ident}")
            assert deleted.status_code == 200 and deleted.json() == {
                "id": ident,
                "object": "response",
                "deleted": True,
            }
            assert client.get(f"/v1/responses/{ident}").status_code == 404
            assert client.delete(f"/v1/responses/{ident}").status_code == 404  # (once)
            last = list(seen)[-1]
        assert last["type"] in ("response.completed", "response.incomplete"), last  # (it ran to its end)
        assert client.get(f"/v1/responses/{ident}").status_code == 404


def test_a_client_that_leaves_mid_stream_leaves_nothing_in_progress(served: Served) -> None:
    with http(served) as client:
        with client.stream("POST", "/v1/responses", json={**COUNTING, "stream": True}) as streamed:
            seen = events(streamed.iter_lines())
            ident = next(seen)["response"]["id"]
            next(seen)  # (response.in_progress)
            assert client.get(f"/v1/responses/{ident}").json()["status"] == "in_progress"
        # (the connection closed: the server cancels the reply, and keeps no part of it)
        deadline = time.monotonic() + 30
        while (
            status := client.get(f"/v1/responses/{ident}").status_code
        ) == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 404
