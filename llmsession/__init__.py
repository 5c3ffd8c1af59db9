"""llmsession: fast, correct multi-turn chat with local GGUF models through llama.cpp."""

import importlib
from typing import TYPE_CHECKING, Any

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
from .replies import Reply, Snapshot, Timings, Usage

if TYPE_CHECKING:
    from .image import Image
    from .model import Model
    from .session import Session
    from .stream import Stream

# Loaded when first named: they bring numpy, PIL, llguidance and the bindings, which a bare
# ``import llmsession`` (a command's start, a server's import of its errors) should not pay for.
_LAZY = {"Image": ".image", "Model": ".model", "Session": ".session", "Stream": ".stream"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # once: later lookups find it directly
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BackendError",
    "CheckpointConfig",
    "ContextOverflowError",
    "GenerationOptions",
    "GrammarError",
    "Image",
    "ImageError",
    "LlmSessionError",
    "MemoryBudgetError",
    "Model",
    "ModelClosedError",
    "ModelLoadError",
    "NativeError",
    "Reply",
    "Session",
    "SessionBusyError",
    "SessionFileError",
    "Snapshot",
    "Stream",
    "TemplateError",
    "Timings",
    "UnsupportedFeatureError",
    "Usage",
]
