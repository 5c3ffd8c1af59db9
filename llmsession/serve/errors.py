"""What a failed request answers: an HTTP status and OpenAI's error body. Pure.

A library error that says the request was wrong (a bad template, schema, option, an over-long
prompt) is a 400 with its message; a full memory budget is a 503 the client may retry; anything
else is a 500 whose message says nothing of the server's insides (the traceback is logged)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmsession.errors import (
    ContextOverflowError,
    GrammarError,
    ImageError,
    MemoryBudgetError,
    ModelClosedError,
    TemplateError,
    UnsupportedFeatureError,
)

BAD_REQUEST = (TemplateError, GrammarError, ContextOverflowError, UnsupportedFeatureError, ImageError)


@dataclass(eq=False)
class RequestError(Exception):
    """A request the server refuses, with what OpenAI's error body says of it."""

    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    kind: str = "invalid_request_error"
    retry_after: int | None = None  # seconds, for a 503

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def from_library(error: BaseException) -> RequestError | None:
    """The answer to a library error raised for a request, or None for an unexpected one (a bug,
    a native failure: a 500 that the caller logs)."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, MemoryBudgetError):
        return RequestError(
            f"the server's memory budget is full: {error}", None, "overloaded", 503, "server_error", 1
        )
    if isinstance(error, ModelClosedError):
        return RequestError("the server is shutting down", None, "shutting_down", 503, "server_error", 5)
    if isinstance(error, BAD_REQUEST):
        code = "context_length_exceeded" if isinstance(error, ContextOverflowError) else None
        return RequestError(str(error), None, code)
    if isinstance(error, ValueError | TypeError):  # the library's checks of options and messages
        return RequestError(str(error))
    return None


def internal() -> RequestError:
    """A 500 that tells the client nothing of the server's insides."""
    return RequestError("the server failed to answer this request", None, None, 500, "server_error")
