"""The in-process backend of ``api.Model``: a ``core.ModelCore`` with its sessions on top (made,
kept for stateless calls, saved and loaded)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmsession.errors import SessionFileError
from llmsession.options import GenerationOptions
from llmsession.runtime import persistence
from llmsession.runtime.core import ModelCore
from llmsession.runtime.session import Session
from llmsession.runtime.stateless import StatelessSessions
from llmsession.runtime.stream import Stream

STATELESS_SESSIONS = 8  # sessions kept for Model.chat (their states live, parked or cold)


class LocalModel(ModelCore):
    """A model loaded in this process, and its sessions."""

    def __init__(self, path: str | Path, **settings: Any) -> None:
        super().__init__(path, **settings)
        self.stateless = StatelessSessions(self, capacity=STATELESS_SESSIONS)

    def session(self, system: str | None = None, **settings: Any) -> Session:
        """A new conversation (``api.Model.session`` says what ``settings`` may be)."""
        return Session(self, system=system, **settings)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **settings: Any,
    ) -> Stream:
        """A stateless call (``api.Model.chat``) as a stream of snapshots."""
        return self.stateless.stream(messages, options, tenant, **settings)

    def complete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **settings: Any,
    ) -> Stream:
        """A raw completion (``api.Model.complete``) as a stream of snapshots."""
        return self.stateless.complete(prompt, options, tenant, **settings)

    def load_session(self, path: str | Path, **overrides: Any) -> Session:
        """A session saved with ``Session.save``: its transcript always, its KV cache when it
        belongs to this model and build (else its next reply's ``usage.cache_note`` says why)."""
        saved, settings = persistence.read_saved(self, path)
        try:
            self.session(**settings).close()  # the file's own settings must be valid on their own
        except (TypeError, ValueError) as error:
            raise SessionFileError(f"{path}: invalid saved settings: {error}") from None
        session = self.session(**{**settings, **overrides})
        session.messages = persistence.saved_messages(saved)
        session.carry.load_note = persistence.restore(
            self,
            session.lease,
            saved,
            swa_full=session.swa_full,
            context_size=session.context_size,
            path=path,
        )
        return session

    def close(self) -> None:
        self.stateless.close()
        super().close()
