"""``llmsession serve``: an OpenAI-compatible HTTP server on a model's engine (``app.create_app``).

The request parsing (``schema``, ``images``), the response bodies and SSE chunks (``sse``), the
error bodies (``errors``) and the counters (``metrics``) are pure and import no web framework;
``runner`` runs exchanges in threads for an asyncio loop (no web framework either); only ``app``
and ``chat`` need Starlette.
"""
