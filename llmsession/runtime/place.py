"""Where an exchange runs (``Place``): its session's lease on the engine, its sizes, and what the
session hands it (``Carry``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmsession.engine.engine import Engine
from llmsession.engine.lease import Lease
from llmsession.native.llama import NativeModel

if TYPE_CHECKING:
    from llmsession.engine.anticipate import Ahead


@dataclass
class Carry:
    """What a session hands its next exchange: a loaded file's note and the anticipatory
    prefill settled before it (each reported once, by the exchange that plans first)."""

    load_note: tuple[int, str] | None = None
    anticipated: Ahead | None = None


@dataclass(frozen=True)
class Place:
    """Where an exchange runs: its session's lease on the engine and its sizes."""

    engine: Engine
    native: NativeModel
    lease: Lease
    context_size: int
    batch_size: int
    carry: Carry
