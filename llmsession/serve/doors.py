"""The APIs' ways of answering a request that ran (``chat.Door``): OpenAI's chat and raw
completions (``CompletionDoor``), OpenAI's responses (``ResponsesDoor``) and Anthropic's messages
(``MessagesDoor``). Each turns the
replies into its body, or the choices' events into its stream; an error mid-stream is its API's
error event (logged if it is the server's: ``chat.explain``), and a stream that ends, however it
ends, cancels the exchanges behind it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmsession.replies import Reply, Usage
from llmsession.serve import sse
from llmsession.serve.chat import explain
from llmsession.serve.messages_sse import AnthropicMessage, Blocks
from llmsession.serve.responses_sse import KEEP_ALIVE, Items, ResponseObject
from llmsession.serve.runner import Choices, Event, Relay

PING_SECONDS = 5.0  # a Messages stream's keep-alive while its prompt decodes


class CompletionDoor:
    """OpenAI's chat completions (or, ``completion.text``, raw completions)."""

    patience: float | None = None  # (a stream begins with its first events: its status is theirs)

    def __init__(self, completion: sse.Completion) -> None:
        self.completion = completion

    def whole(self, replies: list[Reply], prompt: Usage | None) -> dict[str, Any]:
        return dataclasses.replace(self.completion, prompt=prompt).body(replies)

    def settle(self, body: dict[str, Any], replies: list[Reply], text: bytes) -> bool:
        return False

    async def stream(self, choices: Choices | Relay, first: list[Event]) -> AsyncIterator[bytes]:
        """Every choice's role, then its pieces as they come, its finish, the usage if asked,
        ``[DONE]``."""
        prompt = choices.forks.prompt if choices.forks is not None else None
        completion = dataclasses.replace(self.completion, prompt=prompt)
        replies: dict[int, Reply] = {}
        streamed = [sse.Streamed() for _ in range(choices.n)]
        pending = list(first)
        try:
            for opening in completion.openings(choices.n):
                yield sse.event(opening)
            while len(replies) < choices.n:
                event = pending.pop(0) if pending else await choices.queue.get()
                if event.error is not None:
                    yield sse.event(explain(event.error).body())
                    break
                if event.snapshot is not None:
                    for chunk in completion.pieces(event.index, event.snapshot, streamed[event.index]):
                        yield sse.event(chunk)
                elif event.reply is not None:
                    replies[event.index] = event.reply
                    yield sse.event(completion.finish(event.index, event.reply, streamed[event.index]))
            else:
                if completion.include_usage:
                    yield sse.event(completion.usage_chunk([replies[i] for i in range(choices.n)]))
            yield sse.DONE
        except Exception as error:  # (its own: a chunk that cannot be written; logged, a 500's body)
            yield sse.event(explain(error).body())
            yield sse.DONE
        finally:
            choices.cancel()


class MessagesDoor:
    """Anthropic's messages: one choice. A stream whose prompt takes longer than ``patience``
    to decode begins anyway, with ``ping`` every ``PING_SECONDS`` until its first text (an
    agent's 20K-token prompt would otherwise hold a silent connection for a minute)."""

    def __init__(self, model: str, patience: float | None = None) -> None:
        self.message = AnthropicMessage(model)
        self.patience: float | None = PING_SECONDS if patience is None else patience

    def whole(self, replies: list[Reply], prompt: Usage | None) -> dict[str, Any]:
        return self.message.body(replies[0])

    def settle(self, body: dict[str, Any], replies: list[Reply], text: bytes) -> bool:
        return False

    async def stream(self, choices: Choices | Relay, first: list[Event]) -> AsyncIterator[bytes]:
        message, blocks, loop = self.message, Blocks(), asyncio.get_running_loop()
        try:
            yield message.start(prompt_usage(first))
            yield message.ping()
            said = loop.time()  # (a call's pieces show nothing until its end: pings meanwhile)
            async for event in waited(choices, first):
                if event is None:
                    yield message.ping()
                    continue
                if event.error is not None:
                    yield message.error(explain(event.error))
                    break
                if event.snapshot is not None:
                    pieces = message.pieces(event.snapshot, blocks)
                    if not pieces and loop.time() - said >= PING_SECONDS:
                        pieces = [message.ping()]
                    for piece in pieces:
                        yield piece
                    said = said if not pieces else loop.time()
                elif event.reply is not None:
                    for piece in message.finish(event.reply, blocks):
                        yield piece
                    break
        except Exception as error:  # (its own: an event that cannot be written; logged, a 500's body)
            yield message.error(explain(error))
        finally:
            choices.cancel()


