"""cffi bindings to the pinned llama.cpp: libllama, libmtmd and the ggml libraries they need.

The declarations in ``_cdef.h`` are generated from the very headers the libraries were built
from (``scripts/gen_bindings.py``). ``load()`` opens the libraries once per process, calls
``llama_backend_init`` and routes llama.cpp and mtmd logs into the ``llmsession.native`` logger.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from cffi import FFI

LLAMA_CPP_COMMIT = "0c1e57098"
# Load order: each library after the ones it links against.
LIBRARIES = ("ggml-base", "ggml-cpu", "ggml", "llama", "mtmd")
# Declared in the headers but not exported by the pinned libraries (C++-only declarations).
NOT_EXPORTED = frozenset({"mtmd_get_memory_usage"})
BUILD_HINT = "run `make setup` (or `python scripts/fetch_llama.py`) to build them"

log = logging.getLogger("llmsession.native")
if log.level == logging.NOTSET:
    log.setLevel(logging.WARNING)

ffi = FFI()
ffi.cdef((Path(__file__).with_name("_cdef.h")).read_text())


class LibraryNotFoundError(OSError):
    """The llama.cpp shared libraries are not where llmsession looks for them."""


def cache_root() -> Path:
    return Path(os.environ.get("LLMSESSION_CACHE") or Path.home() / ".cache" / "llmsession")


def lib_dir() -> Path:
    """``$LLMSESSION_LIB_DIR``, else the versioned build folder in the cache."""
    configured = os.environ.get("LLMSESSION_LIB_DIR")
    return Path(configured) if configured else cache_root() / "llama.cpp" / LLAMA_CPP_COMMIT / "lib"


def include_dir() -> Path:
    configured = os.environ.get("LLMSESSION_INCLUDE_DIR")
    return Path(configured) if configured else lib_dir().parent / "include"


class _Lib:
    """One namespace over the five libraries: attributes resolve in load order and are cached."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def __getattr__(self, name: str) -> Any:
        for handle in self._handles:
            try:
                value = getattr(handle, name)
            except AttributeError:
                continue
            setattr(self, name, value)
            return value
        raise AttributeError(f"{name} is not exported by the loaded llama.cpp libraries")


_LEVELS = {2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_state: dict[str, Any] = {}
_lock = threading.Lock()


def _route_logs(lib: _Lib) -> Any:
    """Forward native log lines to Python logging; continuation pieces join the line before."""
    pending = {"level": logging.DEBUG, "text": ""}

    @ffi.callback("void(enum ggml_log_level, const char *, void *)")
    def on_log(level: int, text: Any, _user: Any) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT keeps the previous level
            pending["level"] = _LEVELS.get(level, logging.DEBUG)
        if not log.isEnabledFor(pending["level"]):
            return
        pending["text"] += ffi.string(text).decode("utf-8", "replace")
        if pending["text"].endswith("\n"):
            log.log(pending["level"], "%s", pending["text"].rstrip())
            pending["text"] = ""

    lib.llama_log_set(on_log, ffi.NULL)
    lib.mtmd_log_set(on_log, ffi.NULL)
    lib.mtmd_helper_log_set(on_log, ffi.NULL)  # the helpers log on their own ("encoding image slice")
    return on_log


def _open(folder: Path) -> _Lib:
    handles = []
    for name in LIBRARIES:
        path = folder / f"lib{name}.so"
        if not path.exists():
            raise LibraryNotFoundError(f"lib{name}.so not found in {folder}; {BUILD_HINT}")
        handles.append(ffi.dlopen(str(path)))
    return _Lib(handles[::-1])


def load(folder: str | Path | None = None) -> tuple[Any, FFI]:
    """Open the libraries (once per process) and initialise the llama.cpp backend."""
    with _lock:
        if "lib" not in _state:
            lib = _open(Path(folder) if folder else lib_dir())
            _state["log_callback"] = _route_logs(lib)  # kept alive as long as the process
            lib.llama_backend_init()
            _state["lib"] = lib
        return _state["lib"], ffi


__all__ = ["LIBRARIES", "NOT_EXPORTED", "LibraryNotFoundError", "ffi", "include_dir", "lib_dir", "load"]
