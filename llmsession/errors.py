"""The exceptions llmsession raises; all share one base class."""

from __future__ import annotations


class LlmSessionError(Exception):
    """Base class of every llmsession error."""


class ModelLoadError(LlmSessionError):
    """A model or projector file is missing, unreadable or not a valid GGUF."""


class ContextOverflowError(LlmSessionError):
    """The prompt does not fit the session's context; nothing was decoded."""


class TemplateError(LlmSessionError):
    """No renderer could format the messages with the model's chat template."""


class SessionBusyError(LlmSessionError):
    """The session is already generating in another thread."""


class UnsupportedFeatureError(LlmSessionError):
    """The request needs something this model lacks (for example images without a projector)."""


class ImageError(LlmSessionError):
    """An image could not be read or has the wrong shape."""


class ModelClosedError(LlmSessionError):
    """The model (or the session's native state) was closed; nothing more can run on it."""


class SessionFileError(LlmSessionError):
    """A saved-session file is unreadable, truncated, corrupt or of an unknown format."""


class NativeError(LlmSessionError):
    """A llama.cpp or libmtmd call reported failure."""


class MemoryBudgetError(LlmSessionError):
    """The sessions in an exchange already hold the model's whole live budget (kv_tokens,
    max_live_sessions): nothing idle is left to park. Nothing was decoded."""


class GrammarError(LlmSessionError, ValueError):
    """A constraint (JSON schema, regex, grammar) that cannot be used: invalid, or using a
    feature the matcher does not implement (named in the message); or a matcher that failed
    mid-reply."""


class BackendError(ModelClosedError):
    """The process running an isolated model died or stopped answering (an RPC server lost
    mid-decode, say): the model is closed; sessions' transcripts are as before the failed call."""
