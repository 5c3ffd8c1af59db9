"""How many KV cells a model gets when nobody says (``Model(kv_tokens=None)``), and whether the
cells asked for fit in this machine's memory: pure arithmetic over the model's training context,
its bytes per cell and the memory available, as llama-server's ``--fit`` chooses a context.

By default each live session may use the model's training context (at most
``DEFAULT_CONTEXT_CAP``: a coding agent's first turn alone is 4-20K tokens), and the cells of
``max_live_sessions`` such sessions may take ``RAM_SHARE`` of the memory available; past that the
context is halved until they fit (never below ``MIN_CONTEXT``). Cells asked for explicitly are
refused only when they could not fit at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsession.engine.budget import CELLS_QUANTUM

DEFAULT_CONTEXT_CAP = 32768  # positions a session gets by default, at most
MIN_CONTEXT = 2048  # the least a fitted default gives (and a model that names less gets)
RAM_SHARE = 0.5  # of the memory available, what the default cells may take
GIB = 1 << 30


@dataclass(frozen=True)
class Sizing:
    """The KV cells chosen: ``kv_tokens`` in all, ``context_size`` a session's default (within
    what a live session holds), their estimated bytes, and how they were chosen
    (``Model.memory()`` and ``serve`` say it)."""

    kv_tokens: int
    context_size: int
    kv_bytes: int
    note: str
    fits: bool = True  # False: even the least default takes more than its share of the memory


def _rounded(positions: int) -> int:
    return max(CELLS_QUANTUM, positions // CELLS_QUANTUM * CELLS_QUANTUM)


def _default_note(context: int, n_ctx_train: int) -> str:
    """Where a default context of ``context`` positions came from."""
    if n_ctx_train <= 0:
        return "the file names no training context"
    if context == n_ctx_train:
        return "the model's training context"
    if n_ctx_train > DEFAULT_CONTEXT_CAP:
        return f"the model's training context ({n_ctx_train:,}) capped"
    if context < n_ctx_train:
        return f"the model's training context ({n_ctx_train:,}) in whole {CELLS_QUANTUM}s"
    return f"the least default (the model's training context is {n_ctx_train:,})"


def size_kv(
    asked: int | None,
    *,
    max_live: int,
    n_ctx_train: int,
    bytes_per_cell: int,
    available: int | None,
) -> Sizing:
    """The cells for ``asked`` kv_tokens (None: chosen here) and ``max_live`` live sessions, for
    a model trained on ``n_ctx_train`` positions whose cells take ``bytes_per_cell`` each, on a
    machine with ``available`` bytes of memory free (None: unknown). ValueError when the cells
    asked for, or the least default, cannot fit."""
    trained = n_ctx_train if n_ctx_train > 0 else DEFAULT_CONTEXT_CAP
    context = _rounded(min(max(trained, MIN_CONTEXT), DEFAULT_CONTEXT_CAP))
    if asked is not None:
        need = asked * bytes_per_cell
        if available is not None and need > available:
            raise ValueError(
                f"kv_tokens {asked} needs about {need / GIB:.1f} GiB of KV cells "
                f"({bytes_per_cell:,} bytes each), more than the {available / GIB:.1f} GiB of "
                "memory available: lower kv_tokens, or use kv_type='q8_0'"
            )
        return Sizing(asked, context, need, f"kv_tokens {asked:,} as set")
    note = _default_note(context, n_ctx_train)
    fits = True
    if available is not None:
        fitted = context
        while fitted > MIN_CONTEXT and fitted * max_live * bytes_per_cell > RAM_SHARE * available:
            fitted = max(MIN_CONTEXT, _rounded(fitted // 2))
        need = fitted * max_live * bytes_per_cell
        if need > available:
            raise ValueError(
                f"even the least default context ({MIN_CONTEXT:,} positions for each of {max_live} live "
                f"sessions) needs about {need / GIB:.1f} GiB of KV cells, more than the "
                f"{available / GIB:.1f} GiB of memory available: set a smaller kv_tokens or max_live_sessions"
            )
        share = f"{RAM_SHARE:.0%} of the {available / GIB:.1f} GiB of memory available"
        fits = need <= RAM_SHARE * available
        if not fits:
            note = f"the least default, which takes more than {share}: set kv_tokens"
        elif fitted < context:
            note = f"fitted to {share} ({note})"
        context = fitted
    kv_tokens = context * max_live
    note = f"{context:,} positions a session: {note}"
    return Sizing(kv_tokens, context, kv_tokens * bytes_per_cell, note, fits)
