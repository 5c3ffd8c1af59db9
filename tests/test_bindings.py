"""The generated cdef against the real headers and libraries: drift, struct layout, coverage."""

from __future__ import annotations

import ctypes
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import internals
import pytest
from llama_cffi import LIBRARIES, LLAMA_CPP_COMMIT, NOT_EXPORTED, ffi, include_dir, lib_dir, load

from llmsession.commands import llama_cache

ROOT = Path(__file__).resolve().parents[1]
API_HEADERS = ("llama.h", "mtmd.h", "mtmd-helper.h")
BY_VALUE_STRUCTS = {
    "llama_model_params", "llama_context_params", "llama_batch", "mtmd_context_params",
    "mtmd_input_text", "llama_sampler_chain_params", "llama_chat_message",
}  # fmt: skip


def test_committed_cdef_matches_the_headers() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/gen_bindings.py"),
            "--check",
            "--include-dir",
            str(include_dir()),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


def test_cdef_names_the_commit() -> None:
    first = (ROOT / "bindings/llama_cffi/_cdef.h").read_text().splitlines()[0]
    assert LLAMA_CPP_COMMIT in first


def layouts_from_cffi() -> dict[str, int]:
    """sizeof of every non-opaque struct and offsetof of every field, as cffi computes them."""
    _, structs, unions = ffi.list_types()
    out: dict[str, int] = {}
    for kind, names in (("struct", structs), ("union", unions)):
        for name in names:
            ctype = ffi.typeof(f"{kind} {name}")
            if ctype.fields is None:
                continue  # opaque
            out[f"sizeof {kind} {name}"] = ffi.sizeof(ctype)
            for field, info in ctype.fields:
                out[f"offsetof {kind} {name}.{field}"] = info.offset
    return out


