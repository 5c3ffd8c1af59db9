"""What a sequence's saved state (``llama_state_seq_get_data_ext``) may hold, checked before
llama.cpp reads one: its loaders abort the process on some malformed input (a recurrent state of
two cells fails an assertion), and a state can come from a file anyone can rewrite and re-hash.

Pure Python over bytes (no native call): ``layout`` says which parts the pinned llama.cpp writes
for a model, in order, and ``refusal`` walks a blob through them, every count bounded before it
is used and every read inside the blob. The format it mirrors (``src/`` of the pinned build):

- the header (llama-context.cpp ``state_seq_get_data``): u32 magic 0xaf143cd8, i32 sequence id;
- a KV part (llama-kv-cache.cpp ``state_write``/``state_write_meta``/``state_write_data``): u32
  n_stream, then per stream u32 cell_count and, where not 0, each cell's i32 pos, u32 n_seq_id
  (1 for one sequence: ``state_read_meta`` refuses any other), a 12-byte ext on M-RoPE models,
  its i32 sequence id; then u32 v_trans, u32 n_layer, per layer K's i32 type, u64 row size and
  cell_count rows, then V's alike (v_trans: i32 type, u32 element size, u32 n_embd_v_gqa and
  that many runs of cell_count elements); MLA caches have no V;
- an iSWA memory (llama-kv-cache-iswa.cpp) writes its full part, then its sliding one: only the
  cells the window still sees (``is_masked_swa``), so a tail of the positions;
- a recurrent part (llama-memory-recurrent.cpp ``state_write``): u32 cell_count (a sequence has
  one cell, holding its last position), each cell's i32 pos and u32 n_seq_id (0 for one
  sequence: ``state_read_meta`` demands it), u32 s_trans (0), u32 n_layer (the model's), then
  R's and S's (i32 type, u64 row size, cell_count rows) for each layer that has them;
- a hybrid memory (llama-memory-hybrid.cpp) writes its attention part, then its recurrent one;
  with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (a checkpoint) only the parts ``Part.partial``
  marks: an iSWA's sliding part, a hybrid's recurrent one (a plain KV or recurrent memory
  ignores the flag).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer

IO_MAGIC = 0xAF143CD8
MAX_SEQ = 256  # LLAMA_MAX_SEQ
CELL_EXT = 12  # llama_kv_cell_ext: x, y, tok
# The ggml types a cache of this build holds (KV: ``options.KV_TYPES``; recurrent: F32), as
# (elements per block, bytes per block): F32, F16, Q4_0, Q8_0.
TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34)}
MAX_ROW = 1 << 32  # a row of one layer's cell: far below this
CHUNK = 1 << 22  # bytes of values checked at a time (``values``)
RECURRENT = "recurrent state"
# Architectures whose memory writes more than these parts (DSA, MSA, DeepSeek V4 caches, an
# indexer cache, a KV cache shared with another model's): their states are not checked, so refused.
UNCHECKABLE = "this build cannot check its layout, and a file's state is loaded only checked"
UNCHECKED = {
    *("minimax-m3", "glm-dsa", "deepseek32", "glm5-next", "hy_v4", "dots3note", "deepseek4"),
    *("dflash", "qwen4exp", "gemma4-assistant"),
}


@dataclass(frozen=True)
class Part:
    """One part of a memory's state. ``layers``: how many layers it writes (KV) or holds state
    for (recurrent), None where the model's shape does not say (then 1 up to the model's layer
    count; llama.cpp compares the exact count itself, without aborting). ``partial``: written
    for a checkpoint too. ``ggml_type``: what every layer's rows are. KV only: ``streams`` it
    writes, ``sliding`` (a window's tail), ``values`` (a V cache: not MLA), ``cell_ext``
    (M-RoPE). Recurrent only: ``rows``, the size of each layer's R row, then each one's S row,
    as the context's own empty state says (the model's shape does not)."""

    kind: Literal["kv", "recurrent"]
    layers: int | None
    partial: bool = True
    ggml_type: int = 0  # its rows' type: the context's KV type, F32 (0) for recurrent states
    rows: tuple[int, ...] | None = None  # recurrent: each R, then each S row's size (``learned``)
    streams: int = 1
    sliding: bool = False
    values: bool = True
    cell_ext: bool = False


@dataclass(frozen=True)
class StateLayout:
    """The parts of one sequence's state, in order; ``cells``: the most a sequence of the
    context holds; ``n_layer``: the model's layer count."""

    parts: tuple[Part, ...]
    cells: int
    n_layer: int

    def partial(self) -> StateLayout:
        """The layout of a checkpoint (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``)."""
        return replace(self, parts=tuple(part for part in self.parts if part.partial))


