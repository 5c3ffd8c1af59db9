"""Raw completions (OpenAI's ``/v1/completions``): a prompt continued as it is, without the
chat template, routed and kept apart by tenant as ``Model.chat``'s calls are. ``Model`` has
them from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmsession.config import SessionConfig, session_config
from llmsession.options import GenerationOptions, checked_options
from llmsession.replies import Reply

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from llmsession.api.backend import Backend
    from llmsession.config import SessionSettings
    from llmsession.runtime.aio import AsyncStream
    from llmsession.runtime.choices import Choices
    from llmsession.runtime.face import Stream


class RawCompletions:
    """``Model``'s calls that continue a raw prompt."""

    _backend: Backend

    def complete_choices(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        n: int,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Choices:
        """``n`` continuations of a raw ``prompt`` sharing one prefill (``chat_choices``)."""
        settings = session_config(config, dict(overrides))
        return self._backend.complete_choices(prompt, options, tenant, settings, n, conversation=conversation)

    def complete(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Reply:
        """Continue ``prompt`` as it is, without the chat template (OpenAI's completions): the
        text is tokenized as given, BOS added as the model adds it. Calls are routed and kept
        apart by ``tenant`` as ``chat`` calls are, so a prompt that grows decodes only its end."""
        from llmsession.runtime.face import drain

        return drain(
            self.complete_stream(
                prompt, options, tenant=tenant, conversation=conversation, config=config, **overrides
            )
        )

    def complete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Stream:
        """``complete`` as a stream of snapshots."""
        settings = session_config(config, dict(overrides))
        return self._backend.complete_stream(prompt, options, tenant, settings, conversation=conversation)

    def acomplete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> AsyncStream:
        """``complete_stream`` for asyncio."""
        from llmsession.runtime.aio import AsyncStream

        settings = session_config(config, dict(overrides))
        checked = checked_options(options)  # (here: not in the stream's thread at its first step)
        backend = self._backend
        return AsyncStream(
            lambda: backend.complete_stream(prompt, checked, tenant, settings, conversation=conversation)
        )

    async def acomplete(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Reply:
        """``complete`` for asyncio."""
        from llmsession.runtime.aio import adrain

        return await adrain(
            self.acomplete_stream(
                prompt, options, tenant=tenant, conversation=conversation, config=config, **overrides
            )
        )
