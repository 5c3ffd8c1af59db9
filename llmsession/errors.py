"""The exceptions llmsession raises; all share one base class, and most one of two middle ones:

- ``RequestError``: this request cannot be served as asked (its messages, template, constraint,
  images, length, a session file, or a feature the model lacks); sent again unchanged it fails
  again. Most are raised before anything decodes; a session file that cannot be written is the
  exception. ``ReplyMismatchError``, a ``GrammarError`` for backward compatibility, is not the
  request's fault: the reply did not hold to a valid constraint.
- ``UnavailableError``: the model cannot serve it now (its memory budget in use, the session
  busy) or any more (closed, its worker process gone); the request itself may be fine.

``ModelLoadError`` (a file that cannot be loaded) and ``NativeError`` (llama.cpp reported a
failure; ``ModelOutputError``: the model computed what no answer can hold) stand alone under
``LlmSessionError``."""

from __future__ import annotations


class LlmSessionError(Exception):
    """Base class of every llmsession error."""


class RequestError(LlmSessionError):
    """The request cannot be served as asked (see the module)."""


class UnavailableError(LlmSessionError):
    """The model cannot serve the request now, or any more (see the module)."""


class ModelLoadError(LlmSessionError):
    """A model or projector file is missing, unreadable or not a valid GGUF."""


class ContextOverflowError(RequestError):
    """The prompt does not fit the session's context; nothing was decoded. ``tokens`` and
    ``limit``, where known: the prompt's tokens, and the most a prompt of the session may have."""

    def __init__(self, *args: object, tokens: int | None = None, limit: int | None = None) -> None:
        super().__init__(*args)
        self.tokens, self.limit = tokens, limit


class TemplateError(RequestError):
    """No renderer could format the messages with the model's chat template."""


class SessionBusyError(UnavailableError):
    """The session is already generating in another thread."""


class UnsupportedFeatureError(RequestError):
    """The request needs something this model lacks (for example images without a projector)."""


class ImageError(RequestError):
    """An image could not be read or has the wrong shape."""


class ModelClosedError(UnavailableError):
    """The model (or the session's native state) was closed; nothing more can run on it."""


class SessionFileError(RequestError):
    """A saved-session file is unreadable, truncated, corrupt or of an unknown format."""


class NativeError(LlmSessionError):
    """A llama.cpp or libmtmd call reported failure."""


class ModelOutputError(NativeError):
    """The model computed values no answer can hold (an embedding that is NaN or infinite): a
    broken or mis-converted model file; asked again, it computes the same."""


class MemoryBudgetError(UnavailableError):
    """The sessions in an exchange already hold the model's whole live budget (kv_tokens,
    max_live_sessions): nothing idle is left to park. Nothing was decoded."""


class GrammarError(RequestError, ValueError):
    """A constraint (JSON schema, regex, grammar) that cannot be used: invalid, or using a
    feature the matcher does not implement (named in the message). A reply that fails a valid
    constraint is its subclass ``ReplyMismatchError``."""


class ReplyMismatchError(GrammarError):
    """The reply does not hold to its constraint, which was valid: its matcher failed mid-reply,
    or the finished reply fails what the mask cannot enforce (a schema keyword checked after the
    reply, a tool's arguments, a pydantic class's own validators). The exchange is recorded; the
    request itself was fine (a server answers it with a 5xx, not a 400)."""


class BackendError(ModelClosedError):
    """The process running an isolated model died or stopped answering (an RPC server lost
    mid-decode, say): the model is closed; sessions' transcripts are as before the failed call."""


class ModelNotFoundError(RequestError):
    """No model of that name is among the ones served (``Models``)."""


class ModelsFullError(UnavailableError):
    """A model cannot load now: the loaded ones fill ``max_loaded`` or ``memory_limit`` and are
    all in use, or the limit is smaller than the model itself (``too_large``: waiting will not
    help). Nothing was unloaded."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large
