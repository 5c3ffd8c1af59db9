"""Build the pinned llama.cpp (libllama, libmtmd, ggml) into the cache, or adopt an existing build.

The source is the llama.cpp vendored in the PyPI sdist llama-cpp-python==0.3.36 (commit 0c1e57098):
release binaries cannot be downloaded here, PyPI wheels carrying libllama need a newer glibc. A smoke
test in a subprocess ends the build: a bad build fails now, not at first use.

    llmsession setup                      # download, verify, build (about 4 minutes), fetch the model
    python scripts/fetch_llama.py --lib-dir L --include-dir I   # adopt a build of the same version
    python scripts/fetch_llama.py --bench              # also llama-bench, llama-server (benchmarks)"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import llama_cffi
from llama_cffi import ABORT_CHECK

from llmsession.commands import paths
from llmsession.commands.llama_cache import (
    HEADER_NAMES,
    RPC_SERVER,
    THREADING,
    SetupError,
    complete,
    install_headers,
    install_libs,
    os_error,
    replace_with_copy,
    write_info,
)
from llmsession.native.machine import usable_cores

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_REQ = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
# Only what the build, the headers, the reference templates and the reference benchmarks need.
SOURCE_PARTS = (
    "CMakeLists.txt", "LICENSE", "cmake/", "ggml/", "src/", "include/", "vendor/", "common/",
    "licenses/", "tools/CMakeLists.txt", "tools/mtmd/", "tools/llama-bench/", "tools/batched-bench/",
    "tools/rpc/", "models/templates/", "tools/server/", "tools/ui/CMakeLists.txt", "tools/ui/ui.",
    "scripts/ui-assets.cmake",
)  # fmt: skip
# Built with --bench: llama-bench (a prompt or a generation at a depth), llama-batched-bench (N
# sequences in one batch: continuous batching), llama-server (`bench serve`'s; no web UI: no npm).
BENCH_TOOLS = {"llama-bench": "tools/llama-bench", "llama-batched-bench": "tools/batched-bench",
               "llama-server": "tools/server"}  # fmt: skip
RPC_SOURCE = "tools/rpc/rpc-server.cpp"  # (built into ``llama_cache.RPC_SERVER``)
# x86 features ggml can use, by the /proc/cpuinfo flag that enables each. AMX stays off:
# its path faults (ldtilecfg) on CPUs that advertise it here, and GGML_NATIVE=ON would enable it.
X86_FEATURES = {
    "sse4_2": "GGML_SSE42", "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA",
    "f16c": "GGML_F16C", "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
}  # fmt: skip
MIN_FREE_BYTES = 2 * 1024**3
START = time.monotonic()


def step(message: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {message}", flush=True)


def run(cmd: list[str], *, cwd: Path | None = None, log: Path | None = None) -> None:
    """Run a command; on failure show the tail of its output."""
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if log is not None:
        log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
        raise SetupError(f"command failed ({out.returncode}): {' '.join(cmd)}\n{tail}")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def ggml_cpu_options() -> dict[str, str]:
    """Explicit CPU options from this CPU's flags (GGML_NATIVE=OFF, AMX off)."""
    options = {"GGML_NATIVE": "OFF", "GGML_AMX_TILE": "OFF", "GGML_AMX_INT8": "OFF"}
    options["GGML_AMX_BF16"] = "OFF"
    if platform.machine() in ("x86_64", "AMD64"):
        flags = cpu_flags()
        options |= {opt: "ON" if flag in flags else "OFF" for flag, opt in X86_FEATURES.items()}
    return options


