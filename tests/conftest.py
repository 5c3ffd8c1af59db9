"""Shared fixtures: real models and the real libraries from the cache (``make setup`` puts them there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmsession import Model, paths


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make setup` first", pytrace=False)
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


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Iterator[Model]:
    with Model(smollm2_path, threads=2) as model:
        yield model


@pytest.fixture(scope="session")
def gemma3(gemma3_path: Path) -> Iterator[Model]:
    with Model(gemma3_path, threads=2) as model:
        yield model
