"""Save a session to one file and load it back, in this process or another.

The file (``sessionfile``) holds the transcript and, when it is safe to restore, the session's
KV state with the item record it matches. On load the transcript always comes back; the state is
restored only if everything it depends on is the same (llama.cpp commit, state format, model and
projector digests, context layout) and llama.cpp accepts it with the expected positions, so the
next exchange decodes only the new tail. Otherwise the reason is logged and reported in the next
reply's ``usage.cache_note``, and that exchange decodes from scratch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from llmsession.engine.lease import Lease
from llmsession.engine.sessionfile import SavedSession, write
from llmsession.engine.sessionread import MAX_FILE_BYTES, read
from llmsession.errors import MemoryBudgetError, SessionFileError
from llmsession.native.layout import context_layout, kv_ggml_type
from llmsession.native.llama import build_commit, state_seq_version
from llmsession.options import KV_TYPES
from llmsession.replies import Message
from llmsession.runtime.core import ModelCore
from llmsession.runtime.loading import available_memory
from llmsession.text.images import Image, image_from_part
from llmsession.text.messages import is_image_part
from llmsession.text.splice import ReplyTokens

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("llmsession")
IMAGE_KEY = "llmsession_image"
SETTINGS = ("context_size", "batch_size", "thinking", "swa_full", "share_prefix")


def compat(model: ModelCore, swa_full: bool) -> dict[str, Any]:
    """Everything a saved KV state depends on."""
    return {
        "llama_commit": build_commit(),
        "state_seq_version": state_seq_version(),
        "model_sha256": model.identity(),
        "projector_sha256": model.projector_identity(),
        "context": context_layout(
            swa_full, model.flash_attention, model.kv_type, model.engine.streams(swa_full)
        ),
    }


def save(
    model: ModelCore,
    lease: Lease,
    messages: list[Message],
    settings: dict[str, Any],
    path: str | Path,
    replies: ReplyTokens | None = None,
) -> None:
    """Write a session's transcript and, when restoring it is exact, its KV state and the tokens
    its latest ``replies`` were generated with (the caller holds the session's lock)."""
    images: dict[str, Image] = {}
    encoded = [_encode_message(message, images) for message in messages]
    blobs: dict[str, Buffer] = {f"image:{d}": i.pixels.tobytes() for d, i in images.items()}
    state = model.engine.state(lease) if lease.parkable else None
    record = list(lease.cache.items)
    if state is not None and record:
        blobs["state"] = state
    else:  # nothing cached, or a sliding window past its size (llama.cpp restores those wrong)
        record = []
    write(
        path,
        SavedSession(
            compat=compat(model, settings["swa_full"]),
            settings=settings,
            record=record,
            messages=encoded,
            images={digest: (image.width, image.height) for digest, image in images.items()},
            blobs=blobs,
            replies=_latest(replies, len(record)) if replies is not None and record else [],
        ),
    )


def _latest(replies: ReplyTokens, most: int) -> list[tuple[str, list[int]]]:
    """The latest split of each reply, the most recently used first, at most ``most`` tokens
    in all (a state's positions: its replies are among them)."""
    out, held = [], 0
    for text, splits in reversed(replies.items()):
        held += len(splits[-1])
        if held > most:
            break
        out.append((text, list(splits[-1])))
    return out[::-1]


def remember_replies(model: ModelCore, saved: SavedSession, own: ReplyTokens, shared: bool) -> None:
    """A loaded session's replies, as they were generated, in its ``own`` record (and the
    model's, if it ``shared``): its next prompt splices them as the saved state holds them
    (re-tokenized, a reply the model split otherwise than the tokenizer broke the match there
    and decoded the rest again). Only a split whose pieces spell its text exactly, byte for
    byte (a detokenized text may clean up spaces: `` .`` read as ``.``), of ids of this
    vocabulary: a file's word is not trusted."""
    native = model.native
    for text, tokens in saved.replies:
        if all(t < native.n_vocab for t in tokens):
            spelled = {b"".join(native.piece(t, special=s) for t in tokens) for s in (False, True)}
            if text.encode("utf-8", "surrogatepass") in spelled:
                model.remember_reply(text, tokens, own, shared=shared)


def read_saved(model: ModelCore, path: str | Path) -> tuple[SavedSession, dict[str, Any]]:
    """A saved session and its ``session()`` settings (the file's own). Its state is held only
    if this model could load it, and only up to what this model's cells could write; what the
    file holds must fit in the memory free now (``sessionread``: a file's sizes are its word)."""

    def state_bytes(saved: Mapping[str, Any]) -> int | None:
        here, layout = compat(model, True), saved.get("context")
        cells = layout.get("type_k") if isinstance(layout, dict) else None
        if (
            model.native.has_encoder
            or any(saved.get(k) != here[k] for k in here if k != "context")
            or cells != here["context"]["type_k"]
        ):
            return None  # (another model's, build's or cell type's: read through, never held)
        most = model.engine.most_state_bytes()
        return MAX_FILE_BYTES if most is None else most

    saved = read(path, model.engine.config.kv_tokens, state_bytes=state_bytes, max_bytes=available_memory())
    return saved, {name: saved.settings[name] for name in SETTINGS if name in saved.settings}


def saved_messages(saved: SavedSession) -> list[Message]:
    """The saved transcript, its images back as ``Image``s."""
    return [_decode_message(message, saved) for message in saved.messages]


def restore(
    model: ModelCore,
    lease: Lease,
    saved: SavedSession,
    *,
    swa_full: bool,
    context_size: int,
    path: str | Path,
) -> tuple[int, str]:
    """Load the saved KV state into a new session's cold ``lease`` where it is valid: (how many
    positions were restored, the note its next reply reports)."""
    reason = _mismatch(saved, compat(model, swa_full), context_size, model.native.n_vocab)
    n_swa = model.native.n_swa
    if not reason and 0 < n_swa < len(saved.record):  # (``save`` writes none: ``Lease.parkable``)
        reason = f"a sliding-window state of over {n_swa} positions is not restored right (llama.cpp #25295)"
    try:
        if not reason and not model.engine.adopt(lease, saved.blobs["state"], saved.record):
            reason = "the saved state is not one this build writes for this model"
    except MemoryBudgetError as error:  # other sessions' exchanges hold all the live memory
        reason = f"no live memory was free to load it: {error}"
    restored = 0 if reason else len(saved.record)
    note = f"cache not reused: {reason}" if reason else f"restored {restored} positions from {path}"
    (log.debug if not reason else log.info)("load_session: %s", note)
    return restored, note


def _mismatch(saved: SavedSession, current: dict[str, Any], context_size: int, n_vocab: int) -> str:
    if not saved.record or ("state" not in saved.blobs and "state" not in saved.dropped):
        return "the file holds no KV state"
    for key, value in current.items():
        if saved.compat.get(key) != value:
            was = saved.compat.get(key)
            differs = f"{key} differs (saved {was!r}, now {value!r})"
            return _cell_types(was, value) or _streams(was, value) or differs
    if "state" in saved.dropped:
        return saved.dropped["state"]
    if len(saved.record) >= context_size:
        return f"the state holds {len(saved.record)} positions; the session's context is {context_size}"
    if not all(0 <= item < n_vocab for item in saved.record if isinstance(item, int)):
        return "the saved record holds tokens outside the model's vocabulary"
    return ""


def _cell_types(saved: object, now: object) -> str:
    """Why a saved context layout does not fit when it is the cells' type (``kv_type``), else ""."""
    was = saved.get("type_k") if isinstance(saved, dict) else None
    new = now.get("type_k") if isinstance(now, dict) else None
    if was is None or was == new:
        return ""
    names: dict[object, str] = {kv_ggml_type(name): name for name in KV_TYPES}

    def named(kind: object) -> str:  # (what a file says may be anything JSON holds)
        return names.get(kind, f"ggml type {kind}") if isinstance(kind, int) else f"ggml type {kind!r:.40}"

    return (
        f"its KV cells are {named(was)} and this model's are {named(new)} (kv_type): a state "
        "reloads only into cells of its type"
    )


def _streams(saved: object, now: object) -> str:
    """Why a saved context layout does not fit when it is the sequences' own cells, else ""."""
    was = saved.get("streams", 1) if isinstance(saved, dict) else None
    new = now.get("streams", 1) if isinstance(now, dict) else None
    if was is None or was == new:
        return ""
    return (
        f"it was saved from a context where {was} sequence(s) had cells of their own, and this "
        f"session's has {new} (kv_layout, max_live_sessions, swa_full): a state reloads only into as many"
    )


def _encode_message(message: Mapping[str, Any], images: dict[str, Image]) -> dict[str, Any]:
    content = message.get("content")
    out = dict(message)
    if isinstance(content, list | tuple):
        out["content"] = [_encode_part(part, images) for part in content]
    try:
        json.dumps(out)
    except (TypeError, ValueError) as error:
        raise TypeError(f"cannot save this message: {error}") from None
    return out


def _encode_part(part: Any, images: dict[str, Image]) -> Any:
    if isinstance(part, str) or (isinstance(part, Mapping) and not is_image_part(part)):
        return part
    image = image_from_part(part)  # pixels, whatever the source: the file may move elsewhere
    images[image.digest] = image
    return {"type": "image", IMAGE_KEY: image.digest}


def _decode_message(message: Any, saved: SavedSession) -> Message:
    if not isinstance(message, dict):
        raise SessionFileError("a saved message is not an object")
    content = message.get("content")
    decoded: dict[str, Any] = dict(message)
    if isinstance(content, list):
        decoded["content"] = [_decode_part(part, saved) for part in content]
    return cast(Message, decoded)  # (checked as any transcript is, when it is next rendered)


def _decode_part(part: Any, saved: SavedSession) -> Any:
    """A saved part as it was: text as it is, an image from the pixels the file holds (one
    naming a path or a URL instead is refused: a saved image is always its pixels, and a file
    must not make a session read what it names)."""
    if isinstance(part, dict) and IMAGE_KEY not in part and is_image_part(part):
        raise SessionFileError("a saved image part names a source, not pixels the file holds")
    if not (isinstance(part, dict) and IMAGE_KEY in part):
        return part
    digest = part[IMAGE_KEY]
    if not isinstance(digest, str):
        raise SessionFileError(f"a saved image's name is not a digest: {digest!r:.40}")
    blob, size = saved.blobs.get(f"image:{digest}"), saved.images.get(digest)
    if blob is None or size is None or memoryview(blob).nbytes != size[0] * size[1] * 3:
        raise SessionFileError(f"the saved image {digest!r:.40} is missing or has the wrong size")
    image = Image(np.frombuffer(memoryview(blob), dtype=np.uint8).reshape(size[1], size[0], 3))
    if image.digest != digest:
        raise SessionFileError(f"the saved image {digest!r:.40} does not match its pixels")
    return image
