"""Who may call, and who may run the server: the tenants' API keys, and the operators' keys.

Every key is a tenant of its own. What changes the server for everyone (loading and unloading
models, ``/api/ps``, ``/metrics``, and a request's ``keep_alive``, which sets how long its model
stays loaded once idle) is the operators': on a server given operator keys, a tenant's key gets a
403 there and its ``keep_alive`` is not heeded (the server's own policy holds); on one without,
every caller is an operator, as before. An operator key is a tenant key too. Only the keys'
digests are kept, and every one is compared, so the time taken says nothing of a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from llmsession.serve.errors import ApiError

if TYPE_CHECKING:
    from starlette.requests import Request


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


Keys = str | Sequence[str] | None  # one key, several, or none


def presentable(key: str) -> bool:
    """Whether a key is one a request can present, as it is: printable ASCII (a header carries
    no other) without whitespace (a Bearer token has none; one around it is dropped). The one
    rule for keys given to ``create_app`` and on ``serve``'s command line or in its files."""
    return bool(key) and not any(c.isspace() or not c.isprintable() or not c.isascii() for c in key)


def _checked(keys: Keys, what: str) -> list[str]:
    listed = [keys] if isinstance(keys, str) else list(keys or [])
    if any(not isinstance(key, str) or not key for key in listed):
        raise ValueError(f"an {what} must be a non-empty str")
    if not all(presentable(key) for key in listed):
        raise ValueError(f"an {what} must be printable ASCII without whitespace (a header carries no other)")
    return listed


class Access:
    """The keys a server takes (``api_keys``: tenants; ``operator_keys``: operators)."""

    def __init__(self, api_keys: Keys = None, operator_keys: Keys = None) -> None:
        self.tenants = [_digest(key) for key in _checked(api_keys, "API key")]
        self.operators = [_digest(key) for key in _checked(operator_keys, "operator key")]

    def authorize(self, request: Request) -> str | None:
        """Who is calling: its key's digest (None on a server without tenant keys, for a caller
        that presents no operator's); else a 401. ``request.state.operator`` says whether it may
        do what operators do."""
        presented = _presented(request.headers)
        operator, tenant = _match(presented, self.operators), _match(presented, self.tenants)
        request.state.operator = not self.operators or operator is not None
        if operator is not None:
            return operator.hex()
        if not self.tenants:
            return None
        if tenant is None:
            raise ApiError("invalid or missing API key", None, "invalid_api_key", 401)
        return tenant.hex()

    def authorize_operator(self, request: Request) -> str | None:
        """``authorize``, and a 403 for a caller that is not an operator."""
        key = self.authorize(request)
        if not request.state.operator:
            message = "this is the server's operators' to do: it needs an operator key (--operator-key)"
            raise ApiError(message, None, "permission_denied", 403)
        return key

    def admits(self, headers: Mapping[str, str]) -> bool:
        """Whether a request with these (lower-cased) headers is a caller's whom ``authorize``
        takes: what a front checks before it reads a body (an unkeyed one is not read)."""
        presented = _presented(headers)
        matched = _match(presented, self.operators) or _match(presented, self.tenants)
        return not self.tenants or matched is not None


def _presented(headers: Mapping[str, str]) -> bytes:
    """The digest of the key a request presents: a Bearer token, else Anthropic's
    ``x-api-key`` (else the empty key's, which no server takes)."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    token = given.strip().encode() if scheme.lower() == "bearer" else b""
    if not token:  # (Anthropic's clients send theirs as x-api-key)
        token = headers.get("x-api-key", "").strip().encode()
    return hashlib.sha256(token).digest()


def _match(presented: bytes, digests: Sequence[bytes]) -> bytes | None:
    matched = [hmac.compare_digest(presented, digest) for digest in digests]  # (all compared)
    return digests[matched.index(True)] if any(matched) else None


def heeded(request: Request, keep_alive: float | None) -> float | None:
    """A request's ``keep_alive`` if its caller may set it (an operator), else None."""
    return keep_alive if getattr(request.state, "operator", False) else None  # (unasked: not heeded)