@dataclass(frozen=True)
class Shape:
    """What the model says of its memory (``llama_model_*``, its GGUF metadata)."""

    arch: str
    n_layer: int
    n_swa: int
    recurrent: bool
    hybrid: bool
    mla: bool = False
    mrope: bool = False


def layout(
    shape: Shape, *, cells: int, streams: int, kv_type: int = 1, memory: bool = True
) -> StateLayout | None:
    """The parts the pinned llama.cpp writes for ``shape`` (``llama_model::create_memory``), or
    None for a memory this module cannot check. ``streams``: the KV streams of the context (1
    unless each sequence has cells of its own); ``kv_type``: the ggml type of its K and V cells
    (f16 unless asked otherwise); ``memory`` False: the context has none (an
    embedding model's), so a state is its header alone."""
    if shape.arch in UNCHECKED and memory:
        return None
    kv = Part("kv", None, ggml_type=kv_type, streams=streams, values=not shape.mla, cell_ext=shape.mrope)
    recurrent = Part("recurrent", shape.n_layer if shape.recurrent else None)
    parts: tuple[Part, ...]
    if not memory:
        parts = ()
    elif shape.recurrent:
        parts = (recurrent,)
    elif shape.n_swa > 0:  # iSWA: the full part, then the sliding one (hybrid: then recurrent)
        parts = (replace(kv, partial=False), replace(kv, sliding=True))
        parts += (recurrent,) if shape.hybrid else ()
    elif shape.hybrid:
        parts = (replace(kv, partial=False), recurrent)
    else:
        parts = (replace(kv, layers=shape.n_layer),)
    return StateLayout(parts, cells, shape.n_layer)


def learned(layout: StateLayout, empty: Buffer) -> StateLayout | None:
    """``layout`` with its recurrent parts' row sizes as ``empty``, the state of an empty
    sequence of the context, has them (a recurrent part writes every layer's row sizes, with
    no rows); None if ``empty`` is not an empty state of ``layout``."""
    try:
        with memoryview(empty) as view:
            reader = _Reader(view.cast("B"))
            _walk(reader, layout, 0)
    except (_Refused, TypeError, ValueError, struct.error):
        return None
    rows = iter(reader.rows)
    parts = tuple(
        replace(part, rows=next(rows)) if part.kind == "recurrent" else part for part in layout.parts
    )
    return replace(layout, parts=parts)


class _Refused(Exception):
    """Why a blob is refused (``refusal`` returns its text)."""


def refusal(
    blob: Buffer, layout: StateLayout, positions: int | None = None, *, values: bool = False
) -> str | None:
    """Why ``blob`` is not a state this build could have written of one sequence holding
    ``positions`` positions (None: any count the context holds) in ``layout``; None if it is.
    ``values``: every K, V and recurrent value (a quantized block's scale) must be finite too,
    as a decode writes them: a NaN or infinity there (a file rewritten and re-hashed) would make
    every later reply of the session garbage, silently. Never raises; its time is linear in the
    blob's cells and layers (and, with ``values``, its bytes), never in a count it read."""
    try:
        with memoryview(blob) as view:
            _walk(_Reader(view.cast("B"), values), layout, positions)
    except _Refused as why:
        return str(why)
    except (TypeError, ValueError, struct.error) as error:  # (a buffer of an odd shape)
        return f"unreadable ({error})"
    return None