async def waited(choices: Choices | Relay, first: list[Event]) -> AsyncIterator[Event | None]:
    """The first events, then each event as it comes, and None each ``PING_SECONDS`` none does
    (the stream's moment to keep its client waiting)."""
    for event in first:
        yield event
    while True:
        try:
            yield await asyncio.wait_for(choices.queue.get(), PING_SECONDS)
        except asyncio.TimeoutError:  # (on 3.10, not the builtin)
            yield None


def prompt_usage(first: list[Event]) -> Usage | None:
    """The prompt's usage, from a choice's first event (its first snapshot, or its reply)."""
    for event in first:
        if event.snapshot is not None and event.snapshot.usage is not None:
            return event.snapshot.usage
        if event.reply is not None:
            return event.reply.usage
    return None


Keep = Callable[[dict[str, Any], Reply, bytes | None], None]  # a finished response, to store


def kept(reply: Reply) -> bool:
    """Whether a response to ``reply`` is stored: not one cut short by its client going or the
    server stopping (``cancelled``: its text is whatever had come)."""
    return reply.finish_reason != "cancelled"


class ResponsesDoor:
    """OpenAI's responses: one choice. ``keep`` is given each finished response (stored, for
    ``store: true``); a failed or cancelled one is not. Past ``patience`` a stream begins with
    ``response.created`` and keeps its connection alive with SSE comments until its first
    token."""

    def __init__(
        self, response: ResponseObject, keep: Keep | None = None, patience: float | None = None
    ) -> None:
        self.response, self.keep = response, keep
        self.patience: float | None = PING_SECONDS if patience is None else patience

    def whole(self, replies: list[Reply], prompt: Usage | None) -> dict[str, Any]:
        return self.response.whole(replies[0])

    def settle(self, body: dict[str, Any], replies: list[Reply], text: bytes) -> bool:
        """``body`` kept as ``text`` renders it (the store is the event loop's; the body was
        rendered off it); True if it changed (it says it is not stored)."""
        return self._store(body, replies[0], text)

    def _store(self, body: dict[str, Any], reply: Reply, text: bytes | None = None) -> bool:
        """``body`` kept (``store: true``; ``text``: it rendered, else rendered to be kept), or
        saying it is not (a reply cut short by its client or the server stopping; one the store
        does not take says so in ``keep``): True then."""
        if self.keep is None:
            return False
        if kept(reply):
            self.keep(body, reply, text)
        else:
            body["store"] = False
        return body["store"] is False

    async def stream(self, choices: Choices | Relay, first: list[Event]) -> AsyncIterator[bytes]:
        response, items = self.response, Items()
        try:
            for opening in response.opening():
                yield opening
            async for event in waited(choices, first):
                if event is None:
                    yield KEEP_ALIVE
                    continue
                if event.error is not None:
                    yield response.failed(explain(event.error), items)
                    break
                if event.snapshot is not None:
                    for piece in response.pieces(event.snapshot, items):
                        yield piece
                elif event.reply is not None:
                    stored = functools.partial(self._store, reply=event.reply)  # (before its end is read)
                    pieces, _ = response.finish(event.reply, items, stored)
                    for piece in pieces:
                        yield piece
                    break
        except Exception as error:  # (its own: an event that cannot be written; logged, a 500's body)
            yield response.failed(explain(error), items)
        finally:
            choices.cancel()
