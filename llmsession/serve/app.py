"""The Starlette application of ``llmsession serve``: OpenAI's chat and raw completions, its
Responses API (``responding``) and Anthropic's messages on a model.

Each route's key is checked in one place (``http.guarded``); a route reads and checks a request
(``schema``, ``messages``, in a worker thread, a few at a time: a large body is neither parsed on
the event loop nor held by many requests at once), then hands it to ``chat.Call`` with its API's
way of answering (``doors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from llmsession.api.model import Model
from llmsession.api.models import Models
from llmsession.config import SessionConfig
from llmsession.errors import ModelClosedError
from llmsession.options import INT32_MAX
from llmsession.serve import embeddings, operators, responding, sse
from llmsession.serve.access import Access, Keys, heeded
from llmsession.serve.bodies import Bodies
from llmsession.serve.body import parse_json
from llmsession.serve.chat import Call, Caller, ClientGone, Door, Host, dropped, session_settings, unless_gone
from llmsession.serve.doors import CompletionDoor, MessagesDoor
from llmsession.serve.errors import ApiError
from llmsession.serve.hosts import ManyModels, OneModel
from llmsession.serve.http import Counting, guarded, refusing
from llmsession.serve.messages import messages_request
from llmsession.serve.messages_sse import error_body
from llmsession.serve.metrics import Metrics
from llmsession.serve.naming import named_conversation, tenant_name
from llmsession.serve.origins import ANY_HOST, Origins, normal_origins
from llmsession.serve.page import routes as page_routes
from llmsession.serve.runner import Admission
from llmsession.serve.schema import ChatRequest, chat_request, completion_request
from llmsession.serve.store import ResponseStore
from llmsession.serve.tally import Tally, keys_share
from llmsession.serve.translation import Volatile
from llmsession.text.tools import replaced_options

MAX_BODY_BYTES = 8 << 20
CONVERSATION_HEADER = "x-llmsession-conversation"  # a cluster's front names the conversation
FRONT_KEY = re.compile(r"[0-9a-f]{32}")  # (how it names them: ``cluster.keys``)
REPLICA_HEADER = "x-llmsession-replica"  # and its replica names itself
MAX_COUNTING = 32  # count_tokens requests waiting or counting at once; past it a 503
KEYS_COUNTING = 16  # of them one key's, at most (one key's flood left no place for the others)
# Text of a system prompt that changes every request and carries nothing for the model: removed
# before rendering, so a resent conversation is read from the cache (``create_app``). Claude
# Code's billing line, up to its per-request hash (``cch=<hex>;``) and the line break after it,
# where a line begins with it, its hash within 1,024 characters: a pattern is matched against
# hostile text, so its work must stay linear (unbounded, a megabyte of headers took minutes).
VOLATILE_LINES = (r"(?m)^x-anthropic-billing-header:[^\n]{0,1024}?cch=[0-9a-fA-F]*;[ \t]*\n?",)


class Server:
    """What the routes share: the host of the calls (model, admission, counters), the keys'
    digests, the body limit."""

    def __init__(
        self,
        hosts: OneModel | ManyModels,
        *,
        api_keys: Keys,
        max_body_bytes: int,
        operator_keys: Keys = None,
        draft: str | None = None,
        volatile: Volatile | None = None,
    ) -> None:
        self.hosts = hosts
        self.volatile = volatile or Volatile(())
        self.draft = draft  # every request's drafted tokens (the API has no field for them)
        self.metrics = hosts.metrics
        self.model_name = hosts.names[0]  # (the one model's, or the first of several)
        self.access = Access(api_keys, operator_keys)
        access = self.access  # (each key keeps a share of the stored responses: one more for no key)
        self.store = ResponseStore(owners=max(1, len(access.tenants)) + len(access.operators))
        self.authorize, self.authorize_operator = self.access.authorize, self.access.authorize_operator
        self.max_body_bytes = max_body_bytes
        self.bodies = Bodies(max_body_bytes)
        self.parsing = self.bodies.parsing
        # Counts of tokens at once: an image's waits for the projector while a chat's image is
        # encoded, and with a parser's slot held, four stalled every request's body.
        self.counting = asyncio.Semaphore(2)
        self.embedding = asyncio.Semaphore(1)  # (an embedding run takes the cores, as a decode)
        self.waiting = Tally()  # requests waiting for either (``embeddings.MAX_WAITING``, ``MAX_COUNTING``)
        self.created = int(time.time())
        self.fronted = False  # a cluster's replica: the front names each request's conversation

    def front_named(self, request: Request) -> tuple[str | None, str | None]:
        """The conversation key and replica name a cluster's front and replica gave a request
        (``cluster``), or Nones: on a server no front stands before, a client's headers name
        nothing (a key sent as it is would be one label across tenants)."""
        if not self.fronted:
            return None, None
        return request.headers.get(CONVERSATION_HEADER), request.headers.get(REPLICA_HEADER)

    @property
    def host(self) -> Host:
        """The one model's host (a server of one model)."""
        if not isinstance(self.hosts, OneModel):
            raise TypeError("a server of several models has a host per loaded model")
        return self.hosts.host

    @property
    def admission(self) -> Admission:
        return self.host.admission

    def parsed_body(
        self, request: Request, limit: int | None = None
    ) -> contextlib.AbstractAsyncContextManager[bytes]:
        """The request's body, read and bounded (``bodies``), a parser's slot held in the block."""
        return self.bodies.parsed(request, limit)

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.hosts.closed:
            return JSONResponse({"status": "closed"}, 503)
        if self.access.tenants or self.access.operators:  # (open: what is served is the keys')
            return JSONResponse({"status": "ok"})
        several = {"models": self.hosts.names} if isinstance(self.hosts, ManyModels) else {}
        return JSONResponse({"status": "ok", "model": self.model_name, **several})

    async def models(self, request: Request) -> Response:
        """The models, as OpenAI's list and Anthropic's page at once (each client reads its own
        fields: ``anthropic``'s ``models.list()`` needs ``has_more`` and each ``display_name``)."""
        cards = [self._card(c, request) for c in await asyncio.to_thread(self.hosts.cards)]
        first, last = (cards[0]["id"], cards[-1]["id"]) if cards else (None, None)
        return JSONResponse(
            {"object": "list", "data": cards, "has_more": False, "first_id": first, "last_id": last}
        )

    async def model_card(self, request: Request) -> Response:
        name = request.path_params["name"]
        cards = await asyncio.to_thread(self.hosts.cards)
        chosen = next((c for c in cards if c["id"] == name), None)
        if chosen is None:
            raise ApiError(f"no model {name!r:.80}", "model", "model_not_found", 404)
        return JSONResponse(self._card(chosen, request))

    def _card(self, card: dict[str, Any], request: Request) -> dict[str, Any]:
        """A model's card with OpenAI's ``created`` and Anthropic's ``type``, ``display_name`` and
        ``created_at``; its ``status`` (loaded, loading now: another tenant's doing) only to an
        operator, on a server with operator keys (as ``/api/ps``)."""
        made = datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc).isoformat()
        if not request.state.operator:
            card = {key: value for key, value in card.items() if key != "status"}
        return {
            **card,
            "created": self.created,
            "type": "model",
            "display_name": card["id"],
            "created_at": made,
        }

    async def metrics_text(self, request: Request) -> Response:
        """The counters: the whole server's, for an operator (any key, on a server without
        operator keys: ``access``)."""
        states: list[str] = []
        for model in self.hosts.loaded():
            with contextlib.suppress(ModelClosedError):  # (unloaded meanwhile)
                report = await asyncio.to_thread(model.memory)  # (it waits for the engine's lock)
                states += [session.state for session in report.sessions]
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
        served = self.hosts.served(asked.model)  # (an unknown model: 404 before it runs)
        completion = sse.Completion(served, asked.include_usage, text=text, logprobs=scored)
        return CompletionDoor(completion)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (``messages``): the same engine and tenants as a chat's."""
        asked = await self.read(request, self._messages_request)
        return await self.answer(request, asked, MessagesDoor(self.hosts.served(asked.model)))

    def _messages_request(self, body: bytes, counting: bool = False) -> ChatRequest:
        """A Messages body checked, its images as the model it names takes them (one without
        images reads each as a line of text): counted as it is answered."""
        parsed = parse_json(body)
        named = parsed.get("model") if isinstance(parsed, dict) else None
        images = self.hosts.images(named if isinstance(named, str) else None)
        return messages_request(parsed, counting=counting, images=images)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's ``count_tokens``: the prompt's tokens, as a message's usage adds them up
        (what was decoded and what was reused)."""
        asked = await self.read(request, lambda body: self._messages_request(body, counting=True))
        options, tenant = asked.options, tenant_name(request.state.key, asked.user)
        waited = self.hosts.held(asked.model, heeded(request, asked.keep_alive), request.state.key)
        try:
            host, held = await unless_gone(request, waited, dropped)
        except ClientGone:
            return Response(status_code=499)  # (nobody reads it)
        try:
            config = session_settings(host.settings, asked)  # (as the call's)
            with self.waiting.counting(  # (each holds its request, parsed)
                ("count_tokens", MAX_COUNTING, "too many token counts are waiting"),
                (
                    ("count_tokens", request.state.key),
                    keys_share(request.state.key, KEYS_COUNTING),
                    "too many of this key's token counts are waiting",
                ),
            ):
                async with self.counting:  # (a few at once, off the event loop; not a parser's slot)
                    size = await asyncio.to_thread(  # (an image's tokens as the projector makes them)
                        host.model.prompt_size,
                        asked.messages,
                        tools=options.tools,
                        tool_choice=options.tool_choice,
                        tenant=tenant,
                        config=config,
                    )
        finally:
            held.drop()
        return JSONResponse({"input_tokens": size})

    async def read(self, request: Request, checked: Callable[[bytes], ChatRequest]) -> ChatRequest:
        """A request's body, read and checked (a few at once, off the event loop), its system
        prompt's volatile lines dropped."""
        volatile = self.volatile

        def read(body: bytes) -> ChatRequest:
            asked = checked(body)
            return dataclasses.replace(asked, messages=volatile.dropped(asked.messages))

        async with self.parsed_body(request) as body:  # (a few parsed at once, off the event loop)
            return await asyncio.to_thread(read, body)

    async def answer(self, request: Request, asked: ChatRequest, door: Door) -> Response:
        key: str | None = request.state.key  # (``guarded`` asked ``authorize``)
        if self.draft is not None:  # (the exchange leaves them out where they are unsound)
            asked = dataclasses.replace(asked, options=replaced_options(asked.options, draft=self.draft))
        tenant = tenant_name(key, asked.user)
        named = self.front_named(request)[0] or ""  # (the front's key: a label only)
        if FRONT_KEY.fullmatch(named):
            conversation: str | None = named
        else:  # (a session header the client sends: ``naming``)
            conversation = named_conversation(tenant, request.headers)
        waited = self.hosts.held(asked.model, heeded(request, asked.keep_alive), key)
        try:  # (a model of several may be loading: the client may leave meanwhile)
            host, held = await unless_gone(request, waited, dropped)
        except ClientGone:
            return Response(status_code=499)  # (nobody reads it)
        try:
            limit = host.admission.limit
            if asked.n > limit:
                raise ApiError(f"n: at most {limit} choices on this server (max_live_sessions)", "n")
            call = Call(host, request, asked, Caller(tenant, conversation), door, held)
        except BaseException:
            held.drop()
            raise
        return await call.respond()  # (it drops its hold once it answered)

    @staticmethod
    def checked(body: bytes) -> ChatRequest:
        return chat_request(parse_json(body), INT32_MAX)


