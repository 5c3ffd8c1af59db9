"""llmsession: fast, correct multi-turn chat with local GGUF models through llama.cpp."""

import importlib
from typing import TYPE_CHECKING, Any

from .budget import Counters, MemoryReport, SessionMemory
from .checkpoints import CheckpointConfig
from .errors import (
    BackendError,
    ContextOverflowError,
    GrammarError,
    ImageError,
    LlmSessionError,
    MemoryBudgetError,
    ModelClosedError,
    ModelLoadError,
    NativeError,
    SessionBusyError,
    SessionFileError,
    TemplateError,
    UnsupportedFeatureError,
)
from .options import GenerationOptions
from .replies import FinishReason, Reply, Snapshot, Timings, Usage

if TYPE_CHECKING:
    from .aio import AsyncStream
    from .image import Image
    from .model import Model
    from .session import Session
    from .stream import Stream

# Loaded when first named: they bring numpy, PIL, llguidance and the bindings, which a bare
# ``import llmsession`` (a command's start, a server's import of its errors) should not pay for.
_LAZY = {
    "AsyncStream": ".aio",
    "Image": ".image",
    "Model": ".model",
    "Session": ".session",
    "Stream": ".stream",
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
    "AsyncStream",
    "BackendError",
    "CheckpointConfig",
    "ContextOverflowError",
    "Counters",
    "FinishReason",
    "GenerationOptions",
    "GrammarError",
    "Image",
    "ImageError",
    "LlmSessionError",
    "MemoryBudgetError",
    "MemoryReport",
    "Model",
    "ModelClosedError",
    "ModelLoadError",
    "NativeError",
    "Reply",
    "Session",
    "SessionBusyError",
    "SessionFileError",
    "SessionMemory",
    "Snapshot",
    "Stream",
    "TemplateError",
    "Timings",
    "UnsupportedFeatureError",
    "Usage",
]
