"""``llmsession serve``: an OpenAI-compatible HTTP server on a model's engine (``app.create_app``).

The request parsing (``schema``), the response bodies and SSE chunks (``sse``), the error bodies
(``errors``) and the counters (``metrics``) are pure and import no web framework; only ``app``
and ``runner`` need Starlette and a running event loop.
"""
