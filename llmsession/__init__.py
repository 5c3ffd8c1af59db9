"""llmsession: fast, correct multi-turn chat with local GGUF models through llama.cpp."""

import importlib
from typing import TYPE_CHECKING, Any

from llmsession.config import (
    CheckpointConfig,
    Effort,
    KvLayout,
    KvType,
    MemoryConfig,
    ModelConfig,
    ModelSettings,
    SessionConfig,
    SessionSettings,
)
from llmsession.errors import (
    BackendError,
    ContextOverflowError,
    GrammarError,
    ImageError,
    LlmSessionError,
    MemoryBudgetError,
    ModelClosedError,
    ModelLoadError,
    ModelNotFoundError,
    ModelOutputError,
    ModelsFullError,
    NativeError,
    ReplyMismatchError,
    RequestError,
    SessionBusyError,
    SessionFileError,
    TemplateError,
    UnavailableError,
    UnsupportedFeatureError,
)
from llmsession.options import GenerationOptions
from llmsession.replies import (
    Alternative,
    ContentPart,
    FinishReason,
    ImagePart,
    ImageURL,
    ImageURLPart,
    Message,
    Reply,
    Snapshot,
    TextPart,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)

if TYPE_CHECKING:
    from llmsession.api.model import Model
    from llmsession.api.modelfiles import ModelFile, ModelStatus
    from llmsession.api.models import Models
    from llmsession.engine.budget import Counters, MemoryReport, SessionMemory
    from llmsession.runtime.aio import AsyncStream
    from llmsession.runtime.choices import Choices
    from llmsession.runtime.face import Session, Stream
    from llmsession.text.images import Image
    from llmsession.text.renderer import Renderer
    from llmsession.text.transcript import Transcript

# Loaded when first named: they bring numpy, PIL, llguidance and the bindings, which a bare
# ``import llmsession`` (a command's start, a server's import of its errors) should not pay for.
_LAZY = {
    "AsyncStream": ".runtime.aio",
    "Choices": ".runtime.choices",
    "Counters": ".engine.budget",
    "MemoryReport": ".engine.budget",
    "SessionMemory": ".engine.budget",
    "Image": ".text.images",
    "Renderer": ".text.renderer",
    "Transcript": ".text.transcript",
    "Model": ".api.model",
    "Models": ".api.models",
    "ModelFile": ".api.modelfiles",
    "ModelStatus": ".api.modelfiles",
    "Session": ".runtime.face",
    "Stream": ".runtime.face",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's, read when asked
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("llmsession")
        except PackageNotFoundError:
            return "0+unknown"
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # once: later lookups find it directly
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "Alternative",
    "AsyncStream",
    "BackendError",
    "CheckpointConfig",
    "Choices",
    "ContentPart",
    "ContextOverflowError",
    "Counters",
    "Effort",
    "FinishReason",
    "GenerationOptions",
    "GrammarError",
    "Image",
    "ImageError",
    "ImagePart",
    "ImageURL",
    "ImageURLPart",
    "KvLayout",
    "KvType",
    "LlmSessionError",
    "MemoryBudgetError",
    "MemoryConfig",
    "MemoryReport",
    "Message",
    "Model",
    "ModelClosedError",
    "ModelConfig",
    "ModelFile",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelOutputError",
    "ModelSettings",
    "ModelStatus",
    "Models",
    "ModelsFullError",
    "NativeError",
    "Renderer",
    "Reply",
    "ReplyMismatchError",
    "RequestError",
    "Session",
    "SessionBusyError",
    "SessionConfig",
    "SessionFileError",
    "SessionMemory",
    "SessionSettings",
    "Snapshot",
    "Stream",
    "TemplateError",
    "TextPart",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "Transcript",
    "UnavailableError",
    "UnsupportedFeatureError",
    "Usage",
]
