"""What llama.cpp says only in its log: the buffers it allocated as it made a context or a
projector (``Owner.buffers``). Part of the native layer (see ``native``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

_BUFFER = re.compile(r" (compute|KV|RS) buffer size = +([0-9.]+) MiB")


def made_reporting(make: Callable[[], Any], *, cells: bool = False) -> tuple[Any, int]:
    """What ``make()`` returns, and the buffers llama.cpp reported allocating while it ran
    (``reported_bytes`` of this thread's log lines)."""
    made, lines = made_logging(make)
    return made, reported_bytes(lines, cells=cells)


def made_logging(make: Callable[[], Any]) -> tuple[Any, list[str]]:
    """What ``make()`` returns, and the lines llama.cpp logged on this thread while it ran."""
    from llama_cffi import captured_logs

    with captured_logs() as lines:
        made = make()
    return made, list(lines)


def reported_bytes(lines: Iterable[str], *, cells: bool = False) -> int:
    """The bytes of the compute buffers llama.cpp (or libmtmd) reported allocating in ``lines``
    (``captured_logs``), and with ``cells`` its KV (and recurrent state) buffers: it says them
    nowhere else, one line a buffer, in MiB to two places. Every line counts (a projector's vision
    and audio encoders say the same words of two buffers; a reserve made again counts twice,
    erring on the safe side)."""
    total = 0
    for match in filter(None, (_BUFFER.search(line) for line in lines)):
        kind, mib = match.groups()
        if kind == "compute" or cells:
            total += round(float(mib) * 2**20)
    return total


def cell_bytes(lines: Iterable[str]) -> int:
    """The bytes of the KV cells' and recurrent states' buffers reported in ``lines``, each
    rounded up to the next 0.01 MiB (a bound: what a state of them may hold)."""
    total = 0
    for match in filter(None, (_BUFFER.search(line) for line in lines)):
        kind, mib = match.groups()
        if kind != "compute":
            total += round((float(mib) + 0.01) * 2**20)
    return total