class _Reader:
    """Reads little-endian fields in order, never past the end (``_Refused``)."""

    def __init__(self, view: memoryview, values: bool = False) -> None:
        self.view, self.at, self.values = view, 0, values
        self.rows: list[tuple[int, ...]] = []  # each recurrent part's row sizes, as read

    @property
    def left(self) -> int:
        return len(self.view) - self.at

    def skip(self, size: int, what: str) -> int:
        """Step over ``size`` bytes; where they start."""
        if size > self.left:
            raise _Refused(f"the state ends inside {what}")
        start, self.at = self.at, self.at + size
        return start

    def field(self, code: str, what: str) -> int:
        value: int = struct.unpack_from("<" + code, self.view, self.skip(struct.calcsize(code), what))[0]
        return value

    def cells(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        return np.frombuffer(self.view, dtype, count, self.skip(dtype.itemsize * count, what))

    def data(self, kind: int, size: int, what: str) -> None:
        """Step over ``size`` bytes of values of ggml type ``kind``; with ``values``, refuse
        any that is not finite (of a quantized block, its f16 scale)."""
        start = self.skip(size, what)
        if not (self.values and size):
            return
        block = TYPES[kind][1]
        bits, exponent = (np.dtype("<u4"), 0x7F800000) if kind == 0 else (np.dtype("<u2"), 0x7C00)
        for at in range(start, start + size, CHUNK - CHUNK % block):  # (bounded temporaries)
            chunk = np.frombuffer(self.view, np.uint8, min(CHUNK - CHUNK % block, start + size - at), at)
            if block > 4:  # (Q4_0, Q8_0: each block starts with its f16 scale)
                chunk = np.ascontiguousarray(chunk.reshape(-1, block)[:, :2])
            if np.any(chunk.view(bits) & exponent == exponent):
                raise _Refused(f"{what} holds a value that is not finite (NaN or infinity)")


def _walk(reader: _Reader, layout: StateLayout, positions: int | None) -> None:
    if reader.field("I", "the header") != IO_MAGIC:
        raise _Refused("it does not start with a sequence state's magic")
    seq = reader.field("i", "the header")
    if not 0 <= seq < MAX_SEQ:
        raise _Refused(f"its sequence id {seq} is out of range")
    held = [
        (_kv_part if part.kind == "kv" else _recurrent_part)(reader, part, layout, seq)
        for part in layout.parts
    ]
    if reader.left:
        raise _Refused(f"{reader.left} bytes follow the last part")
    _agree({n for n in held if n is not None}, layout, positions)


def _agree(held: set[int], layout: StateLayout, positions: int | None) -> None:
    """The parts hold one sequence of positions: each part says how many (a full KV part holds
    0..n-1, a sliding or recurrent one ends at n-1; an empty sliding part says nothing: its
    window was cut away)."""
    if len(held) > 1:
        raise _Refused(f"its parts disagree on the positions the sequence holds ({sorted(held)})")
    n = next(iter(held), positions or 0)
    if positions is not None and n != positions:
        raise _Refused(f"it holds {n} positions, not {positions}")
    if n > layout.cells:
        raise _Refused(f"it holds {n} positions, more than the context's {layout.cells}")


def _kv_part(reader: _Reader, part: Part, layout: StateLayout, seq: int) -> int | None:
    """Walk a KV part; how many positions it holds (None: an empty sliding part says nothing).
    A sequence's cells are in one stream, its own (or the one all share)."""
    streams = reader.field("I", "a KV part")
    if streams != part.streams:
        raise _Refused(f"its KV part has {streams} streams, not {part.streams}")
    held: int | None = None if part.sliding else 0
    filled = False
    for _ in range(streams):
        count = reader.field("I", "a KV part")
        if not count:
            continue
        if filled:
            raise _Refused("its KV part holds cells in two streams")
        if count > layout.cells:
            raise _Refused(f"its KV part holds {count} cells, more than the context's {layout.cells}")
        filled, held = True, _kv_cells(reader, part, count, seq)
        _kv_data(reader, part, layout, count)
    return held


def _kv_cells(reader: _Reader, part: Part, count: int, seq: int) -> int:
    """Check the cells' meta: each of the one sequence, their positions one run (0..n-1 in a
    full part, a tail in a sliding one), in any order (a shared pool fills freed cells first);
    return n."""
    ext = [("ext", f"V{CELL_EXT}")] if part.cell_ext else []
    cells = reader.cells(
        np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), *ext, ("seq", "<i4")]), count, "the cells"
    )
    if np.any(cells["n_seq_id"] != 1) or np.any(cells["seq"] != seq):
        raise _Refused("a KV cell is not of exactly the state's one sequence")
    pos = np.sort(cells["pos"].astype(np.int64))
    if pos[0] < 0 or np.any(np.diff(pos) != 1):
        raise _Refused("the KV cells' positions are not one run of distinct positions")
    if not part.sliding and pos[0] != 0:
        raise _Refused("the full KV part does not start at position 0")
    return int(pos[-1]) + 1


