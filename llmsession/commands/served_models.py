"""``llmsession models --url URL``: what a running server serves (``/v1/models``) and, on a server
of several models, what it holds now (``/api/ps``: size, uses in flight, when it unloads). The
standard library's HTTP client: no dependency beyond the package's own."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 30.0
MAX_BYTES = 4 << 20  # of an answer read


def fetch(url: str, key: str | None, optional: bool = False) -> Any:
    """A JSON object; None for an ``optional`` endpoint the server does not have (404, 400)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer = json.loads(response.read(MAX_BYTES))
    except urllib.error.HTTPError as failed:
        if optional and failed.code in (400, 404):
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
    except (urllib.error.URLError, OSError, ValueError) as failed:
        print(f"error: cannot read {base}: {failed}", file=sys.stderr)
        return 1
    print(f"models at {base}:")
    for card in (listed or {}).get("data", []):
        state = (card.get("status") or {}).get("value", "loaded")
        context = card.get("context_size")
        print(f"  {card.get('id', '?')!s:40}  {state:9}" + (f"  context {context}" if context else ""))
    for model in (held or {}).get("models", []):
        until = "-" if model.get("in_use") else model.get("expires_at") or "kept"
        size = model.get("size", 0) / (1 << 20)
        name, uses = model.get("name"), model.get("in_use")
        print(f"  loaded: {name!s:32}  {size:8.1f} MiB  in use {uses}  until {until}")
    return 0
