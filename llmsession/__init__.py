"""llmsession: fast, correct multi-turn chat with local GGUF models through llama.cpp."""

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
from .image import Image
from .model import Model
from .options import GenerationOptions
from .replies import Reply, Snapshot, Timings, Usage
from .session import Session
from .stream import Stream

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
