"""One exchange as its caller sees it: ``Stream`` iterates the reply's snapshots; ``Turn`` is the
state the stream and the session's generator share."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmsession.errors import ModelClosedError
from llmsession.native.cancel import CancelFlag
from llmsession.options import GenerationOptions
from llmsession.replies import FinishReason, Message, Reply, Snapshot

if TYPE_CHECKING:
    from llmsession.engine.prompt import Prompt
    from llmsession.native.constraints import Constraint
    from llmsession.runtime.session import Session


@dataclass
class Turn:
    """One exchange's state, shared by its ``Stream`` and the generator that runs it. The
    generator never holds the ``Stream``, so dropping the stream finishes the exchange at once."""

    user: Message
    prompt: Prompt
    options: GenerationOptions
    constraint: Constraint | None = None
    tokens: list[int] = field(default_factory=list)  # the reply's, as sampled or forced
    cancelled: threading.Event = field(default_factory=CancelFlag)  # (native code reads it too)
    finish: FinishReason = "length"
    reply: Reply | None = None
    done: bool = False
    closed: bool = False  # its model was closed before it finished
    began: float = 0.0  # perf_counter() when it was asked for (its prompt made since)


class Stream:
    """An iterator of ``Snapshot``s; ``reply`` holds the final ``Reply`` once it ends."""

    def __init__(self, session: Session, turn: Turn) -> None:
        self.session = session
        self._turn = turn
        self._steps = session._generate(turn)
        # Runs once: on close(), when the session moves on, or when the stream is dropped.
        self._abandon = weakref.finalize(self, session._abandon_turn, turn, self._steps)

    @property
    def reply(self) -> Reply | None:
        return self._turn.reply

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Snapshot:
        if self._turn.closed:
            raise ModelClosedError("the model was closed while this stream was open")
        if self._turn.done:
            raise StopIteration
        with self.session._busy():
            try:
                return next(self._steps)
            except StopIteration:
                if self._turn.closed:  # cancelled by the model's close()
                    raise ModelClosedError("the model was closed while this stream was open") from None
                raise

    def cancel(self) -> None:
        """Stop decoding before the next token (or mid-prefill); thread-safe and idempotent."""
        self._turn.cancelled.set()

    def close(self) -> None:
        """Cancel and finish the reply now (what was generated is kept)."""
        self.cancel()
        if self._turn.done:
            return  # finished, or ended by its model's close()
        with self.session._busy():
            self._abandon()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
