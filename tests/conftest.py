"""Shared fixtures (real models, the real libraries from the cache) and the test tiers.

Tiers: ``native`` tests need the llama.cpp libraries, the models and the fixtures (a test is
native when it uses a model fixture or lives in a file of ``NATIVE_FILES``); ``pty`` tests drive
a terminal; ``slow`` ones take tens of seconds; ``parallel`` ones (all but ``SERIAL_FILES``) are
what ``make test`` runs on two pytest-xdist workers, a core each, after the rest have run alone on
both cores. ``pytest -m "not native"`` runs the pure tiers without any native library. A native
test whose libraries or models are missing is skipped with the command that sets them up, and
``--no-skips`` (what ``make test`` passes) fails a run that skipped anything, so CI cannot pass
by skipping.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import internals
import pytest
from llama_cffi import LIBRARIES, lib_dir

from llmsession import LlmSessionError, Model
from llmsession.commands import paths

SETUP = "llmsession setup --models && python scripts/make_fixtures.py"  # or `make setup`
NATIVE_FIXTURES = {"smollm2", "gemma3", "smollm2_path", "gemma3_path", "fixture_path", "terminal", "control"}
NATIVE_FILES = {
    "test_bindings",
    "test_cli",
    "test_defects",
    "test_fuzz",
    "test_images",
    "test_lifetimes",
    "test_rpc",
    "test_wheel",
}  # they load the libraries or run llmsession in a subprocess without a model fixture
SLOW_FILES = {"test_fuzz", "test_wheel"}
SERIAL_FILES = {  # every file but these is ``parallel``: their tests need both cores to hold
    # (the probe of flash attention measures the thread count it is given, never more than the
    # usable cores; a Gemma 3 state restored past its window is wrong with two threads, exact
    # with one). The rest ran on two workers with a core each in 25 min 4 s where the two tiers
    # took 29.5-31 (2026-12-07, the 2-core AVX2 EPYC, 1,454 tests): the tests that decode with
    # two threads most of their time take about 1.6 times as long on one core, but the waits
    # (servers, subprocesses, Ray, a browser) and the Python of each worker overlap the other's.
    "test_attention",
    "test_persistence",
    "test_tiers",  # (it checks that a lone run keeps every core: on a pinned worker it could not)
}


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker (``make test`` runs the ``parallel`` tier on two) decodes on a core
    of its own: llama.cpp's threads spin at every graph node's barrier, so two workers of two
    threads each on two cores took over ten minutes for what one did in under three. Pinned, the
    library cuts every model's threads to that core (``usable_cores``), as do the servers and
    commands the tests start (they inherit the pin). Every thread of the worker is pinned (an
    IO thread of xdist's, numpy's), before the tests start one. With more cores, each worker
    takes its share of them."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or workers < 2 or len(cores) < 2:
        return
    index = int(worker.removeprefix("gw"))  # (a restarted worker is gw2, gw3, ...)
    share = set(cores[index % workers :: workers]) if workers <= len(cores) else {cores[index % len(cores)]}
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(int(thread), share)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-skips", action="store_true", help="fail the run if any test was skipped")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        module = item.path.stem
        if fixtures & NATIVE_FIXTURES or module in NATIVE_FILES:
            item.add_marker(pytest.mark.native)
        if "terminal" in fixtures:
            item.add_marker(pytest.mark.pty)
        if module in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if module not in SERIAL_FILES:
            item.add_marker(pytest.mark.parallel)


def missing_native() -> list[Path]:
    """What the native tier needs and this machine lacks."""
    needed = [lib_dir() / f"lib{name}.so" for name in LIBRARIES]
    needed += [paths.default_model_path(), paths.gemma3_model_path()]
    fixtures = ("mmproj-tiny.gguf", "mamba-tiny.gguf", "lfm2-tiny.gguf", "t5-tiny.gguf")
    needed += [paths.fixtures_dir() / name for name in fixtures]
    return [path for path in needed if not path.exists()]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("native") is not None:
        missing = missing_native()
        if missing:
            pytest.skip(f"run `{SETUP}`: missing {', '.join(str(p) for p in missing[:3])}")


SKIPPED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("--no-skips") and SKIPPED and exitstatus == 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"--no-skips: {len(SKIPPED)} test(s) were skipped; the run fails", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is missing: run `{SETUP}`")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _require(paths.default_model_path())


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _require(paths.gemma3_model_path())


@pytest.fixture(scope="session")
def fixture_path() -> object:
    def find(name: str) -> Path:
        return _require(paths.fixtures_dir() / name)

    return find


SHARED_MODELS = ("smollm2", "gemma3", "vision")  # fixtures whose model outlives a test


@pytest.fixture(autouse=True)
def _forget_the_tests_sessions(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test, the sessions it left on a model other tests use forget their KV state: a
    session one test dropped (collected only by a later garbage collection, if it is in a
    cycle) must not be where another test's session starts from (``share_prefix``)."""
    yield
    for name in SHARED_MODELS:
        if name in request.fixturenames:
            model = request.getfixturevalue(name)
            for session in list(internals.local(model).sessions):
                with contextlib.suppress(LlmSessionError):  # busy in a thread the test left, closed
                    session.close()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Iterator[Model]:
    with Model(smollm2_path, threads=2) as model:
        yield model


@pytest.fixture(scope="session")
def gemma3(gemma3_path: Path) -> Iterator[Model]:
    # 4,096 cells a session: quick to make. Flash attention off, whatever this machine's probe
    # would choose: with it on, Gemma 3 Q4_K_M's batch-split noise on a 900-token prompt was 3.1
    # logits here (AVX-512 EPYC, 2026-12-03), past what its differential tests are built for.
    with Model(gemma3_path, threads=2, kv_tokens=16384, flash_attention=False) as model:
        yield model
