"""``llmsession serve``: an OpenAI-compatible HTTP server on a model's engine (``app.create_app``).

The request parsing (``schema``, ``images``), the response bodies and SSE chunks (``sse``), the
error bodies (``errors``) and the counters (``metrics``) are pure and import no web framework;
``runner`` runs exchanges in threads for an asyncio loop (no web framework either); only ``app``
and ``chat`` need Starlette.

``create_app(model, ...)`` is the documented way to embed the server in another ASGI app; it is
imported when first named, so ``import llmsession.serve`` loads no web framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmsession.serve.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from llmsession.serve.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
