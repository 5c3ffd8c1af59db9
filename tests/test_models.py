"""``Models``: two real chat models by name, loaded on demand and once, unloaded least recently
used first under ``max_loaded``, when idle, or at once with ``keep_alive=0``; a named
conversation resumes from its state after its model reloads (an unnamed one does not: the
variant that must fail); a load with no room is refused and unloads nothing."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from near_ties import assert_same_within_noise, scored

from llmsession import (
    GenerationOptions,
    Model,
    ModelFile,
    ModelNotFoundError,
    Models,
    ModelsFullError,
    RequestError,
    UnavailableError,
)
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel
from llmsession.native.reports import reported_bytes

GREEDY = GenerationOptions(max_tokens=8, temperature=0)
SYSTEM = "You are a terse assistant. " + "Answer in a few words and never apologise. " * 6


def loaded(models: Models) -> dict[str, bool]:
    return {status.name: status.loaded for status in models.status()}


def within(seconds: float, condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def two(smollm2_path: Path, gemma3_path: Path, **kwargs: Any) -> Models:
    return Models({"smol": smollm2_path, "gemma": gemma3_path}, threads=2, **kwargs)


def test_names_are_checked_and_an_unknown_one_is_a_request_error(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match="name"):
        Models({"../x": smollm2_path})
    with pytest.raises(ValueError, match="max_loaded"):
        Models({"smol": smollm2_path}, max_loaded=0)
    with Models({"smol": smollm2_path}) as models:
        with pytest.raises(ModelNotFoundError, match="served: smol") as raised:
            models.acquire("gpt-4")
        assert isinstance(raised.value, RequestError)
        with pytest.raises(ValueError, match="keep_alive"):
            models.acquire("smol", keep_alive=-2)
        assert loaded(models) == {"smol": False}


def test_concurrent_first_uses_wait_for_one_load(smollm2_path: Path) -> None:
    with Models({"smol": smollm2_path}, threads=2) as models:
        got: list[Model] = []
        threads = [threading.Thread(target=lambda: got.append(models.acquire("smol"))) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(got) == 4 and all(model is got[0] for model in got)  # (one load, one model)
        assert models.status()[0].users == 4 and models.status()[0].loads == 1
        for _ in got:
            models.release("smol")
        with pytest.raises(RuntimeError, match="released more often"):
            models.release("smol")


def first_then_second(models: Models, conversation: str | None) -> tuple[list[Any], Any, int]:
    """A conversation's first turn on smol, a turn on gemma (which unloads smol under
    ``max_loaded=1``), then its second turn on smol: that reply and the first prompt's length."""
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    history.append({"role": "user", "content": "Hi."})
    with models.use("smol") as smol:
        first = smol.chat(history, GREEDY, tenant="t", conversation=conversation)
    with models.use("gemma") as gemma:
        assert loaded(models) == {"smol": False, "gemma": True}
        gemma.chat([{"role": "user", "content": "Hello?"}], GREEDY)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    with models.use("smol") as smol:
        assert loaded(models) == {"smol": True, "gemma": False}
        second = smol.chat(copy.deepcopy(history), scored(GREEDY), tenant="t", conversation=conversation)
    return history, second, first.usage.prompt_tokens


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed: starts over"])
def test_least_recently_used_unloads_and_a_named_conversation_resumes_from_its_state(
    smollm2_path: Path, gemma3_path: Path, smollm2: Model, named: bool
) -> None:
    with two(smollm2_path, gemma3_path, max_loaded=1) as models:
        history, second, first_prompt = first_then_second(models, "c1" if named else None)
    if named:
        assert second.usage.reused_tokens >= first_prompt, (second.usage, first_prompt)
        assert_same_within_noise(smollm2, second, smollm2.chat(history, scored(GREEDY)))
    else:
        assert second.usage.reused_tokens < first_prompt // 2, (second.usage, first_prompt)


