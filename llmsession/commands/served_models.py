"""``llmsession models --url URL``: what a running server serves (``/v1/models``) and, on a server
of several models, what it holds now (``/api/ps``: size, uses in flight, when it unloads). The
standard library's HTTP client: no dependency beyond the package's own."""

from __future__ import annotations

import http.client
import json
import sys
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 30.0
MAX_BYTES = 4 << 20  # of an answer read


class _Unfollowed(urllib.request.HTTPRedirectHandler):
    """A redirect is an error, never followed: urllib would send the key to wherever it points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


OPENER = urllib.request.build_opener(_Unfollowed)


def fetch(url: str, key: str | None, optional: bool = False) -> Any:
    """A JSON object; None for an ``optional`` endpoint the server does not have (404, 400), or
    keeps for its operators (403: ``--operator-key``)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with OPENER.open(request, timeout=TIMEOUT_S) as response:
            answer = json.loads(response.read(MAX_BYTES))
    except urllib.error.HTTPError as failed:
        if optional and failed.code in (400, 403, 404):
            return None
        raise
    if not isinstance(answer, dict):
        raise ValueError(f"{url} answered {type(answer).__name__}, not a JSON object")
    return answer


def served(url: str, key: str | None) -> int:
    """Print the server's models and what it holds; 1 if it cannot be read."""
    base = url.rstrip("/").removesuffix("/models").removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        print(f"error: --url must be an http(s) address, got {url!r:.200}", file=sys.stderr)
        return 2
    try:
        listed = fetch(f"{base}/v1/models", key)
        held = fetch(f"{base}/api/ps", key, optional=True)  # (a server of one model has none)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as failed:
        print(f"error: cannot read {base}: {failed!s:.300}", file=sys.stderr)  # (a port's banner, say)
        return 1
    try:
        cards, models = _objects(listed, "data"), _objects(held, "models")
    except ValueError as failed:
        print(f"error: cannot read {base}: {failed}", file=sys.stderr)
        return 1
    print(f"models at {base}:")
    for card in cards:
        status = card.get("status")
        state = status.get("value") if isinstance(status, dict) else None
        context = card.get("context_size")
        line = f"  {card.get('id', '?')!s:40}  {state if isinstance(state, str) else 'loaded':9}"
        print(line + (f"  context {context}" if context else ""))
    for model in models:
        until = "-" if model.get("in_use") else model.get("expires_at") or "kept"
        size = model.get("size")
        mib = size / (1 << 20) if isinstance(size, int | float) and not isinstance(size, bool) else 0.0
        name, uses = model.get("name"), model.get("in_use")
        print(f"  loaded: {name!s:32}  {mib:8.1f} MiB  in use {uses}  until {until}")
    return 0


def _objects(answer: dict[str, Any] | None, field: str) -> list[dict[str, Any]]:
    """An answer's list of objects under ``field`` (none without the answer); a ValueError
    naming the field where it is something else."""
    items = (answer or {}).get(field, [])
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError(f"its {field!r} is not a list of objects")
    return items
