"""A whole answer's JSON, rendered in slices off the event loop. Pure.

Python's JSON encoder holds the GIL for as long as one call runs: a chat reply of 4,096 tokens
with 20 top logprobs each is 5.5 MB of JSON, one call of ~0.4 s during which the event loop,
though the call runs in another thread, cannot run (every stream stalls). Rendered here, a long
list is encoded ``SLICE`` items at a call, so the interpreter may hand the GIL to the loop
between calls; the bytes are the same as Starlette's ``JSONResponse`` renders. A ``Fragment`` is
JSON text made already (a reply's scores: ``sse``), placed as it is.
"""

from __future__ import annotations

import json
from typing import Any

SLICE = 64  # a long list's items per encoder call (~6 ms for a token's 20 top logprobs each)
SHALLOW = 16  # a list this short is walked item by item (a reply's choices, output items)
DEPTH = 8  # how deep the walk looks for long lists (below: one call, whatever it holds)


class Fragment:
    """JSON text already rendered, placed as it is by ``rendered`` (``json`` refuses it: never
    written as a string by mistake)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def rendered(value: Any) -> bytes:
    """``value`` as JSON bytes, as ``JSONResponse`` renders it, no long list in one call."""
    parts: list[str] = []
    _render(value, parts, 0)
    return "".join(parts).encode()


def _render(value: Any, parts: list[str], depth: int) -> None:
    if isinstance(value, Fragment):
        parts.append(value.text)
    elif depth < DEPTH and isinstance(value, dict) and all(isinstance(key, str) for key in value):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append(("," if i else "") + _dumps(key) + ":")
            _render(item, parts, depth + 1)
        parts.append("}")
    elif depth < DEPTH and isinstance(value, list | tuple) and len(value) <= SHALLOW:
        parts.append("[")
        for i, item in enumerate(value):
            parts.append("," if i else "")
            _render(item, parts, depth + 1)
        parts.append("]")
    elif isinstance(value, list | tuple) and len(value) > SLICE:
        slices = (_dumps(list(value[at : at + SLICE]))[1:-1] for at in range(0, len(value), SLICE))
        parts.append("[" + ",".join(slices) + "]")
    else:
        parts.append(_dumps(value))