def check_tools(target: Path) -> None:
    for tool in ("cmake", "cc", "c++"):
        if shutil.which(tool) is None:
            hint = "apt-get install cmake" if tool == "cmake" else "apt-get install build-essential"
            raise SetupError(f"'{tool}' not found on PATH; install it ({hint}) and run again")
    target.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target).free
    if free < MIN_FREE_BYTES:
        raise SetupError(
            f"only {free / 1024**3:.1f} GiB free under {target}; the build needs about 2 GiB "
            "(set LLMSESSION_CACHE to a roomier folder)"
        )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_sdist(workdir: Path) -> Path:
    step(f"downloading {SDIST_REQ} (source distribution, about 77 MB) from PyPI")
    began = time.monotonic()
    # pip checks a required hash once the file is down, before it unpacks it or runs any of its
    # code (to read an sdist's metadata it runs its build backend): a swapped file never runs.
    # The backend's own packages (scikit-build-core, ...) are pip's to fetch, unpinned.
    pinned = workdir / "pinned.txt"
    pinned.write_text(f"{SDIST_REQ} --hash=sha256:{SDIST_SHA256}\n")
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
         "--quiet", "-d", str(workdir), "-r", str(pinned)])  # fmt: skip
    sdist = workdir / SDIST
    if not sdist.exists():
        raise SetupError(f"pip did not produce {SDIST} in {workdir}")
    size = sdist.stat().st_size
    rate = size / max(time.monotonic() - began, 1e-3) / 1e6
    step(f"downloaded {size / 1e6:.1f} MB ({rate:.1f} MB/s); verifying sha256")
    actual = sha256(sdist)
    if actual != SDIST_SHA256:
        raise SetupError(f"checksum mismatch for {SDIST}: expected {SDIST_SHA256}, got {actual}")
    return sdist


def source_members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    for member in tar.getmembers():
        if not member.name.startswith(VENDOR) or not (member.isfile() or member.isdir()):
            continue
        rel = member.name[len(VENDOR) :]
        if rel.startswith("/") or ".." in Path(rel).parts:
            continue
        if any(rel == part or rel.startswith(part) for part in SOURCE_PARTS):
            member.name = rel
            yield member


def extract_source(sdist: Path, dest: Path) -> None:
    step(f"extracting the llama.cpp sources the build needs into {dest}")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+
            tar.extractall(partial, members=source_members(tar), filter="data")
        else:  # the archive is checked by sha256 and its members by source_members
            tar.extractall(partial, members=source_members(tar))
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)


