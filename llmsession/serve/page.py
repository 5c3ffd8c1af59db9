"""The chat page of ``llmsession serve``: ``GET /`` and its static files.

The files live in ``static/`` inside the package (no build step, nothing from a CDN: the page
works on a machine without internet): the HTML, its CSS, and its script as ES modules,
``main.js`` and what it imports (``dom.js``, ``store.js``, ``api.js``, ``view.js``). They hold no
data, so they need no API key; the page asks for the key itself and calls only the server's OpenAI
endpoints. The page is served with a strict Content-Security-Policy: scripts only from the
server's own files (no inline script, no ``eval``; module scripts from the same origin are its
own), connections only to the server, images only from it or ``data:``/``blob:`` URLs (an image
the user attaches), so even markup that slipped into the page could neither run nor call out.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

STATIC = Path(__file__).resolve().parent / "static"
FILES = {  # what the page is made of, by the name in its URL (nothing else is served)
    "main.js": "text/javascript; charset=utf-8",  # (a module: loaded with type="module")
    "dom.js": "text/javascript; charset=utf-8",
    "store.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "view.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data: blob:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


@cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


async def index(request: Request) -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    kind = FILES.get(name)
    if kind is None:
        return Response("not found", 404, media_type="text/plain", headers=HEADERS)
    return Response(_read(name), media_type=kind, headers=HEADERS)


def routes() -> list[Route]:
    """The page's routes, without authorization (they hold no data)."""
    return [
        Route("/", index, methods=["GET"]),
        Route("/static/{name}", static, methods=["GET"]),
    ]