def layouts_from_compiler(keys: list[str], tmp_path: Path) -> dict[str, int]:
    """The same numbers from the C compiler, compiled against the headers the libraries came from."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "mtmd-helper.h"', "int main(void) {"]
    for key in keys:
        op, rest = key.split(" ", 1)
        if op == "sizeof":
            lines.append(f'  printf("%s %zu\\n", "{key}", sizeof({rest}));')
        else:
            type_name, field = rest.rsplit(".", 1)
            lines.append(f'  printf("%s %zu\\n", "{key}", offsetof({type_name}, {field}));')
    lines += ["  return 0;", "}"]
    source = tmp_path / "probe.c"
    source.write_text("\n".join(lines) + "\n")
    binary = tmp_path / "probe"
    subprocess.run(["cc", "-I", str(include_dir()), str(source), "-o", str(binary)], check=True)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in output.splitlines()}


def test_every_struct_layout_matches_the_compiler(tmp_path: Path) -> None:
    expected = layouts_from_cffi()
    names = {key.split(" ")[2].split(".")[0] for key in expected}
    assert names >= BY_VALUE_STRUCTS, "a struct passed by value is missing from the cdef"
    actual = layouts_from_compiler(sorted(expected), tmp_path)
    mismatches = {k: (v, actual.get(k)) for k, v in expected.items() if actual.get(k) != v}
    assert not mismatches, f"cffi layout differs from the C compiler's: {mismatches}"


def api_functions() -> set[str]:
    """Every function the three headers declare with LLAMA_API or MTMD_API."""
    names = set()
    for header in API_HEADERS:
        text = (include_dir() / header).read_text()
        text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
        text = re.sub(r"\bDEPRECATED\(", "", text)  # LLAMA_API DEPRECATED(size_t llama_get_state_size(
        for match in re.finditer(r"\b(?:LLAMA|MTMD)_API\b([^;{]*?)\(", text):
            if text[: match.start()].rsplit("\n", 1)[-1].lstrip().startswith("#"):
                continue  # the macro's own definition
            names.add(re.findall(r"\w+", match.group(1))[-1])
    return names


def test_every_declared_function_is_in_the_cdef_and_exported() -> None:
    declared = api_functions()
    assert len(declared) > 250
    handles = [ctypes.CDLL(str(lib_dir() / f"lib{name}.so")) for name in LIBRARIES]

    def exported(name: str) -> bool:
        return any(hasattr(handle, name) for handle in handles)

    lib, _ = load()
    missing_from_libs = {name for name in declared if not exported(name)}
    assert missing_from_libs == NOT_EXPORTED, "exceptions must be listed explicitly in NOT_EXPORTED"
    missing_from_cdef = {name for name in declared - NOT_EXPORTED if not hasattr(lib, name)}
    assert not missing_from_cdef


def test_tokenize_detokenize_round_trip(smollm2_path: Path) -> None:
    from llmsession import Model

    with Model(smollm2_path) as model:
        text = "Hello, world! Ünïcödé ✓ 你好 — tabs\tand\nnewlines."
        tokens = model.tokenize(text, add_special=False)
        assert len(tokens) > 5
        assert model.detokenize(tokens) == text


def test_chat_template_is_chatml(smollm2_path: Path) -> None:
    from llmsession import Model

    with Model(smollm2_path) as model:
        assert model.template is not None
        assert "<|im_start|>" in model.template


def test_short_decode_gives_finite_logits(smollm2_path: Path) -> None:
    from llmsession.native.context import NativeContext
    from llmsession.native.llama import NativeModel

    model = NativeModel(smollm2_path)
    context = NativeContext(model, n_ctx=128, n_batch=32, threads=2)
    tokens = model.tokenize("The capital of France is", add_special=True)
    context.decode(tokens, 0)
    logits = internals.raw_logits(context)
    values = [logits[i] for i in range(model.n_vocab)]
    assert all(math.isfinite(v) for v in values)
    assert max(values) - min(values) > 1.0
    context.close()
    model.close()


def test_gemma3_reports_its_sliding_window(gemma3_path: Path) -> None:
    from llmsession.native.llama import NativeModel

    model = NativeModel(gemma3_path)
    assert model.n_swa == 512
    assert model.chat_template() is None
    model.close()


@pytest.mark.parametrize("level", ["warning"])
def test_native_logs_reach_python_logging(
    level: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from llmsession import Model, ModelLoadError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with caplog.at_level(level.upper(), logger="llmsession.native"), pytest.raises(ModelLoadError):
        Model(bad)
    assert any(record.name == "llmsession.native" for record in caplog.records)


def test_the_built_libraries_run_on_ggmls_own_threads_not_openmp() -> None:
    """With OpenMP a decode in a second Python thread ran 0.72 times as fast (libgomp throttles
    its teams' spinning once there are two); see ``llama_cache.THREADING``."""
    info = json.loads((lib_dir().parent / "build-info.json").read_text())
    needed = subprocess.run(["ldd", str(lib_dir() / "libggml-cpu.so")], capture_output=True, text=True)
    assert needed.returncode == 0, needed.stderr
    if "adopted" not in info["origin"]:  # a user's own build is used as it is
        assert info["cmake"]["GGML_OPENMP"] == "OFF"
        assert "libgomp" not in needed.stdout, needed.stdout


def test_a_cache_built_with_openmp_or_without_rpc_is_built_again(tmp_path: Path) -> None:
    for name in LIBRARIES:
        (tmp_path / "lib").mkdir(exist_ok=True)
        (tmp_path / "lib" / f"lib{name}.so").touch()
    (tmp_path / "bin").mkdir()
    record = tmp_path / "build-info.json"

    def written(origin: str, cmake: dict[str, str]) -> Path:
        record.write_text(json.dumps({"commit": LLAMA_CPP_COMMIT, "origin": origin, "cmake": cmake}))
        return tmp_path

    built = "built from the sdist"
    assert not llama_cache.complete(written(built, {"GGML_OPENMP": "OFF"}))  # no RPC server
    (tmp_path / "bin" / llama_cache.RPC_SERVER).touch()
    assert llama_cache.complete(written(built, {"GGML_AVX2": "ON", "GGML_OPENMP": "OFF"}))
    assert not llama_cache.complete(written(built, {"GGML_AVX2": "ON"}))  # made with OpenMP
    assert llama_cache.complete(written("adopted from /opt/llama", {"GGML_AVX2": "ON"}))
    (tmp_path / "lib" / "libggml-rpc.so").unlink()
    assert not llama_cache.complete(written(built, {"GGML_OPENMP": "OFF"}))


def test_a_damaged_build_record_is_built_again_and_libraries_are_replaced_not_rewritten(
    tmp_path: Path,
) -> None:
    """A record left empty (the disk filled as it was written) or not an object made `setup`
    and `doctor` raise every time, `--force` too; written now beside and renamed into place. A
    library is replaced by a new file: written in place, a process that had it mapped crashed."""
    for text in ("", "[1]", "{", '{"origin": "built", "cmake": null}'):
        (tmp_path / "build-info.json").write_text(text)
        assert not llama_cache.complete(tmp_path)
        assert llama_cache.read_info(tmp_path) is None or "cmake" in text  # (an object: read)
    llama_cache.write_info(tmp_path, {"origin": "x"})
    assert llama_cache.read_info(tmp_path) == {"origin": "x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build-info.json"]
    (old := tmp_path / "libx.so").write_bytes(b"old")
    (new := tmp_path / "new.so").write_bytes(b"new")
    with old.open("rb") as mapped:  # (as a process holds it)
        llama_cache.replace_with_copy(new, old)
        assert mapped.read() == b"old" and old.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build-info.json", "libx.so", "new.so"]


def test_a_second_setup_at_once_waits_for_the_first_and_finds_its_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `llmsession setup` at once on one cache (two terminals, two CI jobs): the second waits
    for the first, then finds its build complete and does nothing (both extracted into the same
    temporary folder and built in the same one, each deleting what the other made)."""
    import threading
    import time

    from llama_cffi import ABORT_CHECK

    from llmsession.commands import paths, setup_llama

    dest = tmp_path / "llama"
    (dest / "lib").mkdir(parents=True)
    (dest / "lib" / ABORT_CHECK).touch()
    built, installed, results = threading.Event(), list[Path](), list[int]()
    monkeypatch.setattr(paths, "llama_dir", lambda: dest)
    monkeypatch.setattr(setup_llama, "complete", lambda _: built.is_set())
    monkeypatch.setattr(setup_llama, "install", lambda folder, _: installed.append(folder))
    with setup_llama.alone_in(dest):  # (the first setup, still building)
        second = threading.Thread(target=lambda: results.append(setup_llama.main([])))
        second.start()
        time.sleep(0.5)
        assert second.is_alive() and not installed
        built.set()  # (the first's build is complete as it lets go)
    second.join(10)
    assert results == [0] and not installed


def test_the_abort_check_is_linked_beside_and_put_in_place_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link stopped on the way (a full disk, a Ctrl-C) leaves the library as it was, and no
    part of the new one: linked in place, a file cut short was there for every later load to
    fail on, `--force` too."""
    import shutil

    from llama_cffi import ABORT_CHECK

    from llmsession.commands import setup_llama

    if shutil.which("cc") is None:
        pytest.fail("no C compiler (cc): `make setup` builds the abort check with it")
    setup_llama.build_abort_check(tmp_path)
    built = (tmp_path / ABORT_CHECK).read_bytes()
    assert built.startswith(b"\x7fELF") and sorted(p.name for p in tmp_path.iterdir()) == [ABORT_CHECK]

    def cut_short(command: list[str], **_: object) -> None:
        Path(command[command.index("-o") + 1]).write_bytes(built[:100])
        raise setup_llama.SetupError("the disk filled")

    monkeypatch.setattr(setup_llama, "run", cut_short)
    with pytest.raises(setup_llama.SetupError):
        setup_llama.build_abort_check(tmp_path)
    assert (tmp_path / ABORT_CHECK).read_bytes() == built
    assert sorted(p.name for p in tmp_path.iterdir()) == [ABORT_CHECK]


def test_a_setup_with_nothing_to_do_writes_nothing_and_one_without_locks_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A complete cache is left as it is, no lock file made (it may be read-only: an image run
    by another user); where the file system has no locks (NFS without lockd), setup says so and
    builds, not fails."""
    import errno
    import fcntl

    from llama_cffi import ABORT_CHECK

    from llmsession.commands import paths, setup_llama

    dest = tmp_path / "llama"
    (dest / "lib").mkdir(parents=True)
    (dest / "lib" / ABORT_CHECK).touch()
    installed: list[Path] = []
    monkeypatch.setattr(paths, "llama_dir", lambda: dest)
    monkeypatch.setattr(setup_llama, "complete", lambda _: True)
    monkeypatch.setattr(setup_llama, "install", lambda folder, _: installed.append(folder))
    assert setup_llama.main([]) == 0
    assert sorted(p.name for p in dest.rglob("*")) == ["lib", ABORT_CHECK] and not installed

    def no_locks(*_: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(setup_llama, "complete", lambda _: False)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert setup_llama.main([]) == 0 and installed == [dest]