def git_stub(folder: Path) -> Path:
    """ggml asks git for its commit and overwrites the one passed in (LLAMA_BUILD_COMMIT); the
    sdist has no .git, so the libraries would report 'unknown'. This stand-in answers with the
    pinned commit and a clean tree."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "git-stub"
    stub.write_text(f'#!/bin/sh\n[ "$1" = rev-parse ] && echo {paths.LLAMA_CPP_COMMIT[:7]}\nexit 0\n')
    stub.chmod(0o755)
    return stub


def build(
    src: Path,
    build_dir: Path,
    targets: list[str],
    *,
    common: bool = False,
    extra: dict[str, str] | None = None,
) -> None:
    options = {
        "CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "ON", "LLAMA_CURL": "OFF",
        "LLAMA_OPENSSL": "OFF", "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_SERVER": "OFF", "LLAMA_BUILD_APP": "OFF", "LLAMA_BUILD_MTMD": "ON",
        "LLAMA_BUILD_TOOLS": "OFF", "LLAMA_BUILD_COMMON": "ON" if common else "OFF",
        "LLAMA_BUILD_COMMIT": paths.LLAMA_CPP_COMMIT[:7], "GGML_RPC": "ON",
        "CMAKE_BUILD_WITH_INSTALL_RPATH": "ON", "CMAKE_INSTALL_RPATH": "$ORIGIN:$ORIGIN/../lib",
        "GIT_EXE": str(git_stub(build_dir.parent)),
    } | THREADING | ggml_cpu_options() | (extra or {})  # fmt: skip
    on = sorted(k.removeprefix("GGML_") for k, v in ggml_cpu_options().items() if v == "ON")
    step(f"configuring (cmake; CPU features: {', '.join(on) or 'defaults'})")
    defines = [f"-D{key}={value}" for key, value in options.items()]
    run(
        ["cmake", "-S", str(src), "-B", str(build_dir), *defines],
        log=build_dir.parent / "cmake-configure.log",
    )
    jobs = str(usable_cores())  # (os.cpu_count ignores a container's quota and pin: -j64 on 2 CPUs)
    for target in targets:
        step(f"building {target} (-j{jobs}; everything takes about 4 minutes on 2 cores)")
        run(["cmake", "--build", str(build_dir), "-j", jobs, "--target", target],
            log=build_dir.parent / f"build-{target}.log")  # fmt: skip


def smoke_test(lib_dir: Path, include_dir: Path) -> str:
    """Load the libraries and decode a few tokens in a subprocess: a crash cannot take us down."""
    env = os.environ | {"LLMSESSION_LIB_DIR": str(lib_dir)}
    model = paths.default_model_path()
    cmd = [sys.executable, "-m", "llmsession.native.smoke", str(lib_dir)]
    cmd += [str(model)] if model.exists() else []
    step("smoke test: load the libraries" + (" and decode a few tokens" if model.exists() else ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-20:])
        raise SetupError(
            f"the llama.cpp build in {lib_dir} fails its smoke test (exit {out.returncode}); "
            f"delete {paths.llama_dir()} and run `llmsession setup` again.\n{tail}"
        )
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def fetch(dest: Path) -> None:
    check_tools(dest)
    src = dest / "src"
    if not (src / RPC_SOURCE).exists():  # absent too from sources extracted before RPC was added
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            extract_source(download_sdist(Path(tmp)), src)
    build_dir = dest / "build"
    build(src, build_dir, ["llama", "mtmd"])
    install_libs(build_dir / "bin", dest / "lib")
    install_headers([src / "include", src / "tools/mtmd", src / "ggml/include"], dest / "include")
    build_rpc_server(dest)


def build_rpc_server(dest: Path) -> None:
    """ggml-rpc-server into bin/: one file against the installed headers and libggml (its
    CMake target would build ggml a second time); its rpath reaches ../lib."""
    target = dest / "bin" / RPC_SERVER
    target.parent.mkdir(exist_ok=True)
    step(f"building {RPC_SERVER}")
    run(["c++", "-std=c++17", "-O2", "-o", str(target), str(dest / "src" / RPC_SOURCE),
         "-I", str(dest / "include"), "-L", str(dest / "lib"), "-lggml", "-lggml-base",
         "-Wl,-rpath,$ORIGIN/../lib"])  # fmt: skip


BENCH_PROJECT = """# The benchmarks alone: tools/CMakeLists.txt lists tools whose sources are not extracted.
cmake_minimum_required(VERSION 3.14)
project(llama_bench_only C CXX)
add_subdirectory(${LLAMA_SRC} llama)
set(PROJECT_SOURCE_DIR ${LLAMA_SRC})  # (llama-server's and its UI's paths start at llama.cpp's root)
add_subdirectory(${LLAMA_SRC}/tools/ui ui)
""" + "".join(
    f"add_subdirectory(${{LLAMA_SRC}}/{folder} {Path(folder).name})\n" for folder in BENCH_TOOLS.values()
)


def build_bench(dest: Path) -> None:
    """``BENCH_TOOLS`` into bin/: their rpath reaches ../lib, the very libraries llmsession loads."""
    check_tools(dest)
    if not all((dest / "src" / folder).exists() for folder in BENCH_TOOLS.values()):
        with tempfile.TemporaryDirectory(dir=dest) as tmp:  # extracted before a tool was added
            extract_source(download_sdist(Path(tmp)), dest / "src")
    project = dest / "bench"
    project.mkdir(exist_ok=True)
    (project / "CMakeLists.txt").write_text(BENCH_PROJECT)
    extra = {"LLAMA_SRC": str(dest / "src"), "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF"}
    build(project, project / "build", list(BENCH_TOOLS), common=True, extra=extra)
    (bin_dir := dest / "bin").mkdir(exist_ok=True)
    out = {tool: project / "build" / Path(folder).name for tool, folder in BENCH_TOOLS.items()}
    libraries = [out[tool] / f"lib{tool}-impl.so" for tool in BENCH_TOOLS]
    libraries += sorted((project / "build/bin").glob("libllama-common.so*"))
    # The programs last: a setup stopped on the way leaves one missing, and it is built again
    # (their presence is what says the tools are there).
    for path in [*libraries, *(out[tool] / tool for tool in BENCH_TOOLS)]:
        replace_with_copy(path, bin_dir / path.name)
    step(f"ready: {', '.join(str(bin_dir / tool) for tool in BENCH_TOOLS)}")


def build_abort_check(lib_dir: Path) -> None:
    """abort_check.c into lib/: the cancel check decodes outside the main thread use (no GIL)."""
    source = Path(llama_cffi.__file__).with_name("abort_check.c")
    target = lib_dir / llama_cffi.ABORT_CHECK
    if shutil.which("cc") is None:
        step(f"no C compiler (cc): {target.name} not built, cancels are checked in Python")
        return
    step(f"building {target.name}")
    partial = target.with_name(target.name + ".partial")  # (linked whole, then put in place:
    try:  # a file cut short by a stop was there for every later load to fail on)
        run(["cc", "-O2", "-shared", "-fPIC", "-o", str(partial), str(source)])
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def adopt(dest: Path, lib_dir: Path, include_dir: Path) -> None:
    """Use a user's existing build of the same llama.cpp version."""
    step(f"adopting the existing build: libraries {lib_dir}, headers {include_dir}")
    for header in HEADER_NAMES:
        if not (include_dir / header).exists():
            raise SetupError(f"{header} not found in {include_dir}")
    install_libs(lib_dir, dest / "lib")
    install_headers([include_dir], dest / "include")


