"""What an exchange returns: the reply, its token counts and timings, and stream snapshots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Union

# "complete": a constrained reply ended because its constraint was satisfied
# "tool_calls": the reply called tools (``Reply.tool_calls``)
FinishReason = Literal["stop", "length", "cancelled", "complete", "tool_calls"]


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImageURL(TypedDict):
    url: str  # a data: URL, or a local file path (never fetched from the network)


class ImageURLPart(TypedDict):
    type: Literal["image_url"]
    image_url: ImageURL


class ImagePart(TypedDict):
    type: Literal["image"]
    image: Any  # an ``llmsession.Image``, encoded bytes, a path, a PIL image or an array


# A str is a text part; any other object (an ``llmsession.Image``) is an image.
ContentPart = Union[str, TextPart, ImageURLPart, ImagePart, Any]  # noqa: UP007  (Any in a |: 3.10)


class _Said(TypedDict):
    role: str  # "system", "user", "assistant" (others as the template allows)
    content: str | list[ContentPart]


class Message(_Said, total=False):
    """One message of a transcript, as ``Session.messages`` holds them and ``Model.chat`` takes
    them (plain dicts: this is their shape for type checkers)."""

    name: str


@dataclass
class Usage:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    decoded_prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion's: its reasoning block's (not a budget's forced end)
    restored_tokens: int = 0  # positions loaded from a saved session before this exchange
    from_checkpoint: bool = False  # the reused positions came back from a checkpoint
    anticipated_tokens: int = 0  # reused positions decoded ahead, after the last reply
    shared_tokens: int = 0  # reused positions another session had decoded (its cells, shared)
    drafted_tokens: int = 0  # reply tokens proposed from the transcript (``draft``), and kept:
    accepted_drafts: int = 0
    cache_note: str = ""  # why a loaded session's cache was or was not reused


@dataclass
class Timings:
    """Where an exchange's time went. The time to first token runs from the ``stream()`` or
    ``respond()`` call to the first reply token sampled; it splits into rendering the transcript,
    tokenizing it, planning (taking the session's sequence, restoring or parking states, cutting
    to the reused prefix, restoring a checkpoint), the prefill inside ``llama_decode`` and the
    first sample (with any constraint's mask); what is left is Python's own bookkeeping."""

    time_to_first_token_s: float = 0.0
    render_s: float = 0.0
    tokenize_s: float = 0.0
    plan_s: float = 0.0
    prefill_s: float = 0.0
    first_sample_s: float = 0.0
    generation_s: float = 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        """Decode speed after the first token (the first one waits for the prefill)."""
        return self._tokens / self.generation_s if self.generation_s > 0 else 0.0

    _tokens: int = field(default=0, repr=False)


@dataclass(frozen=True)
class ToolCall:
    """A call a reply made: ``arguments`` is its JSON text as generated, ``parsed`` that object
    (it validated against the tool's schema)."""

    id: str
    name: str
    arguments: str

    @property
    def parsed(self) -> Any:
        return json.loads(self.arguments)

    def message_part(self) -> dict[str, Any]:
        """As an OpenAI assistant message's ``tool_calls`` holds it."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call, as OpenAI streams them: the call's ``index`` in the reply,
    its ``id`` and ``name`` in its first piece, then ``arguments`` text to append."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Alternative:
    """One of the likeliest tokens at a position."""

    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A reply token: its text, its bytes, its log-probability and the likeliest alternatives."""

    token: str
    bytes: bytes
    logprob: float
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class Reply:
    text: str  # with tool calls, the text before them
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    parsed: Any = None  # a complete json_schema reply, parsed (a pydantic instance for a model class)
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None  # with ``logprobs`` asked: its text's tokens
    stop_sequence: str | None = None  # the stop string that ended it (``GenerationOptions.stop``)
    reasoning: str = ""  # a thinking template's reasoning, split from ``text``
    context_full: bool = False  # "length" at the session's context size, not at ``max_tokens``


def assistant_message(reply: Reply) -> dict[str, Any]:
    """A reply as the assistant message of a transcript (a client sends it back so): its text,
    its reasoning as ``reasoning_content``, its calls in OpenAI's shape."""
    said: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.reasoning:
        said["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        said["tool_calls"] = [call.message_part() for call in reply.tool_calls]
    return said


@dataclass(frozen=True)
class Snapshot:
    """One step of a stream: the new text and everything so far."""

    delta: str
    text: str
    tool_calls: tuple[ToolCallDelta, ...] = ()  # pieces of calls this step wrote
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens whose text this step released
    usage: Usage | None = None  # the prompt's (decoded, reused), on a stream's first snapshot only
    reasoning_delta: str = ""  # the reasoning this step released (a thinking template's)
