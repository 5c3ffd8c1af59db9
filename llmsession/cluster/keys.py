"""A request's conversation, and which replica should answer it. Pure: no Ray, no model.

The key is the conversation within its tenant (the API key that sent it): a session header a
client sends (``x-session-id``; Claude Code's ``X-Claude-Code-Session-Id``; Codex's
``session_id`` header, or ``prompt_cache_key`` in the body), the key a ``previous_response_id``
was made under (the front names each request's key to its replica, which puts it in the ids of
the responses it stores: the next turn goes where that response and its state are), else a
digest of how the conversation opens (its path, system prompt and first user message), which
every later turn of a resent conversation repeats, as the engine's own stateless routing finds a
prefix. Keys are digests: a header's value is never echoed into routing state.

Replicas are ranked for a key by rendezvous hashing (highest random weight): every replica set
gives each key one owner, and a change of the set moves only the keys the change must move
(those of a replica that left, or a share of the keys to a replica that came).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from llmsession.serve.naming import digest, named_conversation

BODY_KEYS = ("prompt_cache_key",)  # (a body field some clients set to their conversation)
CONVERSATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
MAX_KEYED_BODY = 16 << 20  # bodies larger than this are routed by their headers only
# A response's id (``serve.responses_sse.response_id``): the key it was made under, random digits,
# and the replica that stored it; a stored response's own path.
RESPONSE_ID = re.compile(r"resp_([0-9a-f]{32})[0-9a-f]{32}(?:_([A-Za-z0-9]{1,32}))?")
STORED = re.compile(r"/v1/responses/resp_([0-9a-f]{32})[0-9a-f]{32}(?:_([A-Za-z0-9]{1,32}))?")
PIN = "@"  # between a key and the replica it must reach, in a handle's session id
LAST = "~"  # between a key and the replica that answered it last (as a holder: it has the state)


def session_id(key: str, pinned: str | None, last: str | None) -> str:
    """What the front hands the router: the key, and the replica it must reach or, else, the one
    that last answered it (which holds its state before its report says so)."""
    if pinned is not None:
        return f"{key}{PIN}{pinned}"
    return key if last is None else f"{key}{LAST}{last}"


def parsed_session(session: str) -> tuple[str, str | None, str | None]:
    """``session_id``'s key, pinned replica and last replica."""
    key, _, pinned = session.partition(PIN)
    key, _, last = key.partition(LAST)
    return key, pinned or None, last or None


OPENING_CHARS = 4096  # of the system prompt and the first user message, enough to tell them apart