@contextlib.contextmanager
def alone_in(dest: Path) -> Iterator[None]:
    """The cache ``dest`` to this setup alone: another one running (a second terminal, two CI
    jobs sharing a cache) is waited for, so that neither extracts, builds or installs over the
    other's work (their temporary folders had the same names)."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / ".setup.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            step(f"another setup is running in {dest}: waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as error:  # (a file system without locks: NFS without lockd, say)
            step(f"{dest} cannot be locked ({error.strerror}): going on without waiting for others")
        yield  # (the lock goes with the file's closing, however this ends)


def _todo(dest: Path, args: argparse.Namespace) -> tuple[bool, bool, bool]:
    """Whether this setup must install llama.cpp, build the abort check, build the bench tools."""
    return (
        args.force or not complete(dest),
        args.force or not (dest / "lib" / ABORT_CHECK).exists(),
        args.bench and (args.force or not all((dest / "bin" / tool).exists() for tool in BENCH_TOOLS)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--lib-dir", type=Path, default=os.environ.get("LLAMA_CPP_LIB_DIR"))
    parser.add_argument("--include-dir", type=Path, default=os.environ.get("LLAMA_CPP_INCLUDE_DIR"))
    parser.add_argument("--bench", action="store_true", help="also build " + ", ".join(BENCH_TOOLS))
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache is complete")
    args = parser.parse_args(argv)
    dest = paths.llama_dir()
    try:
        # A second setup at once waits, then finds the first's build; one with nothing to do
        # takes no lock (a complete cache may be read-only, in an image run by another user).
        with alone_in(dest) if any(_todo(dest, args)) else contextlib.nullcontext():
            installing, checking, benching = _todo(dest, args)  # (again, under the lock)
            if installing:
                install(dest, args)
            else:
                print(f"llama.cpp {paths.LLAMA_CPP_COMMIT} is already built in {dest} (nothing to do)")
            if checking:
                build_abort_check(dest / "lib")
            if benching:
                build_bench(dest)
    except SetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # (a cache that cannot be written, a disk that filled)
        print(f"error: {os_error(error, dest)}", file=sys.stderr)
        return 1
    return 0


def install(dest: Path, args: argparse.Namespace) -> None:
    info_path = dest / "build-info.json"
    info_path.unlink(missing_ok=True)
    if args.lib_dir or args.include_dir:
        if not (args.lib_dir and args.include_dir):
            raise SetupError("--lib-dir and --include-dir go together")
        adopt(dest, args.lib_dir, args.include_dir)
        origin = f"adopted from {args.lib_dir}"
    else:
        fetch(dest)
        origin = f"built from {SDIST}"
    commit = smoke_test(dest / "lib", dest / "include")
    if not commit.startswith(paths.LLAMA_CPP_COMMIT[:7]):
        raise SetupError(
            f"the libraries report llama.cpp commit {commit!r}, expected {paths.LLAMA_CPP_COMMIT}; "
            "llmsession's bindings are generated from that exact version"
        )
    options = ggml_cpu_options() | ({} if args.lib_dir else THREADING)
    write_info(dest, {"commit": paths.LLAMA_CPP_COMMIT, "origin": origin, "cmake": options})
    step(f"ready: llama.cpp {paths.LLAMA_CPP_COMMIT} in {dest} (lib/, include/, src/)")


if __name__ == "__main__":
    sys.exit(main())
