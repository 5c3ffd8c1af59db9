"""Flash attention chosen at load where the caller left it to us, on the CPU with f16 cells: from
a probe of this model on this machine (``engine.attention``), measured once (about a second for
SmolLM2 here) and kept in the cache folder for every later load of the same file, build, CPU and
thread count."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from llama_cffi import cache_root

from llmsession.engine.attention import PROBE_TOKENS, AttentionProbe, probe_key
from llmsession.errors import NativeError
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel, build_commit, system_info

log = logging.getLogger("llmsession")

PROBES_FILE = "attention-probes.json"  # in the cache folder
MAX_PROBES = 256  # kept in it, the newest
MIN_TRAINED = 64  # a model trained on fewer positions is not probed


def probed(native: NativeModel, path: Path, threads: int, context: int) -> bool:
    """Flash attention for sessions of ``context`` positions, from this machine's probe of the
    model (off, as before, where there is nothing to measure or it is not safe to: an
    encoder-decoder or recurrent model, or one trained on very few positions). The probe's
    contexts are its own, not the engine's."""
    if native.has_encoder or native.is_recurrent or native.n_ctx_train < MIN_TRAINED:
        return False  # (as before: no attention over a growing context to speed up, or unsafe)
    tokens = min(PROBE_TOKENS, native.n_ctx_train // 2)
    key = probe_key(
        model=_identity(path), build=build_commit(), system=system_info(), cpu=_cpu(), threads=threads
    )
    file = cache_root() / PROBES_FILE
    probes = _read(file)
    probe = AttentionProbe.from_json(probes.get(key))
    if probe is None:
        try:
            probe = measure(native, threads, tokens)
        except NativeError as error:  # (a context llama.cpp would not make: as before)
            log.debug("flash attention off for %s: the probe failed (%s)", path.name, error)
            return False
        _write(file, {**probes, key: probe.to_json()})
    flash = probe.choose(min(context, native.n_ctx_train))
    log.debug("flash attention %s for %s (probe %s)", "on" if flash else "off", path.name, probe)
    return flash


def measure(native: NativeModel, threads: int, tokens: int = PROBE_TOKENS) -> AttentionProbe:
    """A batch of ``tokens`` at depth 0 and one after it, with each setting, timed (after a small
    batch that pages the weights in)."""
    ids = [(100 + i * 7) % native.n_vocab for i in range(2 * tokens)]
    timings: dict[bool, tuple[float, float]] = {}
    for flash in (False, True):
        context = NativeContext(
            native, n_ctx=2 * tokens, n_batch=tokens, threads=threads, flash_attention=flash
        )
        try:
            context.decode(ids[:16], 0)
            context.seq_rm(-1, 0)
            timings[flash] = (_timed(context, ids[:tokens], 0), _timed(context, ids[tokens:], tokens))
        finally:
            context.close()
    return AttentionProbe(off=timings[False], on=timings[True])


def _timed(context: NativeContext, ids: list[int], start: int) -> float:
    began = time.perf_counter()
    context.decode(ids, start)
    return time.perf_counter() - began


def _identity(path: Path) -> list[Any]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _read(file: Path) -> dict[str, Any]:
    """The probes kept (nothing, if the file is missing or not ours)."""
    try:
        if file.stat().st_size > 1 << 20:
            return {}
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(file: Path, probes: dict[str, Any]) -> None:
    """Keep the newest ``MAX_PROBES`` probes, written whole at once (best effort)."""
    kept = dict(list(probes.items())[-MAX_PROBES:])
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".probes-", dir=file.parent)
    except OSError as error:
        log.debug("the attention probe was not kept: %s", error)
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(name, file)
    except OSError as error:
        log.debug("the attention probe was not kept: %s", error)
        with contextlib.suppress(OSError):
            os.unlink(name)