def tenant_of(path: str, headers: Mapping[str, str], parsed: Mapping[str, Any]) -> str:
    """Whose request this is, as the server names its tenant (``Server.authorize``, each door's
    user): its API key (a non-empty Bearer token, else ``x-api-key``) and the user its body
    names (``user``; on the Responses API else ``safety_identifier``; on the Messages API
    ``metadata.user_id``), as a digest. Two users of one key are two tenants there: their
    conversations must not share a key here, or a move of one would move the other's."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    credential = given.strip() if scheme.lower() == "bearer" else ""
    credential = credential or headers.get("x-api-key", "").strip()
    user = _user(path, parsed)  # (no user and an empty one are two tenants there too)
    return digest("tenant", credential, *(() if user is None else ("user", user)))


def user_of(path: str, body: bytes) -> str | None:
    """The user a request's body names (as ``tenant_of`` reads it), or None; whatever its size
    (the replica's server bounds it: read past the front's bound, a large request's user would
    be no one's, and its conversation never move)."""
    return _user(path, _parsed(body, limit=None))


def _user(path: str, parsed: Mapping[str, Any]) -> str | None:
    if path.startswith("/v1/messages"):
        metadata = parsed.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
    else:
        user = parsed.get("user")
        if user is None and path.startswith("/v1/responses"):
            user = parsed.get("safety_identifier")
    return user if isinstance(user, str) else None


def routing(path: str, headers: Mapping[str, str], body: bytes) -> tuple[str, str | None]:
    """A request's conversation key (``conversation_key``), and the replica it must reach, if
    any: the one that stored the response it continues (``previous_response_id``) or reads or
    deletes (``/v1/responses/{id}``), named in that response's id."""
    stored = STORED.fullmatch(path)
    if stored is not None:
        return stored.group(1), stored.group(2)
    parsed = _parsed(body)
    # (only where the field means something: on another door it pinned any request, of anyone
    # who had seen a response's id, to that response's replica, and moved its conversation)
    previous = parsed.get("previous_response_id") if path.startswith("/v1/responses") else None
    chained = RESPONSE_ID.fullmatch(previous) if isinstance(previous, str) else None
    if chained is not None:  # (the key the conversation's first response was made under)
        return chained.group(1), chained.group(2)
    return _key(path, headers, parsed), None


def conversational(scope: Mapping[str, Any]) -> bool:
    """Whether a request is a turn of a conversation (and so the replica that answers it holds
    its state): a POST to a door that answers one. A health probe, a model list or a stored
    response's retrieval holds nothing, and is never remembered as held."""
    return scope.get("method") == "POST" and scope.get("path") in CONVERSATION_PATHS


def conversation_key(path: str, headers: Mapping[str, str], body: bytes) -> str:
    """The conversation a request belongs to, within its tenant (``headers`` lower-cased)."""
    return routing(path, headers, body)[0]


def _key(path: str, headers: Mapping[str, str], parsed: Mapping[str, Any]) -> str:
    tenant = tenant_of(path, headers, parsed)
    named = named_conversation(tenant, headers)  # (a session header: as a server alone names it)
    if named is not None:
        return named
    for name in BODY_KEYS:
        value = parsed.get(name)
        if isinstance(value, str) and value:
            return digest(tenant, "body", value[:512])
    return digest(tenant, "opening", path, *_opening(parsed))


def _parsed(body: bytes, limit: int | None = MAX_KEYED_BODY) -> Mapping[str, Any]:
    if limit is not None and len(body) > limit:
        return {}
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _opening(body: Mapping[str, Any]) -> tuple[str, str]:
    """The system prompt and the first user message, as text, whichever API's shape they came
    in (chat's ``messages``, Anthropic's ``system``, the Responses API's ``instructions`` and
    ``input``, a completion's ``prompt``); empty where absent."""
    system = _text(body.get("system")) or _text(body.get("instructions"))
    first = ""
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
    if isinstance(items, str):
        first = items
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                continue
            role = item.get("role")
            if role in ("system", "developer") and not system:
                system = _text(item.get("content"))
            elif role == "user":
                first = _text(item.get("content"))
                break
    if not first:
        first = _text(body.get("prompt"))
    return system[:OPENING_CHARS], first[:OPENING_CHARS]


MAX_PROMPT_TEXT = 1 << 16  # characters of a request's text a text-matching router is given


def prompt_text(path: str, body: bytes) -> str:
    """A request's conversation as plain text (its system prompt and every message's text, in
    order), for a router that matches prefixes of text (Ray's prefix-cache router); the path
    when there is none (that router cannot route an empty text)."""
    parsed = _parsed(body)
    parts = [_text(parsed.get("system")) or _text(parsed.get("instructions"))]
    items = parsed.get("messages")
    items = parsed.get("input") if not isinstance(items, list) else items
    if isinstance(items, str):
        parts.append(items)
    elif isinstance(items, list):
        parts += [_text(item.get("content")) for item in items if isinstance(item, dict)]
    parts.append(_text(parsed.get("prompt")))
    return "\n".join(part for part in parts if part)[:MAX_PROMPT_TEXT] or path


def _text(value: object) -> str:
    """A content's text: a str, or the text of its parts (blocks) joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = [part.get("text") for part in value if isinstance(part, dict)]
        return "\n".join(text for text in texts if isinstance(text, str))
    return ""


def ranked(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` (stable names) in the order ``key`` prefers them: its owner first."""
    return sorted(replicas, key=lambda name: digest(key, name), reverse=True)


def preferred(key: str, replicas: Sequence[str], holders: Sequence[str]) -> list[str]:
    """``ranked``, except that replicas which report holding ``key``'s state come first (in
    their rank order): after the replica set changes, the state's holder answers, not the
    hash's new owner."""
    order = ranked(key, replicas)
    holding = set(holders)
    return [name for name in order if name in holding] + [name for name in order if name not in holding]
