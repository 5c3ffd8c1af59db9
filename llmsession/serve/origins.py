"""Which web pages may use the server: a browser's request from another origin, and one that
names the server by a host it does not answer to, are refused before anything runs (403).

A page on another web origin cannot read a response without CORS (``cors_origins``), but it can
send one: a form or a ``text/plain`` fetch needs no preflight, and on a server without keys (the
default, on 127.0.0.1) that is a chat, a load or an unload on the visitor's machine. A browser
names the page's origin in ``Origin`` on every such request; clients that are not browsers
(curl, the SDKs, agents) send none and are not affected. A page that rebinds its own DNS name
to 127.0.0.1 is, to the browser, same-origin: its requests name that host in ``Host``, which a
server without keys does not answer to (only to ``LOOPBACK_NAMES``, IP addresses, which no page
can rebind, and the names given, ``allowed_hosts``). As Ollama guards its local server
(CVE-2024-28224).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from llmsession.serve.errors import ApiError
from llmsession.serve.http import drain
from llmsession.serve.messages_sse import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"  # in ``allowed_hosts``: any host name
SAFE = ("GET", "HEAD", "OPTIONS")  # methods that change nothing here


def is_loopback(host: str) -> bool:
    """Whether a bind address is a loopback one (``localhost``, 127.0.0.0/8, ``::1``)."""
    name = host_name(host)
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(netloc: str) -> str:
    """A ``Host`` header's or an origin's host, without its port (``[::1]:8080`` is ``::1``)."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:].partition("]")[0]
    return (netloc.rpartition(":")[0] if netloc.count(":") == 1 else netloc).rstrip(".")


class Origins:
    """ASGI middleware: a request with an ``Origin`` that is neither the server's own (the chat
    page) nor one of ``cors_origins`` is refused; so is one whose ``Host`` is neither an IP
    address, a loopback name nor one of ``allowed_hosts`` (None, or ``ANY_HOST`` among them:
    any host)."""

    def __init__(
        self, app: ASGIApp, cors_origins: Sequence[str], allowed_hosts: Sequence[str] | None
    ) -> None:
        self.app, self.cors = app, normal_origins(cors_origins)
        anyone = allowed_hosts is None or ANY_HOST in allowed_hosts
        self.hosts = None if anyone else {host_name(h) for h in (*LOOPBACK_NAMES, *(allowed_hosts or ()))}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        why = self._refused(headers, str(scope.get("method", "GET")))
        if why is None:
            await self.app(scope, receive, send)
            return
        whole = await drain(Request(scope, receive))  # (its body read first: ``http.drain``)
        error = ApiError(why, status=403, kind="permission_error")
        anthropic = str(scope.get("path", "")).startswith("/v1/messages")  # (its paths: its bodies)
        body = error_body(error) if anthropic else error.body()
        answer = JSONResponse(body, 403, headers=None if whole else {"connection": "close"})
        await answer(scope, receive, send)

    def _refused(self, headers: dict[str, str], method: str) -> str | None:
        host, origin = headers.get("host", ""), headers.get("origin")
        if self.hosts is not None and host and not self._answers(host_name(host)):  # (none: no browser)
            return "this server does not answer to that host name (--allowed-host adds one)"
        stripped = headers.get("sec-fetch-site") in ("cross-site", "same-site") and method not in SAFE
        if origin is None and stripped:  # (a browser's request from another origin, Origin taken off;
            origin = "null"  # a link followed sends none: it reads nothing and changes nothing)
        if origin is None or origin.rstrip("/").lower() in self.cors or "*" in self.cors:
            return None
        if headers.get("sec-fetch-site") == "same-origin":  # (a browser's word: no page can set it)
            return None  # (the server's own page, behind a proxy that names it otherwise)
        parts = urlsplit(origin)
        if parts.scheme in ("http", "https") and _netloc(origin) == _netloc(f"{parts.scheme}://{host}"):
            return None  # (the server's own page)
        return "a page on another web origin may not call this server (--cors-origin names one)"

    def _answers(self, name: str) -> bool:
        """Whether a ``Host`` names this server: an IP address (a page cannot rebind one: its
        origin would be that address, not a name its owner points anywhere), or a name allowed."""
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return self.hosts is not None and name in self.hosts
        return True


def normal_origins(origins: Sequence[str]) -> set[str]:
    """Web origins as requests name them (lower case, no trailing ``/``): what ``Origins`` and
    the CORS middleware compare alike (a ``--cors-origin https://App.example/`` let its page's
    requests run, but CORS never matched it: its answers were never readable)."""
    return {origin.rstrip("/").lower() for origin in origins}


def _netloc(url: str) -> tuple[str, int | None]:
    """A URL's host (``host_name``) and port, the scheme's default port made explicit."""
    try:
        parts = urlsplit(url.strip().lower())
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return ("", None)
    return host_name(parts.netloc.rpartition("@")[2]), port
