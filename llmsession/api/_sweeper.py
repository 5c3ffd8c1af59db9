"""The thread that unloads a ``Models``' idle models, and what a ``Models`` collected unclosed
leaves to close. The thread holds its ``Models`` only weakly while it waits: a thread of a bound
method kept a ``Models`` never closed, its loaded models and their memory, alive until the
interpreter's exit.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

from llmsession.api import _parking
from llmsession.api.modelfiles import Entry


def sweeping(swept: weakref.WeakMethod[Callable[[], float | None]], changed: threading.Condition) -> None:
    """The sweeper thread: ``swept()`` (``Models._swept``, the lock held) while its ``Models``
    lives, waiting as long as it says between (0: at once; None: until woken; -1: closed)."""
    with changed:
        while True:
            step = swept()
            wait = -1 if step is None else step()
            del step  # (not held while it waits: the last reference may go here, and its
            if (wait is not None and wait < 0) or swept() is None:  # finalizer's wake-up with it)
                return
            if wait != 0:
                changed.wait(wait)


def due(
    entries: Iterable[Entry], keep: Callable[[Entry], float | None], now: float
) -> tuple[list[Entry], float | None]:
    """The idle models past their keep-alive (``keep``: an entry's, -1 kept, None no unload),
    and the seconds until the next one is due."""
    late, wait = [], None
    for entry in entries:
        kept = keep(entry)
        if not entry.idle or kept is None or kept < 0:
            continue
        left = entry.last_used + kept - now
        if left <= 0:
            late.append(entry)
        else:
            wait = left if wait is None else min(wait, left)
    return late, wait


def dropped(entries: dict[str, Entry], changed: threading.Condition, folder: _parking.Folder) -> None:
    """A ``Models`` collected unclosed: its loaded models closed, its sweeper woken to end, its
    parked conversations removed."""
    with changed:
        models = [e.model for e in entries.values() if e.model is not None]
        for entry in entries.values():
            entry.model = None
        changed.notify_all()
    for model in models:
        model.close()
    folder.remove()
