"""Where llmsession keeps what it downloads and builds: never inside the repository.

Everything lives under one cache root, ``$LLMSESSION_CACHE`` or ``~/.cache/llmsession``. The
pinned commit and the build's place are the bindings' (``llama_cffi``), defined there once. This
module loads no library, so the set-up can use it before llama.cpp is built.
"""

from __future__ import annotations

from pathlib import Path

from llama_cffi import LLAMA_CPP_COMMIT as LLAMA_CPP_COMMIT
from llama_cffi import cache_root as cache_root
from llama_cffi import llama_dir as llama_dir

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


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


def cached_models() -> list[Path]:
    """The cache's model files (not a link whose file is gone: a drive unmounted, say)."""
    return sorted(m for m in models_dir().glob("*.gguf") if is_file(m))


def is_file(path: Path) -> bool:
    """Whether ``path`` is a file this process can see: False where it cannot be checked (a
    folder it may not search, a name too long), as where it is not (``Path.is_file`` raises)."""
    try:
        return path.is_file()
    except OSError:
        return False


def exists(path: Path) -> bool:
    """Whether ``path`` exists, as ``is_file`` tells a file: False where it cannot be checked."""
    try:
        return path.exists()
    except OSError:
        return False


def model_candidates(name: str) -> list[Path]:
    """Cached models a name may mean: its file name or stem exactly, else those it begins."""
    key = name.lower()
    exact = [m for m in cached_models() if key in (m.name.lower(), m.stem.lower())]
    return exact or [m for m in cached_models() if m.name.lower().startswith(key)]


def resolve_model(name: str | Path) -> Path:
    """A model path as given, or the one cached model it names (``smollm2``); the name itself
    when it names none, or several (``model_candidates`` says which)."""
    path = Path(name)
    if path.parent != Path(".") or is_file(path):
        return path
    found = model_candidates(str(name))
    return found[0] if len(found) == 1 else path
