"""The one place tests look inside a session's memory (so an engine change touches one file)."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from llmsession import Model, Session, Stream
from llmsession.api.model import local_model
from llmsession.engine.prefix import Item
from llmsession.engine.residency import State
from llmsession.native.context import NativeContext
from llmsession.native.llama import NativeModel, bindings
from llmsession.remote.isolated import IsolatedModel
from llmsession.remote.process import WorkerProcess
from llmsession.runtime.core import ModelCore
from llmsession.runtime.local import LocalModel
from llmsession.text.splice import ReplyTokens


def local(model: Any) -> LocalModel:
    """The model in this process behind a public ``Model`` (a ``LocalModel`` as it is)."""
    return model if isinstance(model, ModelCore) else local_model(model)  # type: ignore[return-value]


def worker(model: Model) -> WorkerProcess:
    """The worker process of a model made with ``isolated=True``."""
    backend = model._backend
    assert isinstance(backend, IsolatedModel)
    return backend.worker


def settled(session: Session) -> Session:
    """The session once its anticipatory prefill (if any) has finished: its memory holds still."""
    if session._ahead is not None:
        session._ahead.wait()
    return session


def without_look_ahead(session: Session) -> Session:
    """The session, decoding nothing ahead after its replies (an anticipatory prefill would go
    through the batcher beside what a test counts there)."""
    session.looks_ahead = False  # type: ignore[attr-defined]
    return session


def settle_others(session: Session) -> None:
    """Every other session of ``session``'s model settled: no anticipatory prefill of theirs
    left to decode into the shared context after what comes next (the context's logits are its
    latest decode's); ``session``'s own is left as it is (an exchange may stop it)."""
    model = session.model
    for other in list(model.sessions):
        if isinstance(other, Session) and other is not session:
            settled(other)


def decoded_ahead(session: Session) -> int:
    """How many positions at the end of the record the latest anticipatory prefill decoded."""
    ahead = settled(session)._ahead
    return ahead.decoded if ahead is not None else 0


def record(session: Session) -> tuple[Item, ...]:
    """The items the session's KV state holds, position by position (live or parked)."""
    return settled(session).lease.cache.items


def donor_records(session: Session) -> list[tuple[Item, ...]]:
    """The records of the model's other sessions that an empty ``session`` may start from (they
    share prefixes and live in its context's pool), each settled."""
    mine = session.lease
    others = [s for s in list(session.model.sessions) if s is not session and s.share_prefix]
    return [record(s) for s in others if s.lease.shared_context is mine.shared_context and not s.closed]


def started(stream: Stream) -> bool:
    """Whether a stream's exchange has begun (it holds its session's sequence until it ends)."""
    return inspect.getgeneratorstate(stream._steps) != inspect.GEN_CREATED


def own_replies(session: Session) -> ReplyTokens:
    """The replies a session's prompts splice first (its own, as generated)."""
    return session.replies


def splice_record(session: Session) -> ReplyTokens:
    """Every reply a session's prompts may splice, in one record a fresh session kept apart can
    be given to tokenize its transcript alike: its own first, then (if it shares) the model's."""
    merged, own = ReplyTokens(capacity=1 << 20), dict(session.replies.items())
    shared = session.model.replies.items() if session.share_prefix else []
    for text, splits in [*((t, s) for t, s in shared if t not in own), *own.items()]:
        for tokens in splits:  # (a text its own holds: only its own splits, as the prompt reads them)
            merged.remember(text, tokens)
    return merged


def tokenize_like(fresh: Session, like: Session) -> None:
    """Let a fresh reference session splice the replies ``like``'s prompts splice."""
    fresh.replies = splice_record(like)


def placement(session: Session) -> tuple[str, int]:
    """Where the session's state is: (live / parked / cold, its sequence while live)."""
    lease = settled(session).lease
    entry = lease.shared_context.residency.entry(lease.key)
    return entry.state.value, entry.seq


def live_context(session: Session) -> NativeContext | None:
    """The shared context holding the session's sequence, None unless it is live."""
    lease = settled(session).lease
    if lease.shared_context.residency.entry(lease.key).state is not State.LIVE:
        return None
    return lease.shared_context.context


def last_logits(session: Session) -> np.ndarray:
    """The logits of the session's latest decode (nothing else may have decoded since)."""
    context = live_context(session)
    assert context is not None, "the session is not live"
    return read_logits(session.model.native.n_vocab, context)


def read_logits(n_vocab: int, context: NativeContext) -> np.ndarray:
    _, ffi = bindings()
    return np.frombuffer(ffi.buffer(raw_logits(context), 4 * n_vocab), dtype=np.float32).copy()


def raw_logits(context: NativeContext) -> Any:
    """llama.cpp's pointer to the last decode's last logits (tests read them; the library never)."""
    return bindings()[0].llama_get_logits_ith(context.ptr, -1)


def meta(native: NativeModel, key: str) -> str | None:
    """A GGUF metadata value of a loaded model, as text."""
    lib, ffi = bindings()
    buf = ffi.new("char[4096]")
    n = lib.llama_model_meta_val_str(native.ptr, key.encode(), buf, len(buf))
    return None if n < 0 else ffi.string(buf).decode("utf-8", "replace")


def state(session: Session) -> bytes:
    """A copy of the session's KV state (restored to a sequence first if it was parked)."""
    blob = session.model.engine.state(settled(session).lease)
    assert blob is not None, "the session holds no state"
    return bytes(blob)


def logits_after(session: Session, tokens: list[int]) -> np.ndarray:
    """The logits after decoding ``tokens`` past the session's state, in its own sequence (they
    are removed again; a recurrent state that cannot rewind leaves the session cold)."""
    import threading

    held = len(record(session))
    with session.model.engine.seat(session.lease, held + len(tokens), threading.Event()) as seat:
        seat.context.decode(tokens, held, seq=seat.seq)
        logits = read_logits(session.model.native.n_vocab, seat.context)
        if not seat.context.seq_rm(held, seat.seq):
            seat.clear()
    return logits


def reported_buffers(model: Model) -> int:
    """What llama.cpp itself reported making for a model's open contexts and projector (their
    compute buffers; an embedding context's cells), without the output buffers' bound."""
    children = local(model).native.children()
    return sum(getattr(child, "reported", child.buffers) for child in children if not child.closed)


def leases(model: Model) -> int:
    """How many sessions' places the engine holds (in every layout's context), as they are:
    ``Model.memory`` would free the collected ones' first."""
    return sum(len(home.leases) for home in local(model).engine._shared_contexts.values())


def shared_contexts(model: Model) -> list[NativeContext]:
    """The shared contexts a model's engine has made (none is made by asking), read on any thread."""
    engine = local(model).engine
    while True:  # (a sliding-window layout's goes and comes under the engine's gate)
        try:
            homes = list(engine._shared_contexts.values())
            break
        except RuntimeError:
            continue
    return [home._context for home in homes if home._context is not None]
