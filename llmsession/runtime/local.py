"""The in-process backend of ``api.Model``: a ``core.ModelCore`` with its sessions on top (made,
kept for stateless calls, saved and loaded)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmsession.config import MemoryConfig, ModelConfig, SessionConfig, session_config
from llmsession.engine.budget import MemoryReport
from llmsession.errors import ModelClosedError, SessionFileError
from llmsession.options import GenerationOptions, check_int, checked_options
from llmsession.replies import Message
from llmsession.runtime import dropped, exiting, persistence
from llmsession.runtime.choices import MAX_CHOICES, Answer, Choices, Forks, prefill_options
from llmsession.runtime.continuing import check_choices
from llmsession.runtime.core import ModelCore
from llmsession.runtime.embedding import Inputs
from llmsession.runtime.face import Session, Stream
from llmsession.runtime.session import LocalSession
from llmsession.runtime.stateless import StatelessSessions
from llmsession.runtime.stateless_calls import (
    check_answerable,
    check_stateless,
    check_tenant,
    checked_label,
    split,
)
from llmsession.text.tools import Tools
from llmsession.text.transcript import Transcript

# Sessions kept for stateless calls (``Model.chat``, the server's requests), at least: each is a
# conversation whose next turn decodes only what is new. Their states are live, parked or cold as
# the memory budget decides, so keeping many costs a transcript each, not KV cells.
STATELESS_SESSIONS = 64
# A recurrent or hybrid model's sessions keep checkpoints to rewind to (up to
# ``CheckpointConfig.max_bytes`` each, outside the budget): fewer are kept by default.
RECURRENT_STATELESS_SESSIONS = 8


class LocalModel(ModelCore):
    """A model loaded in this process, and its sessions."""

    def __init__(self, path: str | Path, config: ModelConfig, memory: MemoryConfig) -> None:
        """``config.stateless_sessions``: how many conversations stateless calls keep (default:
        64, or four per live session if that is more; 8, or one per live session, for a
        recurrent or hybrid model)."""
        super().__init__(path, config, memory)
        live = self.engine.config.max_live_sessions
        default = max(STATELESS_SESSIONS, 4 * live)
        if self.native.is_recurrent:  # each keeps checkpoints the budget does not count
            default = max(RECURRENT_STATELESS_SESSIONS, live)
        kept = config.stateless_sessions or default
        self.stateless = StatelessSessions(self, capacity=kept)

    def session(self, config: SessionConfig) -> LocalSession:
        """A new conversation (``api.Model.session``)."""
        return LocalSession(self, config)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        conversation: str | None = None,
    ) -> Stream:
        """A stateless call (``api.Model.chat``) as a stream of snapshots."""
        return self.stateless.stream(messages, options, tenant, config, conversation=conversation)

    def call_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> list[int]:
        """A stateless call's prompt tokens (``api.Model.prompt_tokens(tenant=...)``)."""
        return self.stateless.tokens(messages, tenant, config, tools, tool_format)

    def call_size(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> int:
        """A stateless call's prompt size, images too (``api.Model.prompt_size``)."""
        return self.stateless.size(messages, tenant, config, tools, tool_format)

    def complete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        conversation: str | None = None,
    ) -> Stream:
        """A raw completion (``api.Model.complete``) as a stream of snapshots."""
        return self.stateless.complete(prompt, options, tenant, config, conversation=conversation)

    def chat_choices(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        n: int,
        *,
        conversation: str | None = None,
    ) -> Choices:
        """``n`` choices of a stateless call sharing one prefill (``runtime.choices``)."""
        check_stateless(config)
        check_tenant(tenant)  # (both now, as a call checks them: not at the first choice)
        checked_label(conversation)
        options = checked_options(options)
        transcript = Transcript(messages)  # (checked now, as they are now: the prefill comes later)
        check_choices(transcript)
        check_answerable(transcript)  # (copied in each choice's thread: a server calls this on its loop)

        def prefill() -> Stream:
            prefilled = prefill_options(options)
            return self.stateless.stream(
                transcript, prefilled, tenant, config, pooled=False, conversation=conversation
            )

        def answer(fork: LocalSession, index: int, chosen: GenerationOptions) -> Stream:
            fork.messages, said = split(transcript)  # (its own editable copies)
            return fork.stream(said, chosen)

        return self._forks(n, prefill, answer, options, tenant, config)

    def complete_choices(
        self,
        prompt: str,
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        n: int,
        *,
        conversation: str | None = None,
    ) -> Choices:
        """``n`` continuations of a raw prompt sharing one prefill."""
        check_stateless(config)
        check_tenant(tenant)
        checked_label(conversation)
        options = checked_options(options)

        def prefill() -> Stream:
            prefilled = prefill_options(options)
            return self.stateless.complete(
                prompt, prefilled, tenant, config, pooled=False, conversation=conversation
            )

        def answer(fork: LocalSession, index: int, chosen: GenerationOptions) -> Stream:
            fork.messages = []  # (its prompt is the text as it is, on the fork's cells)
            said: list[Message] = [{"role": "user", "content": prompt}]
            return fork.start(said, chosen, self.raw_prompt(prompt))

        return self._forks(n, prefill, answer, options, tenant, config)

    def _forks(
        self,
        n: int,
        prefill: Callable[[], Stream],
        answer: Answer,
        options: GenerationOptions,
        tenant: str | None,
        config: SessionConfig,
    ) -> Choices:
        check_int("n", n, 1, MAX_CHOICES)

        def settle(base: LocalSession) -> None:
            self.stateless.adopt(base, tenant, config)

        return Forks(n, prefill, answer, options, settle).choices()

    def load_session(self, path: str | Path, overrides: Mapping[str, Any]) -> LocalSession:
        """A session saved with ``Session.save``: its transcript always, its KV cache when it
        belongs to this model and build (else its next reply's ``usage.cache_note`` says why).
        A saved ``context_size`` larger than a live session holds here becomes that;
        ``overrides`` (``SessionConfig`` fields) take the place of the saved ones."""
        self.check_open()
        saved, settings = persistence.read_saved(self, path)
        most = self.engine.session_cells({**settings, **overrides}.get("swa_full") is not False)
        if isinstance(size := settings.get("context_size"), int) and size > most:
            settings["context_size"] = most  # saved under a larger budget or the pool: what fits here
        try:
            LocalSession(
                self, SessionConfig(**settings)
            ).close()  # the file's own settings must be valid on their own
        except (TypeError, ValueError) as error:
            raise SessionFileError(f"{path}: invalid saved settings: {error}") from None
        session = LocalSession(self, session_config(SessionConfig(**settings), dict(overrides)))
        session.messages = persistence.saved_messages(saved)
        persistence.remember_replies(self, saved, session.replies, session.share_prefix)
        session.carry.load_note = persistence.restore(
            self,
            session.lease,
            saved,
            swa_full=session.swa_full,
            context_size=session.context_size,
            path=path,
        )
        return session

    def conversations(self) -> list[str]:
        """The conversations the stateless calls' kept sessions answered (``api.Model``)."""
        self.check_open()
        return self.stateless.conversations()

    def take_conversation(
        self, conversation: str, tenants: Collection[str | None] | None = None
    ) -> tuple[LocalSession, str | None] | None:
        """The kept session that answered ``conversation`` last (for one of ``tenants``), out of
        the kept ones."""
        self.check_open()
        return self.stateless.take(conversation, tenants)

    def keep_conversation(self, session: Session, tenant: str | None, conversation: str) -> None:
        """Keep one of this model's open sessions for the stateless calls, as ``conversation``'s:
        the model keeps its state in a session of its own (``LocalSession.hand_over``), and the
        caller's handle refuses any later use with ``ModelClosedError``, as a worker model's."""
        if not isinstance(session, LocalSession) or session.model is not self:
            raise ValueError("keep_conversation takes a session of this model")
        label = checked_label(conversation)  # (before the handle is closed)
        self.check_open()
        if session.closed:
            raise ModelClosedError("this session is closed (or its model keeps it: keep_conversation)")
        kept = session.hand_over()
        self.stateless.adopt(kept, tenant, kept.asked, label)

    def check_open(self) -> None:
        """``ModelClosedError`` once this model is closed: any use of it but its settings."""
        if self.closed:
            raise ModelClosedError("this model is closed")

    def embed(self, inputs: Inputs, normalize: bool = True) -> np.ndarray:
        self.check_open()
        return super().embed(inputs, normalize)

    def memory(self) -> MemoryReport:
        self.check_open()
        return super().memory()

    def identity(self) -> str:
        self.check_open()
        return super().identity()

    def projector_identity(self) -> str | None:
        self.check_open()
        return super().projector_identity()

    def close(self) -> None:
        exiting.not_stepping(self.sessions)  # (refused before the kept sessions are let go)
        self.stateless.close()
        dropped.finish_dropped()  # (what a garbage collection dropped finishes before memory goes)
        super().close()
