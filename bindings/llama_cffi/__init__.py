"""cffi bindings to the pinned llama.cpp: libllama, libmtmd and the ggml libraries they need.

The declarations in ``_cdef.h`` are generated from the very headers the libraries were built
from (``scripts/gen_bindings.py``). ``load()`` opens the libraries once per process, calls
``llama_backend_init`` and routes llama.cpp and mtmd logs into the ``llmsession.native`` logger.

An exception raised inside a Python callback that native code runs (a Ctrl-C's
``KeyboardInterrupt`` lands there when a signal arrives mid-decode) cannot unwind through C. cffi
would print and drop it; ``stash_error`` keeps it for the calling thread instead, and the caller
raises it with ``take_pending_error()`` once the native call returns.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cffi import FFI

# The build facts, defined here once (llmsession.paths and the set-up read them from here).
LLAMA_CPP_COMMIT = "0c1e57098"
# Load order: each library after the ones it links against.
LIBRARIES = ("ggml-base", "ggml-cpu", "ggml-rpc", "ggml", "llama", "mtmd")
# Declared in the headers but not exported by the pinned libraries (C++-only declarations).
NOT_EXPORTED = frozenset({"mtmd_get_memory_usage"})
BUILD_HINT = "run `llmsession setup` to build them"

log = logging.getLogger("llmsession.native")
if log.level == logging.NOTSET:
    log.setLevel(logging.WARNING)

ffi = FFI()
ffi.cdef((Path(__file__).with_name("_cdef.h")).read_text())
ffi.cdef("bool llmsession_should_abort(void *flag);")  # abort_check.c, built beside the libraries
ABORT_CHECK = "libllmsession_abort.so"


class LibraryNotFoundError(OSError):
    """The llama.cpp shared libraries are not where llmsession looks for them."""


def cache_root() -> Path:
    """Where llmsession keeps what it downloads and builds: ``$LLMSESSION_CACHE``, else
    ``~/.cache/llmsession``."""
    return Path(os.environ.get("LLMSESSION_CACHE") or Path.home() / ".cache" / "llmsession")


def llama_dir() -> Path:
    """The versioned folder of the pinned build in the cache (``lib/``, ``include/``, ``src/``)."""
    return cache_root() / "llama.cpp" / LLAMA_CPP_COMMIT


def lib_dir() -> Path:
    """``$LLMSESSION_LIB_DIR`` (an explicit choice wins), else the build in the cache."""
    configured = os.environ.get("LLMSESSION_LIB_DIR")
    return Path(configured) if configured else llama_dir() / "lib"


def include_dir() -> Path:
    configured = os.environ.get("LLMSESSION_INCLUDE_DIR")
    return Path(configured) if configured else lib_dir().parent / "include"


class _Lib:
    """One namespace over the libraries (``LIBRARIES``): attributes resolve in load order and are cached."""

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
_pending = threading.local()


def stash_error(_kind: Any, error: BaseException | None, _traceback: Any) -> None:
    """cffi's ``onerror`` for every callback: keep the first exception for this thread."""
    if error is not None and getattr(_pending, "error", None) is None:
        _pending.error = error


def has_pending_error() -> bool:
    return getattr(_pending, "error", None) is not None


def note_abort() -> None:
    """An abort callback stopped this thread's decode: the errors llama.cpp logs about it
    until the decode returns are expected, so they are logged at debug level only."""
    _pending.aborting = True


def watch_abort(word: Any) -> None:
    """The word the native abort check reads for this thread's next decode (None: none): once
    it is set, that check stops the decode, and what llama.cpp logs about it is expected (as
    after ``note_abort``: the native check cannot call Python)."""
    _pending.watched = word


def take_pending_error() -> BaseException | None:
    """The exception a callback raised on this thread since the last call, cleared (called
    after every decode, which also ends a noted or watched abort)."""
    error: BaseException | None = getattr(_pending, "error", None)
    _pending.error = None
    _pending.aborting = False
    _pending.watched = None
    return error


def _aborting() -> bool:
    word = getattr(_pending, "watched", None)
    return bool(getattr(_pending, "aborting", False) or (word is not None and word[0]))


_captured = threading.local()


@contextmanager
def captured_logs() -> Iterator[list[str]]:
    """The whole native log lines this thread writes inside the block, whatever their level
    and the logger's (what llama.cpp reports only in its log, such as the buffers it
    allocated)."""
    lines: list[str] = []
    outer = getattr(_captured, "lines", None)
    _captured.lines = lines
    try:
        yield lines
    finally:
        _captured.lines = outer


def _route_logs(lib: _Lib) -> Any:
    """Forward native log lines to Python logging; continuation pieces join the line before (per
    thread: llama.cpp may log from several threads at once)."""
    line = threading.local()

    @ffi.callback("void(enum ggml_log_level, const char *, void *)", onerror=stash_error)  # type: ignore[untyped-decorator]
    def on_log(level: int, text: Any, _user: Any) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT keeps the previous level
            line.level = _LEVELS.get(level, logging.DEBUG)
        level = logging.DEBUG if _aborting() else getattr(line, "level", logging.DEBUG)
        capture: list[str] | None = getattr(_captured, "lines", None)
        if capture is None and not log.isEnabledFor(level):
            return
        line.text = getattr(line, "text", "") + ffi.string(text).decode("utf-8", "replace")
        if line.text.endswith("\n"):
            if capture is not None:
                capture.append(line.text.rstrip())
            if log.isEnabledFor(level):
                log.log(level, "%s", line.text.rstrip())
            line.text = ""

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
            path = Path(folder) if folder else lib_dir()
            lib = _open(path)
            _state["log_callback"] = _route_logs(lib)  # kept alive as long as the process
            lib.llama_backend_init()
            _state["lib"] = lib
            _state["abort_check"] = _open_abort_check(path)
        return _state["lib"], ffi


def _open_abort_check(folder: Path) -> Any:
    """``llmsession_should_abort`` from abort_check.c, or None where it was not built (libraries
    adopted from elsewhere): aborts then go through a Python callback."""
    path = folder / ABORT_CHECK
    if not path.exists():
        log.debug("%s not found in %s: decodes check for cancels in Python", ABORT_CHECK, folder)
        return None
    return ffi.addressof(ffi.dlopen(str(path)), "llmsession_should_abort")


def abort_check() -> Any:
    """The native abort check (a ``ggml_abort_callback``), None if there is none; after ``load``."""
    return None if _state.get("python_checks") else _state.get("abort_check")


@contextmanager
def python_abort_checks() -> Iterator[None]:
    """Within it, every decode checks for cancels in Python (for the benchmark of what that costs)."""
    _state["python_checks"] = True
    try:
        yield
    finally:
        _state["python_checks"] = False


__all__ = [
    "LIBRARIES",
    "LLAMA_CPP_COMMIT",
    "NOT_EXPORTED",
    "LibraryNotFoundError",
    "abort_check",
    "cache_root",
    "ffi",
    "has_pending_error",
    "include_dir",
    "lib_dir",
    "llama_dir",
    "load",
    "python_abort_checks",
    "stash_error",
    "take_pending_error",
]
