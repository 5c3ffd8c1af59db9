"""Where llmsession keeps what it downloads and builds: never inside the repository.

Everything lives under one cache root, ``$LLMSESSION_CACHE`` or ``~/.cache/llmsession``.
This module imports nothing native, so scripts can use it before llama.cpp is built.
"""

from __future__ import annotations

import os
from pathlib import Path

LLAMA_CPP_COMMIT = "0c1e57098"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


def cache_root() -> Path:
    """The cache root; ``LLMSESSION_CACHE`` overrides the default."""
    return Path(os.environ.get("LLMSESSION_CACHE") or Path.home() / ".cache" / "llmsession")


def llama_dir() -> Path:
    """The versioned folder holding the pinned llama.cpp build (``lib/``, ``include/``, ``src/``)."""
    return cache_root() / "llama.cpp" / LLAMA_CPP_COMMIT


def models_dir() -> Path:
    return cache_root() / "models"


def fixtures_dir() -> Path:
    return cache_root() / "fixtures"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL_FILE


def gemma3_model_path() -> Path:
    return models_dir() / GEMMA3_MODEL_FILE


def llama_source_dir() -> Path:
    """The extracted llama.cpp source (templates, mtmd sources, llama-bench)."""
    return llama_dir() / "src"
