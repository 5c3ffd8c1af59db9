"""A browser's request from another web origin (a form, a ``text/plain`` fetch: no preflight),
and one that names the server by a host a server bound to a loopback address does not answer to
(a page that rebinds its DNS name to 127.0.0.1), are refused with a 403 before anything runs;
clients that are not browsers (no ``Origin``), the server's own page and the origins given are
answered as before (``serve.origins``). Over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from serve_helpers import running

from llmsession import Model
from llmsession.commands.cli import parser
from llmsession.commands.serve import allowed_hosts
from llmsession.serve.app import create_app
from llmsession.serve.origins import LOOPBACK_NAMES, host_name, is_loopback

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def test_host_names_and_loopback_addresses() -> None:
    hosts = ("localhost:8080", "[::1]:80", "127.0.0.1", "EXAMPLE.com:1", "::1", "[::1]")
    assert [host_name(h) for h in hosts] == ["localhost", "::1", "127.0.0.1", "example.com", "::1", "::1"]
    assert all(map(is_loopback, ("localhost", "127.0.0.1", "127.5.0.1", "::1", "[::1]")))
    assert not any(map(is_loopback, ("0.0.0.0", "192.168.1.2", "example.com", "::", "")))
    serve = parser().parse_args(["serve", "--allowed-host", "box.internal"])
    assert allowed_hosts(serve) == [*LOOPBACK_NAMES, "127.0.0.1", "box.internal"]  # (the default bind)
    public = parser().parse_args(["serve", "--host", "0.0.0.0"])  # (no key: its names, and addresses)
    assert allowed_hosts(public) == [*LOOPBACK_NAMES, "0.0.0.0"]
    assert allowed_hosts(parser().parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k"])) is None
    with pytest.raises(ValueError, match="not a URL"):
        allowed_hosts(parser().parse_args(["serve", "--allowed-host", "http://box"]))


@pytest.fixture(scope="module")
def url(smollm2: Model) -> Iterator[str]:
    app = create_app(
        smollm2, cors_origins=["https://ok.example"], allowed_hosts=[*LOOPBACK_NAMES, "box.internal"]
    )
    with running(app) as url:
        yield url


def test_pages_elsewhere_and_rebound_names_are_refused(url: str) -> None:
    port = httpx.URL(url).port
    chat = f"{url}/chat/completions"
    with httpx.Client(timeout=60) as http:
        assert http.post(chat, json=CHAT).status_code == 200  # (no Origin: not a browser)
        for origin in (f"http://127.0.0.1:{port}", "https://ok.example"):  # (its own page; one given)
            assert http.post(chat, json=CHAT, headers={"Origin": origin}).status_code == 200, origin
        forged = http.post(
            chat,
            content=json.dumps(CHAT),
            headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
        )
        assert forged.status_code == 403 and "another web origin" in forged.json()["error"]["message"]
        assert http.post(chat, json=CHAT, headers={"Origin": "null"}).status_code == 403
        stripped = {"Sec-Fetch-Site": "cross-site"}  # (a browser's, its Origin taken off by an extension)
        assert http.post(chat, json=CHAT, headers=stripped).status_code == 403
        assert http.post(chat, json=CHAT, headers={"Sec-Fetch-Site": "none"}).status_code == 200  # (typed in)
        followed = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}  # (a link: no Origin)
        assert http.get(f"{url}/models", headers=followed).status_code == 200
        messages = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        anthropic = http.post(f"{url}/messages", json=messages, headers={"Origin": "https://evil.example"})
        assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"  # (Anthropic's body)
        proxied = {"Origin": "https://chat.example", "Sec-Fetch-Site": "same-origin"}  # (its own page)
        assert http.post(chat, json=CHAT, headers=proxied).status_code == 200
        default_port = {"Host": "localhost:80", "Origin": "http://localhost"}
        assert http.get(f"{url}/models", headers=default_port).status_code == 200
        for host in (f"localhost:{port}", f"box.internal:{port}", f"[::1]:{port}"):
            assert http.get(f"{url}/models", headers={"Host": host}).status_code == 200, host
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}  # (same-origin)
        refused = http.post(chat, json=CHAT, headers=rebound)
        assert refused.status_code == 403 and "host name" in refused.json()["error"]["message"]
        assert http.get(f"{url}/models", headers={"Host": "evil.example"}).status_code == 403


def test_a_server_without_keys_answers_to_addresses_and_the_names_given(smollm2: Model) -> None:
    """A server without keys answered to any host name unless told otherwise (a library user's
    ``create_app``, ``serve --host 0.0.0.0``): a page that pointed its own name at it was
    same-origin, and chatted, loaded and unloaded on the visitor's machine. By default it answers
    to IP addresses (no page can rebind one) and the loopback names; ``allowed_hosts`` names
    more, ``"*"`` any; a server with keys answers to any (a page has no key)."""
    from serve_helpers import KEY

    with running(create_app(smollm2)) as url, httpx.Client(timeout=60) as http:
        assert http.get(f"{url}/models", headers={"Host": "box.example"}).status_code == 403
        for host in ("10.0.0.5:8080", "[fe80::1]:80", "localhost"):
            assert http.get(f"{url}/models", headers={"Host": host}).status_code == 200, host
        assert http.get(f"{url}/models", headers={"Origin": "https://evil.example"}).status_code == 403
    for settings in ({"allowed_hosts": ["*"]}, {"allowed_hosts": ["box.example"]}, {"api_key": KEY}):
        with running(create_app(smollm2, **settings)) as url, httpx.Client(timeout=60) as http:
            asked = http.get(
                f"{url}/models", headers={"Host": "box.example", "Authorization": f"Bearer {KEY}"}
            )
            assert asked.status_code == 200, settings


def test_cors_origins_are_compared_as_browsers_name_them(smollm2: Model) -> None:
    """``cors_origins=["https://App.example/"]`` let that page's requests run (the origin check
    lower-cases and drops the slash) while CORS compared it as written: its answers were never
    readable. Both compare it as a browser names it now."""
    with (
        running(create_app(smollm2, cors_origins=["https://App.example/"])) as url,
        httpx.Client(timeout=60) as http,
    ):
        page = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        preflight = http.options(f"{url}/chat/completions", headers=page)
        assert (
            preflight.status_code == 200
            and preflight.headers["access-control-allow-origin"] == "https://app.example"
        )
        asked = http.post(f"{url}/chat/completions", json=CHAT, headers={"Origin": "https://app.example"})
        assert (
            asked.status_code == 200 and asked.headers["access-control-allow-origin"] == "https://app.example"
        )