def _kv_data(reader: _Reader, part: Part, layout: StateLayout, count: int) -> None:
    """Walk the K rows of each layer, then the V rows (or, transposed, V's columns)."""
    v_trans, n_layer = reader.field("I", "a KV part's data"), reader.field("I", "a KV part's data")
    if v_trans > 1:
        raise _Refused(f"its V transposition flag is {v_trans}")
    if not 1 <= n_layer <= layout.n_layer or part.layers not in (None, n_layer):
        raise _Refused(f"its KV part has {n_layer} layers")
    for _ in range(n_layer):
        _rows(reader, part, count, "K")
    for _ in range(n_layer if part.values else 0):
        (_columns if v_trans else _rows)(reader, part, count, "V")


def _rows(reader: _Reader, part: Part, count: int, what: str) -> int:
    """A layer's type, row size and ``count`` rows; the row size. A row may be empty: LFM2's
    short convolutions have no S state, and a layer without attention (DeciLM's) writes K and V
    rows of 0 bytes (llama.cpp's reader checks each size against its own)."""
    kind, row = reader.field("i", what), reader.field("Q", what)
    if kind != part.ggml_type or kind not in TYPES:
        raise _Refused(f"a layer's {what} is of ggml type {kind}, not {part.ggml_type}")
    if not 0 <= row <= MAX_ROW or row % TYPES[kind][1]:
        raise _Refused(f"a layer's {what} rows are {row} bytes, not a size of ggml type {kind}")
    reader.data(kind, row * count, f"a layer's {what}")
    return row


def _columns(reader: _Reader, part: Part, count: int, what: str) -> int:
    """A transposed V layer: type, element size, embedding size and its columns of ``count``."""
    kind, size, n_embd = reader.field("i", what), reader.field("I", what), reader.field("I", what)
    if (
        kind != part.ggml_type or TYPES.get(kind) != (1, size) or not 0 <= n_embd <= MAX_ROW
    ):  # (0: no attention)
        raise _Refused(f"a transposed {what} layer is of type {kind}, {size}-byte elements, {n_embd} wide")
    reader.data(kind, n_embd * count * size, f"a layer's {what}")
    return n_embd


def _recurrent_part(reader: _Reader, part: Part, layout: StateLayout, seq: int) -> int:
    """Walk a recurrent part (the last one of any layout: its layers run to the blob's end); how
    many positions it holds (its one cell's position + 1)."""
    count = reader.field("I", "a recurrent part")
    if count > 1:
        raise _Refused(f"its recurrent part holds {count} cells; a sequence has one")
    held = 0
    if count:
        pos, n_seq_id = reader.field("i", "a recurrent cell"), reader.field("I", "a recurrent cell")
        if n_seq_id != 0 or pos < 0:
            raise _Refused(f"its recurrent cell has position {pos}, {n_seq_id} sequence ids (not 0)")
        held = pos + 1
    s_trans, n_layer = reader.field("I", "a recurrent part"), reader.field("I", "a recurrent part")
    if s_trans != 0 or n_layer != layout.n_layer:
        raise _Refused(f"its recurrent part has {n_layer} layers, S transposition {s_trans}")
    rows: list[int] = []  # R of each layer with state, then S: as the context's empty state has them
    while reader.left and len(rows) < 2 * n_layer:
        rows.append(_rows(reader, part, count, RECURRENT))
    half = len(rows) // 2
    if len(rows) % 2 or not rows or part.layers not in (None, half) or part.rows not in (None, tuple(rows)):
        raise _Refused(f"its recurrent part has {len(rows)} rows of state, of sizes {sorted({*rows})}")
    reader.rows.append(tuple(rows))
    return held


def most_bytes(layout: StateLayout | None, buffers: int) -> int | None:
    """The most bytes a state of one sequence in ``layout`` can have, in a context whose cells'
    buffers (KV cells, recurrent states: ``reports.cell_bytes``) take ``buffers``: at most all
    their values, and each part's meta (a cell's position, sequence and M-RoPE ext; a layer's
    type and row size); None where that is not known (an unchecked layout, buffers unreported)."""
    if layout is None or (layout.parts and not buffers):
        return None
    meta = sum(
        64 + 4 * part.streams + (8 + 4 + CELL_EXT + 4) * layout.cells + 32 * layout.n_layer
        for part in layout.parts
    )
    return 8 + buffers + meta
