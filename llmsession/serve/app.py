"""The Starlette application of ``llmsession serve``: OpenAI's chat and raw completions and
Anthropic's messages on a model.

Each route's key is checked in one place (``http.guarded``); a route reads and checks a request
(``schema``, ``messages``, in a worker thread, a few at a time: a large body is neither parsed on
the event loop nor held by many requests at once), then hands it to ``chat.Call`` with its API's
way of answering (``doors``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from llmsession.config import SessionConfig
from llmsession.options import INT32_MAX
from llmsession.replies import Reply, assistant_message
from llmsession.serve import sse
from llmsession.serve.body import parse_json
from llmsession.serve.chat import Call, Caller, Door, Host, session_settings
from llmsession.serve.doors import CompletionDoor, MessagesDoor, ResponsesDoor
from llmsession.serve.errors import ApiError
from llmsession.serve.http import Counting, declared, guarded, refuse
from llmsession.serve.messages import messages_request
from llmsession.serve.messages_sse import error_body
from llmsession.serve.naming import named_conversation
from llmsession.serve.page import routes as page_routes
from llmsession.serve.responses import responses_ask, responses_request
from llmsession.serve.responses_sse import ResponseObject, response_id
from llmsession.serve.runner import Admission
from llmsession.serve.schema import ChatRequest, chat_request, completion_request
from llmsession.serve.store import ResponseStore
from llmsession.serve.translation import Volatile
from llmsession.text.tools import replaced_options

if TYPE_CHECKING:
    from llmsession.api.model import Model

MAX_BODY_BYTES = 8 << 20
PARSERS = 4  # requests reading or checking their body at once
CONVERSATION_HEADER = "x-llmsession-conversation"  # a cluster's front names the conversation
FRONT_KEY = re.compile(r"[0-9a-f]{32}")  # (how it names them: ``cluster.keys``)
REPLICA_HEADER = "x-llmsession-replica"  # and its replica names itself
# Text of a system prompt that changes every request and carries nothing for the model: removed
# before rendering, so a resent conversation is read from the cache (``create_app``). Claude
# Code's billing line, up to its per-request hash (``cch=<hex>;``) and the line break after it.
VOLATILE_LINES = (r"x-anthropic-billing-header:[^\n]*?cch=[0-9a-fA-F]*;[ \t]*\n?",)


def not_found(kind: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(f"no {kind} with id {ident!r:.80}", param, "not_found", 404)


def digest(*parts: str | None) -> str:
    """A tenant's name: a sha256 of its key's digest and its ``user`` (bounded, whatever the
    user sent; the library keeps records by tenant)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class Server:
    """What the routes share: the host of the calls (model, admission, counters), the keys'
    digests, the body limit."""

    def __init__(
        self,
        model: Model,
        *,
        api_keys: Sequence[str],
        model_name: str,
        max_body_bytes: int,
        queue: int,
        settings: SessionConfig,
        draft: str | None = None,
        volatile: Volatile | None = None,
    ) -> None:
        admission = Admission(model.memory().max_live_sessions, queue)
        self.volatile = volatile or Volatile(())
        self.store = ResponseStore()
        self.draft = draft  # every request's drafted tokens (the API has no field for them)
        self.host = Host(model, model_name, settings, admission)
        self.model, self.model_name, self.metrics = model, model_name, self.host.metrics
        self.keys = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self.max_body_bytes = max_body_bytes
        self.parsing = asyncio.Semaphore(PARSERS)
        self.created = int(time.time())

    @property
    def admission(self) -> Admission:
        return self.host.admission

    def authorize(self, request: Request) -> str | None:
        """Who is calling: its key's digest (None without keys); else a 401. Digests are
        compared, so the time taken says nothing of a key's length; every key is compared."""
        if not self.keys:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        if not token:  # (Anthropic's clients send theirs as x-api-key)
            token = request.headers.get("x-api-key", "").strip().encode()
        presented = hashlib.sha256(token).digest()
        matched = [hmac.compare_digest(presented, key) for key in self.keys]
        if not any(matched):
            raise ApiError("invalid or missing API key", None, "invalid_api_key", 401)
        return self.keys[matched.index(True)].hex()

    async def body(self, request: Request) -> bytes:
        """The request body, refused (413) past the size limit before it is all read."""
        too_big = ApiError(
            f"the request body is over the limit of {self.max_body_bytes} bytes", None, None, 413
        )
        if declared(request) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        request.state.body_asked = True  # (a client waiting for 100 Continue is now sending)
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError("the client went away", None, None, 499) from None
        request.state.body_read = True  # (``drain`` reads no further)
        return b"".join(chunks)

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.model.closed:
            return JSONResponse({"status": "closed"}, 503)
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model_card(self, request: Request) -> Response:
        if request.path_params["name"] != self.model_name:
            raise ApiError(f"no model {request.path_params['name']!r:.80}", "model", "model_not_found", 404)
        return JSONResponse(self.card())

    def card(self) -> dict[str, Any]:
        images = self.model.mmproj_path is not None
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "llmsession",
            "capabilities": {"images": images, "tools": True, "json_schema": True},
        }

    async def metrics_text(self, request: Request) -> Response:
        """The counters: the whole server's, whichever key asks (``README``)."""
        states: list[str] = []
        if not self.model.closed:
            report = await asyncio.to_thread(self.model.memory)  # (it waits for the engine's lock)
            states = [session.state for session in report.sessions]
        return PlainTextResponse(self.metrics.render(states), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        """A raw prompt continued without the chat template (``Model.complete_stream``)."""
        asked = await self.read(request, lambda body: completion_request(parse_json(body)))
        return await self.answer(request, asked, self.completion_door(asked, text=True))

    async def chat(self, request: Request) -> Response:
        asked = await self.read(request, self.checked)
        return await self.answer(request, asked, self.completion_door(asked))

    def completion_door(self, asked: ChatRequest, *, text: bool = False) -> CompletionDoor:
        scored = asked.options.logprobs is not None
        completion = sse.Completion(self.model_name, asked.include_usage, text=text, logprobs=scored)
        return CompletionDoor(completion)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (``messages``): the same engine and tenants as a chat's."""
        images = self.model.mmproj_path is not None
        asked = await self.read(request, lambda body: messages_request(parse_json(body), images=images))
        return await self.answer(request, asked, MessagesDoor(self.model_name))

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's ``count_tokens``: the prompt's tokens, as a message's usage adds them up
        (what was decoded and what was reused)."""
        asked = await self.read(request, lambda body: messages_request(parse_json(body), counting=True))
        if any(
            not isinstance(m["content"], str | None) and any(p["type"] != "text" for p in m["content"])
            for m in asked.messages
        ):
            raise ApiError("count_tokens counts text-only transcripts here", "messages")
        options, tenant = asked.options, digest(request.state.key, asked.user)
        config = session_settings(self.host.settings, asked)  # (as the call's)
        async with self.parsing:  # (a few at once, off the event loop)
            tokens = await asyncio.to_thread(
                self.model.prompt_tokens,
                asked.messages,
                tools=options.tools,
                tool_choice=options.tool_choice,
                tenant=tenant,
                config=config,
            )
        return JSONResponse({"input_tokens": len(tokens)})

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API (``responses``): a ``previous_response_id`` continues that
        response's transcript (the stateless sessions hold its state: only the new input is
        decoded); ``store`` keeps the response for retrieval and continuation."""
        key: str | None = request.state.key
        async with self.parsing:
            body = await self.body(request)
            ask = await asyncio.to_thread(lambda: responses_ask(parse_json(body)))
            history: list[dict[str, Any]] = []
            if ask.previous is not None:
                stored = self.store.get(ask.previous, key)
                if stored is None:
                    raise not_found("response", ask.previous, "previous_response_id")
                history = stored.transcript
            asked = await asyncio.to_thread(responses_request, ask, history)
            transcript = asked.messages.messages()[1 if ask.instructions else 0 :]
            dropped = await asyncio.to_thread(self.volatile.dropped, asked.messages)
        asked = dataclasses.replace(asked, messages=dropped)
        named = request.headers.get(CONVERSATION_HEADER), request.headers.get(REPLICA_HEADER)
        ident = response_id(*named)  # (a cluster's front and replica name them: ``cluster``)
        response = ResponseObject(self.model_name, ask.echo, ask.previous, ask.store, ident)

        def keep(body: dict[str, Any], reply: Reply) -> None:
            self.store.put(key, body, [*transcript, assistant_message(reply)])

        return await self.answer(request, asked, ResponsesDoor(response, keep if ask.store else None))

    async def stored_response(self, request: Request) -> Response:
        ident = request.path_params["id"]
        stored = self.store.get(ident, request.state.key)
        if stored is None:
            raise not_found("response", ident)
        if request.method == "DELETE":
            self.store.delete(ident, request.state.key)
            return JSONResponse({"id": ident, "object": "response", "deleted": True})
        return JSONResponse(stored.body)

    async def read(self, request: Request, checked: Callable[[bytes], ChatRequest]) -> ChatRequest:
        """A request's body, read and checked (a few at once, off the event loop), its system
        prompt's volatile lines dropped."""
        volatile = self.volatile

        def read(body: bytes) -> ChatRequest:
            asked = checked(body)
            return dataclasses.replace(asked, messages=volatile.dropped(asked.messages))

        async with self.parsing:  # (a few bodies in memory at once; parsed off the event loop)
            body = await self.body(request)
            return await asyncio.to_thread(read, body)

    async def answer(self, request: Request, asked: ChatRequest, door: Door) -> Response:
        key: str | None = request.state.key  # (``guarded`` asked ``authorize``)
        if self.draft is not None:  # (the exchange leaves them out where they are unsound)
            asked = dataclasses.replace(asked, options=replaced_options(asked.options, draft=self.draft))
        limit = self.admission.limit
        if asked.n > limit:
            raise ApiError(f"n: at most {limit} choices on this server (max_live_sessions)", "n")
        tenant = digest(key, asked.user)
        named = request.headers.get(CONVERSATION_HEADER, "")  # (the front's key: a label only)
        if FRONT_KEY.fullmatch(named):
            conversation: str | None = named
        else:  # (a session header the client sends: ``naming``)
            conversation = named_conversation(tenant, request.headers)
        return await Call(self.host, request, asked, Caller(tenant, conversation), door).respond()

    @staticmethod
    def checked(body: bytes) -> ChatRequest:
        return chat_request(parse_json(body), INT32_MAX)


ANTHROPIC_HEADERS = ("x-api-key", "anthropic-version", "anthropic-beta")


def routes(server: Server) -> list[Route]:
    """Every endpoint, behind the server's keys (the page and ``/health`` open), each answering
    its errors in its API's body."""
    keyed = server.authorize
    return [
        *page_routes(),  # the chat page at / (no data in it: no key needed)
        Route("/health", guarded(server.health), methods=["GET"]),  # (open: a load balancer's probe)
        Route("/metrics", guarded(server.metrics_text, keyed), methods=["GET"]),
        Route("/v1/models", guarded(server.models, keyed), methods=["GET"]),
        Route("/v1/models/{name:path}", guarded(server.model_card, keyed), methods=["GET"]),
        Route("/v1/chat/completions", guarded(server.chat, keyed), methods=["POST"]),
        Route("/v1/completions", guarded(server.completions, keyed), methods=["POST"]),
        Route("/v1/responses", guarded(server.responses, keyed), methods=["POST"]),
        Route("/v1/responses/{id}", guarded(server.stored_response, keyed), methods=["GET", "DELETE"]),
        Route("/v1/messages", guarded(server.messages, keyed, error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(server.count_tokens, keyed, error_body), methods=["POST"]),
    ]


def create_app(
    model: Model,
    *,
    api_key: str | Sequence[str] | None = None,
    model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    queue: int = 64,
    cors_origins: Sequence[str] = (),
    draft: str | None = None,
    session: SessionConfig | None = None,
    volatile_lines: Sequence[str] = VOLATILE_LINES,
) -> Starlette:
    """The server's ASGI app on ``model`` (which the caller opens and closes). ``api_key``: one
    key or several; with any, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``
    (or ``x-api-key: KEY``, as Anthropic's clients send it) and each key is a tenant of its
    own. ``queue``: requests that may wait for room before a 503.
    ``cors_origins``: the web origins whose pages may call the API (none by default: a page
    elsewhere cannot read its answers). ``draft``: drafted tokens for every request
    (``GenerationOptions.draft``).
    ``session``: every stateless session's settings (``context_size``, ...; its ``system``
    must be None: a request's system prompt is in its messages).
    ``volatile_lines``: regular expressions; what one of them matches in a request's system
    prompt is removed before rendering (by default Claude Code's billing line, whose hash
    changes every request: kept, it would make every turn a full prefill)."""
    settings = session or SessionConfig()
    if not isinstance(settings, SessionConfig):
        raise TypeError(f"session must be a SessionConfig, got {type(settings).__name__}")
    if settings.system is not None:
        raise ValueError("a request's system prompt is in its messages: session.system must be None")
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not isinstance(key, str) or not key for key in keys):
        raise ValueError("an API key must be a non-empty str")
    name = model_name or model.path.stem
    server = Server(
        model,
        api_keys=keys,
        model_name=name,
        max_body_bytes=max_body_bytes,
        queue=queue,
        settings=settings,
        draft=draft,
        volatile=Volatile(volatile_lines),
    )
    app = Starlette(routes=routes(server), exception_handlers={ApiError: refuse, HTTPException: refuse})
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", *ANTHROPIC_HEADERS],
        )
    app.add_middleware(Counting, metrics=server.metrics)
    app.state.server = server
    return app
