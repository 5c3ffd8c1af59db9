"""What the cache holds of a llama.cpp build: its libraries and headers, put there by renaming
new files over old ones (a process that loaded the old keeps them), and its record
(``build-info.json``: written whole, read as possibly damaged), which says whether the build is
complete as this version makes it. Files only: nothing here builds or loads a library."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llama_cffi import LIBRARIES

LIBS = tuple(f"lib{name}" for name in LIBRARIES)
# The public headers and the ggml headers they include.
HEADER_NAMES = ("llama.h", "mtmd.h", "mtmd-helper.h", "ggml.h", "ggml-cpu.h", "ggml-backend.h",
                "ggml-alloc.h", "ggml-opt.h", "gguf.h", "ggml-rpc.h")  # fmt: skip
# llama.cpp's RPC server (GGML_RPC): serves this machine's CPU to a model on another host.
RPC_SERVER = "ggml-rpc-server"
# ggml's own thread pool, not OpenMP: with OpenMP every Python thread that decodes gets a team
# of its own, and once there are two (an exchange on the main thread, then a stream's or an
# anticipation's decode in another) libgomp throttles its spinning and decodes in the second
# thread ran 0.72 times as fast (64 vs 89 tok/s, SmolLM2, 2 threads). Without it both ran at
# the main thread's speed, and prefill and generation there were unchanged within noise.
THREADING = {"GGML_OPENMP": "OFF"}


class SetupError(Exception):
    """A set-up step failed; the message says what to do."""


def find_lib(folder: Path, name: str) -> Path:
    for candidate in (f"{name}.so", f"{name}.dylib"):
        if (folder / candidate).exists():
            return folder / candidate
    raise SetupError(f"{name}.so not found in {folder}")


def replace_with_copy(source: Path, target: Path) -> None:
    """``target`` replaced by a copy of ``source`` (its symlinks followed), written beside it
    and renamed over it: a process that has the old library mapped, or the old program running,
    keeps its file (written in place, the library was truncated under it: SIGBUS; the program
    busy: ETXTBSY)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        shutil.copy2(source, tmp, follow_symlinks=True)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install_libs(lib_src: Path, lib_dst: Path) -> None:
    """Copy the shared libraries (following symlinks, keeping their sonames) into the cache."""
    lib_dst.mkdir(parents=True, exist_ok=True)
    for name in LIBS:
        for path in sorted(lib_src.glob(f"{name}.*")):
            replace_with_copy(path, lib_dst / path.name)
        find_lib(lib_dst, name)


def install_headers(include_dirs: list[Path], dst: Path) -> None:
    """Copy llama.h, mtmd.h, mtmd-helper.h and the ggml headers they include."""
    dst.mkdir(parents=True, exist_ok=True)
    for folder in include_dirs:
        for header in folder.glob("*.h"):
            if header.name in HEADER_NAMES:
                shutil.copy2(header, dst / header.name)
    missing = [h for h in HEADER_NAMES if not (dst / h).exists()]
    if missing:
        raise SetupError(f"headers missing after install: {', '.join(missing)}")


def complete(dest: Path) -> bool:
    """The cache holds a finished build with every library, made as this version makes it (one
    made before RPC was added lacks libggml-rpc and the RPC server, one made with OpenMP lacks
    ``THREADING`` in its record: both are built again, incrementally)."""
    libs = all(any((dest / "lib").glob(f"{name}.so*")) for name in LIBS)
    info = read_info(dest)
    if info is None:  # (a record cut short, a disk that filled as it was written: built again)
        return False
    if "adopted" in str(info.get("origin", "")):
        return libs  # the user's build, as it is
    cmake = info.get("cmake", {})
    current = isinstance(cmake, dict) and THREADING.items() <= cmake.items()
    return libs and current and (dest / "bin" / RPC_SERVER).exists()


def write_info(dest: Path, info: dict[str, object]) -> None:
    """The build's record, written beside and renamed into place (never found half written)."""
    (part := dest / "build-info.json.partial").write_text(json.dumps(info, indent=2) + "\n")
    os.replace(part, dest / "build-info.json")


def read_info(dest: Path) -> dict[str, Any] | None:
    """The build's record, or None where it is missing or not a JSON object."""
    try:
        info = json.loads((dest / "build-info.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def os_error(error: OSError, where: Path) -> str:
    """An OSError as one line: what failed, and on which file(s) (``where`` if it names none)."""
    files = [os.fsdecode(f) for f in (error.filename, error.filename2) if f is not None]
    return f"{error.strerror or error} ({' -> '.join(files) or where})"
