"""Flash attention chosen at load where the caller left it to us, on the CPU with f16 cells: from
a probe of this model on this machine (``engine.attention``), measured once (about 4.5 seconds
for SmolLM2 here) and kept in the cache folder for every later load of a model of the same
shape (``shape.cost_shape``: the file, a copy of it, or another of the same architecture, sizes
and tensor types), build, CPU and thread count."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from llama_cffi import cache_root

from llmsession.engine.attention import BATCH, PROBE_DEPTH, AttentionProbe, probe_key
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel, build_commit, system_info
from llmsession.native.machine import cpu_name, usable_cores
from llmsession.native.shape import attention_scores_bytes, cost_shape
from llmsession.runtime.embedding import pooling_of

log = logging.getLogger("llmsession")

PROBES_FILE = "attention-probes.json"  # in the cache folder
LOCK_FILE = ".attention-probes.lock"  # held while a process reads, measures and writes them
MAX_PROBES = 256  # kept in it, the newest
MAX_FILE_BYTES = 1 << 20
MIN_TRAINED = 4 * BATCH  # a model trained on fewer positions is not probed
MAX_SCORES_BYTES = 1 << 30  # a batch's attention scores without flash attention, at most
FILL = 512  # the batch the probe fills a context to its depth with
REPEATS = 5  # times each is timed, with each setting in turn (the fastest kept)
LOCK_WAIT_S = 300.0  # for another process's probe, at most (SmolLM2's takes ~5 s)


def probed(native: NativeModel, path: Path, threads: int, context: int, batch: int = 512) -> bool:
    """Flash attention for sessions of ``context`` positions, from this machine's probe of the
    model (off, as before, where there is nothing to measure or it is not safe to: an
    encoder-decoder or recurrent model, or one trained on very few positions; or where the probe
    failed). One process measures while the others wait for its result (a lock file beside the
    probes): replicas started together measure once, on an otherwise quiet CPU. The probe's
    contexts are its own, not the engine's. More threads than usable cores are not measured
    (every decode would wait for a descheduled thread: a minute's probe of nothing useful). Where
    a batch's attention scores would take more than ``MAX_SCORES_BYTES`` without flash attention
    (many heads, a long context: a 32-head model at 32,768 positions and a batch of 512 takes
    2 GiB), it is on, whatever its speed."""
    if native.has_encoder or native.is_recurrent or native.n_ctx_train < MIN_TRAINED or native.n_vocab < 2:
        return False  # (as before: no attention over a growing context to speed up, or unsafe)
    if pooling_of(native) is not None:
        return False  # (an embedding or reranking model: no conversation grows in it either)
    scores = attention_scores_bytes(native, min(context, native.n_ctx_train), batch)
    if scores > MAX_SCORES_BYTES:
        log.debug(
            "flash attention on for %s: without it a batch's scores take %d MiB", path.name, scores >> 20
        )
        return True
    if threads > usable_cores():  # (every decode waits for a descheduled thread: it measures that)
        log.debug("flash attention off for %s: %d threads on %d cores", path.name, threads, usable_cores())
        return False
    try:
        probe = _kept_or_measured(native, threads, min(PROBE_DEPTH, native.n_ctx_train // 2))
    except Exception as error:  # (a context llama.cpp would not make, no cache folder: as before)
        log.debug("flash attention off for %s: the probe failed (%s)", path.name, error)
        return False
    flash = probe.choose(min(context, native.n_ctx_train))
    log.debug("flash attention %s for %s (probe %s)", "on" if flash else "off", path.name, probe)
    return flash


def _kept_or_measured(native: NativeModel, threads: int, depth: int) -> AttentionProbe:
    key = probe_key(
        model=cost_shape(native), build=build_commit(), system=system_info(), cpu=cpu_name(), threads=threads
    )
    folder = cache_root()
    kept = AttentionProbe.from_json(_read(folder / PROBES_FILE).get(key))
    if kept is not None and kept.depth == depth:
        return kept  # (read without the lock, the file only ever replaced whole: no load waits
        # behind another model's probe)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a") as lock:
        _lock(lock.fileno(), LOCK_WAIT_S)  # (released as the file closes)
        probes = _read(folder / PROBES_FILE)
        probe = AttentionProbe.from_json(probes.pop(key, None))
        if probe is None or probe.depth != depth:
            probe = measure(native, threads, depth)
        _write(folder / PROBES_FILE, {**probes, key: probe.to_json()})  # (newest measured last)
    return probe


def _lock(fd: int, seconds: float) -> None:
    """The probes' lock, waiting at most ``seconds`` for the process that holds it: one that
    holds it longer is stuck (stopped, or hung mid-probe), and every load on the machine would
    wait for it forever; this one goes on without the probe (``probed``: off)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"another process held {LOCK_FILE} for {seconds:g} s") from None
            time.sleep(0.05)


