"""A GGUF file's metadata, read before llama.cpp reads it: the values llama.cpp asserts on (an
abort of the whole process) are checked first, so a broken or hostile file is a
``ModelLoadError``. Pure Python over a read-only memory map; nothing is decoded but the keys'
scalar values (arrays are skipped, a vocabulary's strings by their lengths).

What is checked is what was seen to abort the pinned llama.cpp (a sweep of every number of
SmolLM2's and a projector's metadata, 2026-12-07): a layer count outside ``1..MAX_LAYERS``
(llama.cpp's ``LLAMA_MAX_LAYERS``), an epsilon that is negative or not finite
(``GGML_ASSERT(eps >= 0.0f)`` at the first decode), and in a projector a head count that does
not divide its width, an image smaller than one patch, a patch size or width that is not its
patch embedding's (a convolution's kernel), or a LLaVA-like projector's width or image that its
position table does not hold. A file this reader cannot follow (an unknown value type, a length
past its end) is left to llama.cpp, which refuses it itself.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import BinaryIO

from llmsession.errors import ModelLoadError
from llmsession.files import opened_regular

GGUF_MAGIC = b"GGUF"
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_KEYS = 1 << 20  # metadata entries a file may hold here (past it: left to llama.cpp)
MAX_NAME = 1 << 16  # bytes of a key's or a tensor's name kept (a longer one is skipped)
MAX_VALUE = 256  # bytes of a string value kept (an architecture's name; a template is skipped)
MAX_ITEMS = 1 << 24  # strings of an array walked (a vocabulary has at most ~1M)
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS
SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING, ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
Value = int | float | bool | str | tuple[int, ...]
ATTENTION = ("v.blk.0.attn_q.weight", "v.blk.0.attn_qkv.weight")  # a vision transformer's
SHAPES = ("v.patch_embd.weight", "v.position_embd.weight", "v.class_embd", *ATTENTION)  # (read)
LLAVA = ("mlp", "mlp_norm", "ldp", "ldpv2")  # projectors whose patches index their position table


class _Unreadable(Exception):
    """The file goes where this reader does not follow (llama.cpp decides)."""


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def take(self, form: str) -> int | float | bool:
        size = struct.calcsize(form)
        if self.at + size > len(self.data):
            raise _Unreadable
        (value,) = struct.unpack_from(form, self.data, self.at)
        self.at += size
        return value  # type: ignore[no-any-return]

    def skip(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise _Unreadable
        self.at += size

    def string(self, most: int) -> str | None:
        """A string, kept if it is at most ``most`` bytes (else None: skipped)."""
        size = int(self.take("<Q"))
        start = self.at
        self.skip(size)
        return bytes(self.data[start : self.at]).decode("utf-8", "replace") if size <= most else None


def metadata(path: Path) -> dict[str, Value] | None:
    """The scalar values of ``path``'s metadata by key (strings of at most 256 bytes), and
    ``"tensor NAME"`` the shapes of the tensors checked; None if the file is not one this
    reader follows."""
    try:
        f, _ = opened_regular(path)
        with f:
            return _mapped(f)
    except OSError:
        return None


def _mapped(f: BinaryIO) -> dict[str, Value] | None:
    try:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(_Cursor(data))
    except (OSError, ValueError, _Unreadable):  # (an empty file cannot be mapped: ValueError)
        return None


def _read(cursor: _Cursor) -> dict[str, Value] | None:
    if bytes(cursor.data[:4]) != GGUF_MAGIC:
        return None
    cursor.skip(4)
    if cursor.take("<I") not in (2, 3):
        return None
    tensors, count = int(cursor.take("<Q")), int(cursor.take("<Q"))
    if count > MAX_KEYS or tensors > MAX_KEYS:
        return None
    values: dict[str, Value] = {}
    for _ in range(count):
        key = cursor.string(MAX_NAME)
        kind = int(cursor.take("<I"))
        value = _value(cursor, kind)
        if key is not None and value is not None:
            values[key] = value
    for _ in range(tensors):  # (the shapes of those checked: "tensor NAME")
        name, dims = cursor.string(MAX_NAME), int(cursor.take("<I"))
        if dims > 8:
            raise _Unreadable
        shape = tuple(int(cursor.take("<Q")) for _ in range(dims))
        cursor.skip(12)  # (its type and offset)
        if name in SHAPES:
            values[f"tensor {name}"] = shape
    return values


def _value(cursor: _Cursor, kind: int) -> Value | None:
    if kind in SCALARS:
        return cursor.take(SCALARS[kind])
    if kind == STRING:
        return cursor.string(MAX_VALUE)
    if kind != ARRAY:
        raise _Unreadable
    item, count = int(cursor.take("<I")), int(cursor.take("<Q"))
    if item in SCALARS:
        cursor.skip(count * struct.calcsize(SCALARS[item]))
    elif item == STRING:  # (a vocabulary: each string's length read, its bytes skipped)
        if count > MAX_ITEMS:
            raise _Unreadable
        data, at, end, length = cursor.data, cursor.at, len(cursor.data), _LENGTH.unpack_from
        for _ in range(count):
            if at + 8 > end:
                raise _Unreadable
            at += 8 + length(data, at)[0]
        cursor.skip(at - cursor.at)
    else:
        raise _Unreadable  # (arrays of arrays: llama.cpp reads none of those it asserts on)
    return ()  # (an array: known to be there, its items not read)


def check_gguf_file(path: Path, kind: str = "model") -> None:
    """Clear errors for what llama.cpp would only log (missing, unreadable, not a GGUF) or abort
    the process on (a value of the metadata: see the module), read from the file it opened."""
    try:
        f, _ = opened_regular(path)  # (a FIFO would block here, and in llama.cpp's open)
        with f:
            magic = f.read(4)
            values = _mapped(f) if magic == GGUF_MAGIC else None
    except FileNotFoundError:
        raise ModelLoadError(f"{kind} file not found: {path}") from None
    except OSError as error:
        raise ModelLoadError(f"cannot read {kind} file {path}: {error.strerror or error}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r})")
    problem = None if values is None else _model_problem(values) or _projector_problem(values)
    if problem is not None:
        raise ModelLoadError(f"{kind} file {path}: {problem}: the file is broken or was edited")


def _number(values: dict[str, Value], key: str) -> int | None:
    value = values.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _model_problem(values: dict[str, Value]) -> str | None:
    """A norm's epsilon, the layers, the experts: what ``llama_model::load_hparams`` asserts."""
    for key, value in values.items():
        if (
            key.endswith("epsilon")
            and isinstance(value, float | int)
            and not (math.isfinite(value) and value >= 0)
        ):
            return f"{key} is {value!r} (a norm's epsilon is finite and not negative)"
    arch = values.get("general.architecture")
    if arch == "clip" or f"{arch}.block_count" not in values:
        return None
    layers, nextn = _number(values, f"{arch}.block_count"), _number(values, f"{arch}.nextn_predict_layers")
    if layers is None or not 1 <= layers <= MAX_LAYERS:
        return (
            f"{arch}.block_count is {values[f'{arch}.block_count']!r} (a model has 1 to {MAX_LAYERS} layers)"
        )
    if nextn is not None and not 0 <= nextn <= layers:
        return f"{arch}.nextn_predict_layers {nextn} is more than its {layers} layers"
    return _experts_problem(values, str(arch))


