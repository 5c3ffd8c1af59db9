"""Loading a model: its settings checked (threads, memory budget, flash attention) and the native
model and projector opened, neither left open on an error."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmsession.config import MemoryConfig
from llmsession.engine.budget import CELLS_QUANTUM, MemoryPlan, own_cells, uses_own_cells
from llmsession.engine.sizing import Sizing, size_kv
from llmsession.errors import NativeError, TemplateError, UnsupportedFeatureError
from llmsession.files import read_regular
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel
from llmsession.native.machine import default_threads, usable_cores
from llmsession.native.projector import Projector
from llmsession.native.shape import architecture, kv_bytes_per_cell
from llmsession.text.renderer import Renderer, choose_renderer, is_jinja

log = logging.getLogger("llmsession")
MAX_TEMPLATE_BYTES = 1 << 24  # a chat template file, at most (the largest known are under 100 KB)


def choose_flash_attention(asked: bool | None, kv_type: str, gpu_layers: int) -> bool | None:
    """Flash attention as asked; by default, on the CPU with f16 cells, off until the model's
    probe chose (``probes_attention``): which is faster depends on the CPU and the depth
    (``engine.attention``). A quantized V cache needs it, and with layers offloaded llama.cpp
    chooses (AUTO). Off, a reply depends slightly on where its session's cells lie in the shared
    cache (the kernels' sums change with the placement): rounding noise, which the tests measure
    and tolerate as they do a batch split's. ``llmsession bench prefill`` measures both against
    llama-bench. (``asked`` is checked by ``ModelConfig``.)"""
    return False if probes_attention(asked, kv_type, gpu_layers) else asked


def probes_attention(asked: bool | None, kv_type: str, gpu_layers: int) -> bool:
    """Whether flash attention is ours to choose by measuring (``runtime.attention``)."""
    return asked is None and kv_type == "f16" and gpu_layers == 0


def session_positions(memory: MemoryPlan) -> int:
    """The most positions one live session holds under ``memory`` (its own cells, or the pool)."""
    if memory.kv_layout == "per_session" and memory.max_live_sessions > 1:
        return own_cells(memory.kv_tokens, memory.max_live_sessions)
    return memory.kv_tokens


def check_cells(native: NativeModel, kv_type: str = "f16", flash_attention: bool | None = None) -> None:
    """Quantized cells this model cannot hold, refused at load (ValueError) rather than by every
    exchange. An encoder-decoder model's decoder attends with a position bias, which takes the
    path without flash attention over a V cache laid out for it: llama.cpp would copy quantized
    blocks as single values, past its buffers. Whatever else llama.cpp refuses (a head size not
    a multiple of the quantized block, a model that forbids flash attention) shows in a small
    context made now."""
    if kv_type == "f16":
        return
    if native.has_encoder:
        raise ValueError(f"kv_type={kv_type!r}: an encoder-decoder model's cells must be f16")
    try:
        NativeContext(
            native, n_ctx=256, n_batch=32, threads=1, flash_attention=flash_attention, kv_type=kv_type
        ).close()
    except NativeError as error:
        raise ValueError(
            f"kv_type={kv_type!r}: llama.cpp cannot hold this model's cells in that type ({error})"
        ) from None


def memory_plan(memory: MemoryConfig) -> MemoryPlan:
    """The engine's plan for a checked ``MemoryConfig``. ``kv_tokens`` None is chosen once the
    model is loaded (``sized``): meanwhile the plan holds the least it could be."""
    kv_tokens = memory.kv_tokens
    return MemoryPlan(
        kv_tokens=CELLS_QUANTUM * memory.max_live_sessions if kv_tokens is None else kv_tokens,
        max_live_sessions=memory.max_live_sessions,
        kv_layout=memory.kv_layout,
        host_cache_bytes=memory.host_cache_bytes,
        disk_cache_dir=memory.disk_cache_dir,
        batch_size=memory.batch_size,
        checkpoints=memory.checkpoints,
    )


def available_memory(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The bytes of memory this process may still take: the kernel's MemAvailable, or less
    where this process's memory cgroup (v2, or v1's memory controller) leaves less under its
    limit (its reclaimable page cache counted as free, as MemAvailable counts it); None where
    nothing can be read."""
    found: list[int] = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    left = _cgroup_left(proc, cgroups)
    if left is not None:
        found.append(left)
    return min(found) if found else None


# Per cgroup version: the limit, the usage, and the reclaimable page cache's key in memory.stat.
_CGROUP_V2_FILES = ("memory.max", "memory.current", "inactive_file")
_CGROUP_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _cgroup_left(proc: Path, cgroups: Path) -> int | None:
    """What this process's memory cgroup leaves under its limit, or None (no limit, unknown)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, where = [*line.split(":", 2), "", ""][:3]
        if controllers == "":  # v2: one hierarchy
            root, files = cgroups, _CGROUP_V2_FILES
        elif "memory" in controllers.split(","):
            root, files = cgroups / "memory", _CGROUP_V1_FILES
        else:
            continue
        folder = root / where.lstrip("/")  # (its limit, and every enclosing group's, apply)
        lefts = [_left_in(f, *files) for f in [folder, *folder.parents] if f.is_relative_to(root)]
        known = [left for left in lefts if left is not None]
        if known:
            return min(known)
    return None


def _left_in(folder: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        used = int((folder / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # (v1 writes "no limit" as ~2^63)
        return None
    return max(0, int(limit) - used + _reclaimable(folder, cache_key))


def _reclaimable(folder: Path, cache_key: str) -> int:
    """The group's reclaimable page cache (0 where memory.stat cannot say)."""
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[0] == cache_key and fields[1].isdigit():
            return int(fields[1])
    return 0


def sized(
    native: NativeModel, config: MemoryPlan, asked: int | None, kv_type: str
) -> tuple[MemoryPlan, Sizing]:
    """The memory config with its KV cells chosen for this model and machine (``engine.sizing``:
    ``asked`` kv_tokens, or None for the default), checked against the memory available and
    against the model's layout (``check_layout``)."""
    sizing = size_kv(
        asked,
        max_live=config.max_live_sessions,
        n_ctx_train=native.n_ctx_train,
        bytes_per_cell=kv_bytes_per_cell(native, kv_type),
        available=available_memory(),
    )
    kv = sizing.kv_tokens
    config = dataclasses.replace(config, kv_tokens=kv, batch_size=min(config.batch_size, kv))
    check_layout(native, config)
    if asked is None:
        level = logging.INFO if sizing.fits else logging.WARNING
        log.log(level, "KV cells: %s (%d in all, about %d MiB)", sizing.note, kv, sizing.kv_bytes >> 20)
    return config, sizing


def check_layout(native: NativeModel, config: MemoryPlan) -> None:
    """Cells of their own too few for llama.cpp (at least ``CELLS_QUANTUM`` a sequence),
    refused at load where this model would use them (ValueError)."""
    if not uses_own_cells(config, full=True, recurrent=native.is_recurrent, encoder=native.has_encoder):
        return
    kv, live = config.kv_tokens, config.max_live_sessions
    if kv // live < CELLS_QUANTUM:
        raise ValueError(
            f"kv_tokens {kv} / max_live_sessions {live} leaves a live session fewer than "
            f"{CELLS_QUANTUM} cells of its own (llama.cpp's least): raise kv_tokens, lower "
            "max_live_sessions, or use kv_layout='shared'"
        )


@dataclass(frozen=True)
class Loaded:
    """What ``load_native`` opened and chose."""

    native: NativeModel
    projector: Projector | None
    memory: MemoryPlan
    sizing: Sizing
    renderer: Renderer

    def close(self) -> None:
        """Free what was opened (a load that fails after ``load_native``)."""
        if self.projector is not None:
            self.projector.close()
        self.native.close()


def checked_threads(threads: int | None) -> int:
    """The decode threads: the caller's (checked by ``ModelConfig``), at most the cores this
    process may use (more is warned of and cut), or a default for this machine."""
    if threads is None:
        return default_threads()
    if threads > (cores := usable_cores()):
        log.warning(
            "threads=%d is more than the %d cores this process may use: llama.cpp's threads wait "
            "for each other at every graph node, so each decode would run hundreds of times "
            "slower; using %d",
            threads,
            cores,
            cores,
        )
        return cores
    return threads


def load_native(
    path: Path,
    mmproj_path: Path | None,
    *,
    gpu_layers: int,
    threads: int,
    rpc_servers: Sequence[str],
    cells: Mapping[str, Any],
    memory: MemoryPlan,
    kv_tokens: int | None,
    use_jinja: bool | None = None,
    chat_template: str | Path | None = None,
) -> Loaded:
    """The model, its projector if given, and its memory sized (``sized``); nothing is left
    open on an error. ``cells``: the KV cells' ``kv_type`` and ``flash_attention``, checked
    against the model (``check_cells``); ``kv_tokens``: as the caller asked (None: chosen);
    ``use_jinja`` and ``chat_template``: how prompts are rendered (``chosen_renderer``)."""
    native = NativeModel(path, gpu_layers=gpu_layers, rpc_servers=rpc_servers)
    try:
        check_cells(native, **cells)
        memory, sizing = sized(native, memory, kv_tokens, cells["kv_type"])
        renderer = chosen_renderer(native, use_jinja, chat_template)
    except BaseException:
        native.close()
        raise
    if native.has_encoder and (mmproj_path is not None or not native.has_decoder):
        native.close()
        raise UnsupportedFeatureError(
            "an encoder-decoder model takes no images here"  # (no file name: an alias may hide it)
            if native.has_decoder
            else "this model is encoder-only: it has no decoder to reply with"
        )
    if mmproj_path is None:
        return Loaded(native, None, memory, sizing, renderer)
    try:
        use_gpu = gpu_layers != 0 and not rpc_servers
        projector = Projector(mmproj_path, native, threads=threads, use_gpu=use_gpu)
        return Loaded(native, projector, memory, sizing, renderer)
    except BaseException:
        native.close()
        raise


def chosen_renderer(
    native: NativeModel, use_jinja: bool | None, chat_template: str | Path | None
) -> Renderer:
    """How this model's prompts are rendered (``text.renderer``); a ``chat_template`` Path is
    read as a template file, and a built-in template named that llama.cpp does not know is a
    TemplateError here rather than at the first chat."""
    if use_jinja is not None and not isinstance(use_jinja, bool):
        raise TypeError(f"use_jinja must be True, False or None, got {use_jinja!r}")
    if isinstance(chat_template, Path):
        path = chat_template
        try:
            chat_template = read_regular(path, MAX_TEMPLATE_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            why = getattr(error, "strerror", None) or error
            raise TemplateError(f"cannot read the chat template file {path}: {why}") from None
    renderer = choose_renderer(
        native.chat_template(),
        architecture(native),
        use_jinja=use_jinja,
        chat_template=chat_template,
        bos_token=native.token_text(native.bos()),
        eos_token=native.token_text(native.eos()),
    )
    named = chat_template is not None and not is_jinja(renderer.template)
    if named and native.apply_template(renderer.template, [("user", "Hi")], True) is None:
        raise TemplateError(f"llama.cpp has no built-in chat template named {renderer.template!r}")
    log.info("prompts: %s", renderer)
    return renderer
