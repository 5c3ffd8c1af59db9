"""The conversation a request names within its tenant: a session header its client sends on
every request (Claude Code's ``X-Claude-Code-Session-Id``, Codex's ``session_id``,
``x-session-id``). Pure. The name is a digest of the tenant and the header's value, so a value
is never kept as sent and the same value under two tenants names two conversations. It labels
the session that answers (``Model.chat(conversation=...)``): side requests under the same name
neither take nor evict that conversation's main session (``runtime.keeping``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session_id", "session-id")
MAX_NAME = 512  # characters of a header's value that name the conversation


def digest(*parts: str) -> str:
    """32 hex digits naming ``parts`` (each length-prefixed: no two lists of parts collide)."""
    hashed = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        hashed.update(len(data).to_bytes(8, "little") + data)
    return hashed.hexdigest()


def tenant_name(key: str | None, user: str | None) -> str:
    """A tenant's name, as the server keeps records by it: ``owner/name``, the owner a sha256 of
    its key's digest (``Access.authorize``), the name one of the key and the ``user`` its request
    names (bounded, whatever was sent). The library shares kept sessions fairly between owners
    (``keeping``): a key that names many users has one share. Without a key (a server without
    keys) each user is its own owner, as before."""
    owner = hashlib.sha256(repr(key if key is not None else ("user", user)).encode()).hexdigest()[:32]
    return owner + "/" + hashlib.sha256(repr((key, user)).encode()).hexdigest()


def named_conversation(tenant: str, headers: Mapping[str, str]) -> str | None:
    """The conversation a request's session header names (32 hex digits), or None."""
    for header in SESSION_HEADERS:
        value = headers.get(header)
        if value:
            return digest(tenant, "header", value[:MAX_NAME])
    return None