def test_a_load_with_no_room_is_refused_and_unloads_nothing(smollm2_path: Path, gemma3_path: Path) -> None:
    with two(smollm2_path, gemma3_path, max_loaded=1) as models:
        smol = models.acquire("smol")  # (in use: it cannot be unloaded)
        with pytest.raises(ModelsFullError, match=r"smol \(\d+ MiB, in use\)") as raised:
            models.acquire("gemma")
        assert isinstance(raised.value, UnavailableError)
        assert loaded(models) == {"smol": True, "gemma": False}
        assert smol.chat([{"role": "user", "content": "Hi."}], GREEDY).text
        models.release("smol")
        assert models.acquire("gemma") is not None  # (now smol is idle: it goes)
        assert loaded(models) == {"smol": False, "gemma": True}
        models.release("gemma")
    small = two(smollm2_path, gemma3_path, memory_limit=gemma3_path.stat().st_size // 2)
    with small, pytest.raises(ModelsFullError, match="memory limit") as refused:
        small.acquire("gemma")
    assert loaded(small) == {"smol": False, "gemma": False} and refused.value.too_large
    assert not raised.value.too_large  # (smol was in use: it may be idle later)


def test_a_load_measured_past_the_limit_unloads_idle_models_to_keep_within_it(
    smollm2_path: Path, gemma3_path: Path
) -> None:
    """A model counts its files until its first load; loaded, it is measured (its cells and
    buffers too), and idle models unload until those held fit the limit again."""
    settings: dict[str, Any] = {"batch_size": 64, "kv_tokens": 1024}
    with two(smollm2_path, gemma3_path, **settings) as models:
        models.load("smol")
        smol = models.status()[0].resident_bytes
    files = gemma3_path.stat().st_size
    limit = smol + files + 2**20  # (gemma fits beside smol by its files, not as loaded)
    with two(smollm2_path, gemma3_path, memory_limit=limit, **settings) as models:
        models.load("smol")
        models.load("gemma")
        assert models.status()[1].resident_bytes > files + 2**20
        assert loaded(models) == {"smol": False, "gemma": True}
        assert sum(s.resident_bytes for s in models.status() if s.loaded) <= limit
        models.load("smol")  # (and back: gemma, idle, goes before smol loads)
        assert loaded(models) == {"smol": True, "gemma": False}


def test_buffers_are_read_from_what_llama_cpp_reports_allocating() -> None:
    mib = 2**20
    lines = [
        "llama_context:        CPU  output buffer size =     0.75 MiB",
        "llama_kv_cache:        CPU KV buffer size =    22.50 MiB",
        "llama_kv_cache:        CPU KV buffer size =     1.50 MiB",  # (a sliding window's own cache)
        "sched_reserve:        CPU compute buffer size =    98.01 MiB",
        "sched_reserve:   CPU_Mapped compute buffer size =     2.50 MiB",
        "reserve_compute_meta: CPU compute buffer size =     3.00 MiB",  # (a projector's vision
        "reserve_compute_meta: CPU compute buffer size =     1.00 MiB",  # and audio encoders)
    ]
    assert reported_bytes(lines) == round(98.01 * mib) + round(2.5 * mib) + 4 * mib
    assert reported_bytes(lines, cells=True) == reported_bytes(lines) + 24 * mib
    assert reported_bytes(["a compute buffer size of 5 MiB"]) == 0


SMOL_VOCAB = 49_152  # SmolLM2's vocabulary: llama.cpp's compute buffer holds a batch's logits


def test_a_context_reserving_fewer_rows_holds_less_and_refuses_a_batch_asking_more(
    smollm2_path: Path,
) -> None:
    """A chat context reserves logits for the rows its decodes ask (``outputs_per_seq``), not for
    a whole batch; a batch asking for more is refused before llama.cpp, which would abort."""
    native = NativeModel(smollm2_path)
    try:
        whole = NativeContext(native, n_ctx=512, n_batch=256, threads=2, n_seq_max=2)
        few = NativeContext(native, n_ctx=512, n_batch=256, threads=2, n_seq_max=2, outputs_per_seq=2)
        rows = (256 - 4) * SMOL_VOCAB * 4  # (the logits of the rows not reserved)
        assert whole.reported - few.reported >= rows // 2  # (the compute buffer: 42 MiB of 47)
        assert whole.buffers - few.buffers >= rows + rows // 2  # (and the output buffer's bound)
        runs = [(list(range(100, 140)), 0, 0), (list(range(200, 210)), 0, 1)]
        assert few.decode_many(runs, [2, 2]) == [39, 49]
        for seq in (0, 1):
            few.seq_rm(-1, seq)
        with pytest.raises(ValueError, match="at most 4 rows"):
            few.decode_many(runs, [3, 2])
        with pytest.raises(ValueError, match="at most 4 rows"):
            few.decode(list(range(100, 110)), 0, outputs=True)
        assert whole.decode_many(runs, [40, 10]) == [39, 49]  # (a whole batch's rows: reserved)
    finally:
        native.close()


def test_a_model_counts_llama_cpps_buffers_against_the_limit(smollm2_path: Path) -> None:
    """What llama.cpp allocates beside weights and cells (compute and output buffers) counts: the
    output buffer holds 8 rows of logits a session (4 sessions), the compute buffer grows with the
    batch; a limit that holds all but half of the buffers refuses the model's reload."""
    sizes = {}
    for batch in (64, 256):
        with Models({"smol": smollm2_path}, threads=2, batch_size=batch, kv_tokens=1024) as models:
            with models.use("smol") as model:
                report = model.memory()
            status = models.status()[0]
            files = smollm2_path.stat().st_size
            assert (
                status.resident_bytes
                == files + report.kv_bytes + report.buffer_bytes + report.host_cache_bytes
            )
            reported = report.buffer_bytes - 4 * 8 * SMOL_VOCAB * 4  # (the output buffers' bound)
            assert reported > 2**20, (batch, report.buffer_bytes)
            sizes[batch] = report.buffer_bytes, status.resident_bytes
    assert sizes[256][0] > sizes[64][0]  # (a batch's activations)
    buffers, resident = sizes[64]
    limit = resident - buffers // 2
    with Models(
        {"smol": smollm2_path}, threads=2, batch_size=64, kv_tokens=1024, memory_limit=limit
    ) as models:
        models.load("smol")  # (before its first load it counts its file only)
        deadline = time.monotonic() + 30  # (idle, over the limit: it goes; it stayed, and served)
        while loaded(models)["smol"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loaded(models) == {"smol": False}
        with pytest.raises(ModelsFullError, match="larger than the memory limit") as raised:
            models.load("smol")
        assert raised.value.too_large  # (by itself: no wait helps)
    with Models(
        {"smol": smollm2_path}, threads=2, batch_size=64, kv_tokens=1024, memory_limit=resident
    ) as models:
        models.load("smol")
        assert models.unload("smol")
        models.load("smol")  # (it fits exactly)
        assert loaded(models) == {"smol": True}


def test_idle_models_unload_after_idle_unload_or_keep_alive(smollm2_path: Path) -> None:
    with Models({"smol": smollm2_path}, threads=2, idle_unload=0.5) as models:
        models.load("smol")
        assert loaded(models) == {"smol": True}
        assert within(10, lambda: not loaded(models)["smol"])
        with models.use("smol", keep_alive=-1):
            pass
        time.sleep(1.5)
        assert loaded(models) == {"smol": True}  # (kept: keep_alive -1)
        with models.use("smol", keep_alive=0):
            assert loaded(models) == {"smol": True}  # (in use: never unloaded)
        assert within(10, lambda: not loaded(models)["smol"])


def test_a_folder_names_its_models_and_their_projectors(tmp_path: Path, smollm2_path: Path) -> None:
    for name in ("chat.gguf", "mmproj-chat.gguf", "other.gguf", "notes.txt"):
        (tmp_path / name).symlink_to(smollm2_path)
    with Models.from_folder(tmp_path) as models:
        assert models.names == ["chat", "other"]
        assert models.file("chat") == ModelFile(tmp_path / "chat.gguf", tmp_path / "mmproj-chat.gguf")
        assert models.file("other").mmproj_path is None


def test_the_parking_folder_is_made_again_when_taken_away(tmp_path: Path) -> None:
    """A sweep of old temporary files took the folder: every later park failed (each named
    conversation dropped at each unload) for the rest of the process."""
    from llmsession.api import _parking

    folder = _parking.Folder(tmp_path)
    try:
        shutil.rmtree(folder.path)
        file = folder.next_file()
        assert file.parent == folder.path and folder.path.is_dir()
        assert folder.path.stat().st_mode & 0o777 == 0o700
    finally:
        folder.remove()
    with pytest.raises(OSError, match="removed"):  # (never made again once its models closed)
        folder.next_file()
    assert not folder.path.exists()


def test_a_model_that_closed_by_itself_loads_again(smollm2_path: Path) -> None:
    with Models({"smol": smollm2_path}, threads=2) as models:
        with models.use("smol") as first:
            first.close()  # (as a worker process that died leaves it)
        with models.use("smol") as second:
            assert second is not first and not second.closed
            assert second.chat([{"role": "user", "content": "Hi."}], GREEDY).text
        assert models.status()[0].loads == 2


def test_a_load_waits_for_an_unload_under_way_instead_of_refusing(
    smollm2_path: Path, gemma3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smol unloads once idle (keep_alive 0), slowly; gemma, asked meanwhile under
    ``max_loaded=1``, waits for the room that unload leaves."""
    from llmsession.api import _parking

    parking = threading.Event()
    real_park = _parking.park

    def slow_park(model: Model, folder: Any) -> Any:
        parking.set()
        time.sleep(1.0)
        return real_park(model, folder)

    monkeypatch.setattr(_parking, "park", slow_park)
    with two(smollm2_path, gemma3_path, max_loaded=1) as models:
        with models.use("smol", keep_alive=0):
            pass
        assert parking.wait(10)  # (the sweeper is unloading smol now)
        with models.use("gemma") as gemma:
            assert gemma.chat([{"role": "user", "content": "Hi."}], GREEDY).text
        assert loaded(models) == {"smol": False, "gemma": True}


def test_parked_conversations_leave_with_their_process_however_it_ends(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """The folder a ``Models`` parks conversations in (they hold what was said) is removed at
    the interpreter's exit if the models were never closed, and, if its process was killed, by
    the next ``Models`` of this host that parks in the same place. The variant that must fail:
    a folder of a process still running is kept."""
    code = (
        "import os, sys\n"
        "from llmsession import Models\n"
        f"models = Models({{'smol': {str(smollm2_path)!r}}}, disk_cache_dir={str(tmp_path)!r})\n"
        "print(os.getpid(), flush=True)\n"
        "if sys.argv[1] == 'kill':\n"
        "    os.kill(os.getpid(), 9)\n"
    )
    ended = subprocess.run([sys.executable, "-c", code, "exit"], capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0, ended.stderr
    assert not list(tmp_path.iterdir())  # (never closed: removed at exit)
    killed = subprocess.run([sys.executable, "-c", code, "kill"], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(f"llmsession-{int(killed.stdout)}@")
    with Models({"smol": smollm2_path}, disk_cache_dir=tmp_path) as models:
        assert not left.exists()
        (mine,) = tmp_path.iterdir()  # (this process's own, running: kept by the next one)
        with Models({"smol": smollm2_path}, disk_cache_dir=tmp_path):
            assert mine.exists()
        assert models.names == ["smol"]
    assert not list(tmp_path.iterdir())


def test_a_model_unloading_says_so_and_a_loading_one_says_loading(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Models.status()`` and ``/v1/models``' card: busy parking its conversations before it
    closes, a model is unloading (it read "loading" before)."""
    from llmsession import SessionConfig
    from llmsession.api import _parking
    from llmsession.serve.hosts import ManyModels
    from llmsession.serve.metrics import Metrics

    parking, go, park = threading.Event(), threading.Event(), _parking.park

    def held(*args: Any) -> Any:
        parking.set()
        go.wait(30)
        return park(*args)

    monkeypatch.setattr(_parking, "park", held)
    with Models({"smol": smollm2_path}, threads=1) as models:
        loading = threading.Thread(target=models.load, args=("smol",))
        loading.start()
        assert within(30, lambda: models.status()[0].busy or models.status()[0].loaded)
        status = models.status()[0]
        assert not status.unloading  # (loading, or loaded already)
        loading.join()
        unloading = threading.Thread(target=models.unload, args=("smol",))
        unloading.start()
        assert parking.wait(30)
        status = models.status()[0]
        assert status.busy and status.unloading
        listed = ManyModels(models, SessionConfig(), 1, Metrics()).cards()  # (what /v1/models lists)
        assert listed[0]["status"]["value"] == "unloading"
        go.set()
        unloading.join()
        status = models.status()[0]
        assert not (status.loaded or status.busy or status.unloading)


def test_a_model_file_named_by_strings_is_read_as_paths(smollm2_path: Path) -> None:
    """``ModelFile("model.gguf")``, as the README writes it, made ``Models`` fail on its first
    look at the file (``str`` has no ``stat``): paths are made ``Path``s, anything else refused."""
    named = ModelFile(str(smollm2_path), None)
    assert named == ModelFile(smollm2_path) and isinstance(named.path, Path)
    with Models({"smol": named}, threads=1) as models:
        assert [status.name for status in models.status()] == ["smol"]
    with pytest.raises(TypeError, match="path"):
        ModelFile(3)  # type: ignore[arg-type]


def test_models_never_closed_are_collected_with_what_they_loaded(smollm2_path: Path) -> None:
    """The sweeper thread ran a bound method of its ``Models``: one dropped without ``close``
    was never collected, its loaded models (their KV memory) and its thread alive to the
    interpreter's exit. Dropped, it goes, and closes what it loaded."""
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    models = Models({"smol": smollm2_path}, threads=1, flash_attention=False)
    sweepers = [t for t in set(threading.enumerate()) - before if t.name == "llmsession-models"]
    loaded = models.acquire("smol")
    models.release("smol")
    owner = weakref.ref(models)
    del models
    gc.collect()
    assert owner() is None and loaded.closed
    for sweeper in sweepers:
        sweeper.join(5)
    assert len(sweepers) == 1 and not sweepers[0].is_alive()


def test_a_load_waits_for_an_unload_under_way_instead_of_unloading_another(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two models may be loaded: ``a`` idle, ``b`` unloading (its ``keep_alive`` 0), then ``c``
    asked for. ``b``'s unload leaves the room ``c`` needs, but it counted as held, so ``a`` was
    unloaded too (and ``c`` waited for that park as well). ``c`` now waits for ``b`` alone."""
    from llmsession.api import _parking

    park = _parking.park

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.5)  # (the unload under way, long enough to ask for ``c`` meanwhile)
        return park(*args, **kwargs)

    monkeypatch.setattr(_parking, "park", slow)
    files = {name: smollm2_path for name in "abc"}
    with Models(files, max_loaded=2, threads=1, max_live_sessions=1, kv_tokens=512) as models:
        models.load("a")
        with models.use("b", keep_alive=0):
            pass
        assert within(10, lambda: any(s.unloading for s in models.status()))
        models.load("c")
        assert loaded(models) == {"a": True, "b": False, "c": True}
        assert [s.loads for s in models.status()] == [1, 1, 1]