ANTHROPIC_HEADERS = ("x-api-key", "anthropic-version", "anthropic-beta")


def routes(server: Server) -> list[Route]:
    """Every endpoint, behind the server's keys (the page and ``/health`` open), each answering
    its errors in its API's body."""
    keyed, operating = server.authorize, server.authorize_operator
    return [
        *page_routes(),  # the chat page at / (no data in it: no key needed)
        Route("/health", guarded(server.health), methods=["GET"]),  # (open: a load balancer's probe)
        Route("/metrics", guarded(server.metrics_text, operating), methods=["GET"]),
        Route("/v1/models", guarded(server.models, keyed), methods=["GET"]),
        *[
            Route(path, guarded(functools.partial(route, server), operating), methods=[method])
            for path, route, method in operators.ROUTES
        ],
        Route(
            "/v1/embeddings",
            guarded(functools.partial(embeddings.embeddings, server), keyed),
            methods=["POST"],
        ),
        Route("/v1/models/{name:path}", guarded(server.model_card, keyed), methods=["GET"]),
        Route("/v1/chat/completions", guarded(server.chat, keyed), methods=["POST"]),
        Route("/v1/completions", guarded(server.completions, keyed), methods=["POST"]),
        *[
            Route(path, guarded(functools.partial(route, server), keyed), methods=methods)
            for path, route, methods in (
                ("/v1/responses", responding.create, ["POST"]),
                ("/v1/responses/{id}", responding.stored, ["GET", "DELETE"]),
            )
        ],
        Route("/v1/messages", guarded(server.messages, keyed, error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(server.count_tokens, keyed, error_body), methods=["POST"]),
    ]


def create_app(
    model: Model | Models,
    *,
    api_key: str | Sequence[str] | None = None,
    operator_key: str | Sequence[str] | None = None,
    model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    queue: int = 64,
    cors_origins: Sequence[str] = (),
    draft: str | None = None,
    session: SessionConfig | None = None,
    volatile_lines: Sequence[str] = VOLATILE_LINES,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The server's ASGI app on ``model`` (which the caller opens and closes): one model, which
    answers whatever model a request names; or several (``Models``), each request answered by
    the one its ``model`` field names (an unknown one: 404), loaded for it. ``api_key``: one
    key or several; with any, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``
    (or ``x-api-key: KEY``, as Anthropic's clients send it) and each key is a tenant of its
    own. ``operator_key``: one or several; with any, only they may load and unload models, read
    ``/api/ps`` and ``/metrics`` and set a model's ``keep_alive`` (``access``).
    ``queue``: requests that may wait for room before a 503.
    ``cors_origins``: the web origins whose pages may call the API (none by default: a request
    a browser sends from another origin is refused, ``origins``). ``allowed_hosts``: the host
    names requests may name the server by, besides IP addresses and ``origins.LOOPBACK_NAMES``
    (against DNS rebinding: a page that points its own name at the server); ``["*"]``: any;
    None (the default): any on a server with keys (a page has none), else no other. ``draft``: drafted tokens
    for every request (``GenerationOptions.draft``).
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
    hosts: OneModel | ManyModels
    if isinstance(model, Models):
        if model_name is not None:
            raise ValueError("a server of several models names each by its Models name: no model_name")
        hosts = ManyModels(model, settings, queue, Metrics())
    else:  # (one model: a ``Model``, or what behaves as one)
        hosts = OneModel(model, model_name or model.path.stem, settings, queue, Metrics())
    volatile = Volatile(volatile_lines)
    server = Server(hosts, api_keys=api_key, operator_keys=operator_key, max_body_bytes=max_body_bytes)
    server.draft, server.volatile = draft, volatile
    refused = refusing({"/v1/messages": error_body})  # (Anthropic's paths: its error bodies)
    app = Starlette(routes=routes(server), exception_handlers={ApiError: refused, HTTPException: refused})
    _guarded(app, cors_origins, [ANY_HOST] if allowed_hosts is None and api_key else allowed_hosts or ())
    app.add_middleware(Counting, metrics=server.metrics)
    app.state.server = server
    return app


def _guarded(app: Starlette, cors_origins: Sequence[str], allowed_hosts: Sequence[str]) -> None:
    """The web origins and host names the app answers to (``origins``; CORS for those given)."""
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=sorted(normal_origins(cors_origins)),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", *ANTHROPIC_HEADERS],
        )
    app.add_middleware(Origins, cors_origins=list(cors_origins), allowed_hosts=allowed_hosts)