def _experts_problem(values: dict[str, Value], arch: str) -> str | None:
    experts, used = _number(values, f"{arch}.expert_count"), _number(values, f"{arch}.expert_used_count")
    groups, groups_used = (
        _number(values, f"{arch}.{k}") for k in ("expert_group_count", "expert_group_used_count")
    )
    if experts is None or used is None or groups is None or groups_used is None:
        return None  # (an array per layer, or an odd type: llama.cpp's to judge)
    if arch in ("hunyuan_vl", "hunyuan-dense") and experts <= 1:
        experts = used = 0  # (as llama.cpp reads them)
    said = f"{experts} experts, {used} used, {groups} groups of which {groups_used} used"
    if not 0 <= used <= experts <= MAX_EXPERTS or groups < 0:
        return f"{arch}: {said} (at most {MAX_EXPERTS} experts, no more used than there are)"
    if experts == 0:
        return None if used == 0 and groups == 0 else f"{arch}: {said} (none used without experts)"
    if used == 0 or groups >= experts:
        return f"{arch}: {said} (some used, fewer groups than experts)"
    if groups > 1 and (experts % groups or not 0 < groups_used < groups):
        return f"{arch}: {said} (groups that divide the experts, some of them used)"
    return None


def _projector_problem(values: dict[str, Value]) -> str | None:
    """A vision transformer's heads, patches and positions, as libmtmd's graph reshapes them
    (checked only where the file has such a transformer's attention: other encoders, a
    ConvNeXt's or a MobileNet's, are left to llama.cpp)."""
    if not any(f"tensor {name}" in values for name in ATTENTION):
        return None
    heads, width = values.get("clip.vision.attention.head_count"), values.get("clip.vision.embedding_length")
    image, patch = values.get("clip.vision.image_size"), values.get("clip.vision.patch_size")
    kernel = values.get("tensor v.patch_embd.weight")  # (a convolution's: width, height, in, out)
    table = values.get("tensor v.position_embd.weight")
    if not (
        isinstance(heads, int)
        and isinstance(width, int)
        and isinstance(image, int)
        and isinstance(patch, int)
    ):
        return None
    head = values.get("clip.vision.attention.head_dim")  # (given, it is the heads' size instead)
    if heads <= 0 or (width % heads and not (isinstance(head, int) and head > 0)):
        return f"clip.vision.attention.head_count {heads} does not divide its embedding length {width}"
    if patch <= 0 or 0 < image < patch:  # (an image size of 0: a dynamic one)
        return f"clip.vision.image_size {image} is smaller than one patch ({patch})"
    if values.get("clip.projector_type") not in LLAVA:  # (other graphs may set their own sizes)
        return None
    if image < patch:  # (a LLaVA-like graph's image is fixed: 0 aborted, as any less than a patch)
        return f"clip.vision.image_size {image} is smaller than one patch ({patch})"
    if isinstance(kernel, tuple) and len(kernel) == 4 and kernel[:2] != (patch, patch):
        return f"clip.vision.patch_size {patch} is not its patch embedding's {kernel[0]}x{kernel[1]}"
    if isinstance(kernel, tuple) and len(kernel) == 4 and kernel[3] != width:
        return f"clip.vision.embedding_length {width} is not its patch embedding's {kernel[3]}"
    if isinstance(table, tuple) and len(table) == 2:
        if table[0] != width:
            return f"clip.vision.embedding_length {width} is not its position table's {table[0]}"
        positions = (image // patch) ** 2 + ("tensor v.class_embd" in values)
        if positions > table[1]:
            return f"clip.vision.image_size {image} makes {positions} positions, past its {table[1]}"
    return None