def measure(native: NativeModel, threads: int, depth: int = PROBE_DEPTH) -> AttentionProbe:
    """With each setting: a ``BATCH``-token batch and one generated token at depth 0, then past a
    fill to ``depth`` the same there; ``REPEATS`` times in turn (the fastest kept), after a small
    batch that pages the weights in."""
    ids = [(100 + i * 7) % native.n_vocab for i in range(depth + BATCH + 1)]
    fill = min(FILL, depth)
    contexts = {
        flash: NativeContext(
            native,
            n_ctx=depth + BATCH + 1,
            n_batch=max(fill, BATCH),
            threads=threads,
            flash_attention=flash,
            outputs_per_seq=1,  # (no batch's logits reserved: one row a decode)
        )
        for flash in (False, True)
    }
    best = {flash: [math.inf] * 4 for flash in contexts}
    try:
        for context in contexts.values():
            context.decode(ids[:16], 0)
        for at, (deep, batch) in enumerate(((0, ids[:BATCH]), (depth, ids[depth : depth + BATCH]))):
            if deep:
                for context in contexts.values():
                    context.seq_rm(-1)
                    for start in range(0, depth, fill):
                        context.decode(ids[start : min(depth, start + fill)], start)
            for _ in range(REPEATS):
                for flash, context in contexts.items():
                    context.seq_rm(deep)
                    best[flash][at] = min(best[flash][at], _timed(context, batch, deep))
                    step = _timed(context, ids[deep + BATCH : deep + BATCH + 1], deep + BATCH)
                    best[flash][2 + at] = min(best[flash][2 + at], step)
    finally:
        for context in contexts.values():
            context.close()
    off, on = best[False], best[True]
    return AttentionProbe((off[0], off[1], off[2], off[3]), (on[0], on[1], on[2], on[3]), depth)


def _timed(context: NativeContext, ids: list[int], start: int) -> float:
    began = time.perf_counter()
    context.decode(ids, start)
    return time.perf_counter() - began


def _read(file: Path) -> dict[str, Any]:
    """The probes kept (nothing, if the file is missing, not a plain file, too large or not ours)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            text = f.read(MAX_FILE_BYTES + 1)
        data = json.loads(text) if len(text) <= MAX_FILE_BYTES else None
    except Exception:  # (unreadable, not JSON, nested past the parser's depth)
        return {}
    return data if isinstance(data, dict) else {}


def _write(file: Path, probes: dict[str, Any]) -> None:
    """Keep the ``MAX_PROBES`` probes measured last, written whole at once (best effort)."""
    kept = dict(list(probes.items())[-MAX_PROBES:])
    try:
        fd, name = tempfile.mkstemp(prefix=".probes-", dir=file.parent)
    except OSError as error:
        log.debug("the attention probe was not kept: %s", error)
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(name, file)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(name)
        if not isinstance(error, OSError):
            raise
        log.debug("the attention probe was not kept: %s", error)
