"""``POST /v1/embeddings``, as OpenAI documents it: ``input`` as a string, a list of strings, a
list of token ids or a list of those; ``encoding_format`` ``float`` (default) or ``base64``
(little-endian float32, as OpenAI's clients decode it); ``dimensions`` only as the model's own;
usage in prompt tokens. Answered by ``Model.embed`` (an embedding model; a chat model: 400)."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmsession.errors import ContextOverflowError, ModelOutputError
from llmsession.serve.access import heeded
from llmsession.serve.body import parse_json, string
from llmsession.serve.chat import ClientGone, unless_gone
from llmsession.serve.errors import ApiError
from llmsession.serve.schema import keep_alive_of
from llmsession.serve.tally import keys_share

if TYPE_CHECKING:
    from llmsession.api.model import Model
    from llmsession.serve.operators import Server

MAX_INPUTS = 2048  # OpenAI's limit on inputs a request
MAX_WAITING = 32  # embedding requests waiting for the one run at a time; past it a 503
KEYS_WAITING = 16  # of them one key's, at most (one key's flood left no place for the others)
WAITING = "embeddings"  # (their count's name in ``Server.waiting``; a key's: with the key)
MAX_INPUT_TOKENS = 8192  # token ids an input given as ids may have
MAX_TOKENS = 300_000  # tokens a request's inputs have in all (OpenAI's limit)
# A request is run a piece at a time (a batch's worth: at most this many inputs and tokens,
# one input at least), so that a client gone stops it between two (300,000 tokens are seconds
# to minutes of every core, and every other embedding request waits behind it).
PIECE_INPUTS, PIECE_TOKENS = 16, 8192


@dataclass(frozen=True)
class EmbeddingsAsk:
    """A checked ``/v1/embeddings`` body."""

    model: str | None
    inputs: list[str | list[int]]
    base64: bool
    dimensions: int | None
    keep_alive: float | None


def embeddings_request(body: Mapping[str, Any]) -> EmbeddingsAsk:
    """The body, checked (``ApiError`` naming the first bad field)."""
    model = body.get("model")
    if model is not None:
        string(model, "model")
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(is_id(x) for x in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw or len(raw) > MAX_INPUTS:
        raise ApiError(f"input must be a string or a list of 1 to {MAX_INPUTS} inputs", "input")
    inputs: list[str | list[int]] = []
    for index, item in enumerate(raw):
        if isinstance(item, str) and item:
            inputs.append(item)
        elif isinstance(item, list) and 0 < len(item) <= MAX_INPUT_TOKENS and all(is_id(x) for x in item):
            inputs.append(list(item))
        else:
            raise ApiError(f"input[{index}] must be a non-empty string or list of token ids", "input")
    form = body.get("encoding_format", "float")
    if form not in ("float", "base64"):
        raise ApiError("encoding_format must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not is_id(dimensions) or dimensions < 1):
        raise ApiError("dimensions must be a positive integer", "dimensions")
    return EmbeddingsAsk(model, inputs, form == "base64", dimensions, keep_alive_of(body.get("keep_alive")))


def is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embedded(model: Model, ask: EmbeddingsAsk, stop: threading.Event) -> tuple[np.ndarray, int]:
    """The inputs' embeddings and their tokens in all (texts tokenized once, here, for a model
    that has embeddings: a chat model's refusal came after 8 MiB of text was tokenized), run a
    piece at a time (``pieces``); ``ClientGone`` once ``stop`` is set."""
    if model.pooling in (None, "rank"):
        kind = "a chat model: its file names no pooling" if model.pooling is None else "a reranking model"
        raise ApiError(f"this is {kind}, so it has no embeddings", "model")
    lists = [model.tokenize(item) if isinstance(item, str) else item for item in ask.inputs]
    tokens = sum(len(tokens) for tokens in lists)
    if tokens > MAX_TOKENS:  # (one run at a time: the others wait behind it)
        raise ApiError(f"input: at most {MAX_TOKENS} tokens in all, got {tokens}", "input")
    rows = []
    for start, end in pieces(lists):
        if stop.is_set():
            raise ClientGone
        try:
            rows.append(model.embed(lists[start:end]))
        except ValueError as error:  # (a token id past the vocabulary)
            raise ApiError(renumbered(error, start), "input") from None
        except (ContextOverflowError, ModelOutputError) as error:  # (too long an input; a NaN)
            raise type(error)(renumbered(error, start)) from None
    return np.concatenate(rows), tokens


def renumbered(error: Exception, start: int) -> str:
    """The library's words on a piece's input, naming it as the request numbers it."""
    return re.sub(r"input (\d+)", lambda found: f"input {int(found[1]) + start}", str(error), count=1)


def pieces(lists: list[list[int]]) -> list[tuple[int, int]]:
    """``lists`` cut in order into runs of at most ``PIECE_INPUTS`` inputs and ``PIECE_TOKENS``
    tokens (an input longer alone is a piece alone): (start, end) each."""
    cuts, start, size = [], 0, 0
    for index, tokens in enumerate(lists):
        if index > start and (index - start == PIECE_INPUTS or size + len(tokens) > PIECE_TOKENS):
            cuts.append((start, index))
            start, size = index, 0
        size += len(tokens)
    return [*cuts, (start, len(lists))]


def answer(vectors: np.ndarray, tokens: int, name: str, ask: EmbeddingsAsk) -> dict[str, Any]:
    if ask.dimensions is not None and ask.dimensions != vectors.shape[1]:
        raise ApiError(
            f"dimensions: this model's embeddings have {vectors.shape[1]}, not {ask.dimensions}", "dimensions"
        )
    data = []
    for index, row in enumerate(vectors):
        little = row.astype("<f4")
        value: Any = base64.b64encode(little.tobytes()).decode() if ask.base64 else little.tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": name, "usage": usage}


async def embeddings(server: Server, request: Request) -> Response:
    async with server.parsed_body(request) as body:  # (a few at once, as a chat's)
        ask = await asyncio.to_thread(lambda: embeddings_request(parse_json(body)))
    name = server.hosts.served(ask.model)
    stop = threading.Event()
    try:  # (the client may leave while a model loads, while it waits its turn, while it runs)
        vectors, tokens = await unless_gone(request, run(server, request, ask, stop))
    except ClientGone:
        stop.set()  # (a run begun ends at its next piece; its model and turn are given back then)
        return Response(status_code=499)  # (nobody reads it)
    # (2,048 vectors of floats are tens of MB of JSON: a second or more, never on the loop)
    return await asyncio.to_thread(lambda: JSONResponse(answer(vectors, tokens, name, ask)))


async def run(
    server: Server, request: Request, ask: EmbeddingsAsk, stop: threading.Event
) -> tuple[np.ndarray, int]:
    """The request's embeddings, once its model is held and the one run at a time is its (at
    most ``MAX_WAITING`` wait, ``KEYS_WAITING`` of a key, a model of several perhaps loading
    first: each holds its inputs; a server without keys has one tenant, who may use them all)."""
    key = request.state.key
    with server.waiting.counting(
        (WAITING, MAX_WAITING, "too many embedding requests are waiting"),
        (
            (WAITING, key),
            keys_share(key, KEYS_WAITING),
            "too many of this key's embedding requests are waiting",
        ),
    ):
        host, held = await server.hosts.held(ask.model, heeded(request, ask.keep_alive), key)
        try:
            await server.embedding.acquire()  # (one run at a time: the rest wait here, not in threads)
        except BaseException:
            held.drop()
            raise

    def ended(_: object = None) -> None:  # (the run over: the next may start, the model go)
        server.embedding.release()
        held.drop()

    going = asyncio.ensure_future(asyncio.to_thread(embedded, host.model, ask, stop))
    going.add_done_callback(ended)  # (a cancelled request leaves the run holding them until it ends)
    return await asyncio.shield(going)
