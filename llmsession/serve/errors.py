"""What a failed request answers: an HTTP status and OpenAI's error body. Pure.

Requests are checked before they run (``schema``), so what comes out of a run is mapped by its
class alone: a library ``RequestError`` (the request cannot be served as asked: a template, a
schema, an image, an over-long prompt) is a 400 with its message, but a reply that fails a valid
constraint (``ReplyMismatchError``) a 500 ``reply_mismatch`` with its message, and where the
request decodes greedily or from a seed ``x-should-retry: false`` (the official SDKs would
otherwise send it twice more, for the same reply, at a whole generation's cost each; a sampled
reply may pass on another try); an ``UnavailableError`` (a
full memory budget, a busy conversation, a closing model) is a 503 the client may retry, saying
nothing of other tenants' use; anything else,
a ValueError or TypeError included, is the server's bug: a 500 whose message says nothing of the
server's insides (the app logs the traceback)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsession.errors import (
    BackendError,
    ContextOverflowError,
    MemoryBudgetError,
    ModelClosedError,
    ModelOutputError,
    ReplyMismatchError,
    RequestError,
    UnavailableError,
)
from llmsession.options import GenerationOptions

MAX_MESSAGE = 1024  # characters: a library error may quote what the request held


@dataclass(eq=False)
class ApiError(Exception):
    """A request the server refuses, with what OpenAI's error body says of it."""

    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    kind: str = "invalid_request_error"
    retry_after: int | None = None  # seconds, for a 503
    sizes: tuple[int, int] | None = None  # an over-long prompt's tokens, and the most it may have
    final: bool = False  # a 5xx that asking again would not mend: ``x-should-retry: false``

    def __post_init__(self) -> None:
        if len(self.message) > MAX_MESSAGE:
            self.message = self.message[: MAX_MESSAGE - 3] + "..."

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}

    def headers(self) -> dict[str, str]:
        said = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return {**said, "x-should-retry": "false"} if self.final else said


def too_large(limit: int) -> ApiError:
    """A 413 for a body over ``limit`` bytes."""
    return ApiError(f"the request body is over the limit of {limit} bytes", None, None, 413)


def busy(reason: str) -> ApiError:
    """A 503 the client may retry in a second."""
    message = f"the server is busy: {reason}; retry later"
    return ApiError(message, None, "overloaded", 503, "server_error", retry_after=1)


def from_library(error: BaseException) -> ApiError | None:
    """The answer to an error raised for a request, or None for an unexpected one (a bug, a
    native failure: a 500 that the caller logs)."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, BackendError):  # (closed for good: no Retry-After)
        failed = "the model is unavailable: its worker process failed"
        return ApiError(failed, None, "model_unavailable", 503, "server_error")
    if isinstance(error, ModelClosedError):
        return ApiError("the server is shutting down", None, "shutting_down", 503, "server_error", 5)
    if isinstance(error, MemoryBudgetError):  # (its text tells of other tenants' sessions)
        return busy("its memory is in use by other requests")
    if isinstance(error, UnavailableError):
        return busy("the model is busy")
    if isinstance(error, ContextOverflowError):
        sizes = None if error.tokens is None or error.limit is None else (error.tokens, error.limit)
        return ApiError(str(error), None, "context_length_exceeded", sizes=sizes)
    if isinstance(error, ReplyMismatchError):  # (the request was valid: the reply failed it)
        return ApiError(str(error), None, "reply_mismatch", 500, "server_error")
    if isinstance(error, RequestError):
        return ApiError(str(error))
    if isinstance(error, ModelOutputError):  # (the model's own: the same on every try)
        return ApiError(str(error), None, "model_output_invalid", 500, "server_error", final=True)
    return None


def as_asked(error: ApiError, options: GenerationOptions) -> ApiError:
    """``error``, a ``reply_mismatch`` made final where asking again decodes the same reply
    (greedy, or seeded); elsewhere (and on any path that does not know the request's options)
    the client's own retry rule stands."""
    if error.code == "reply_mismatch" and (options.greedy or options.seed is not None):
        error.final = True
    return error


def internal() -> ApiError:
    """A 500 that tells the client nothing of the server's insides."""
    return ApiError("the server failed to answer this request", None, None, 500, "server_error")
