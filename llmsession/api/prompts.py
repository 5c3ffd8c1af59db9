"""What a transcript makes, read without an exchange: its prompt's text (``render``), tokens
(``prompt_tokens``) and size, images too (``prompt_size``: Anthropic's ``count_tokens``), and
a text's tokens both ways. ``Model`` has them from here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llmsession.config import Effort, SessionConfig, check_thinking, session_config
from llmsession.errors import UnsupportedFeatureError
from llmsession.options import check_tool_format
from llmsession.text.messages import image_parts
from llmsession.text.tools import checked_tools
from llmsession.text.transcript import Transcript

if TYPE_CHECKING:
    from llmsession.api.backend import Backend


class Prompts:
    """``Model``'s reads of what a transcript's prompt is."""

    _backend: Backend

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any] | type] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        tool_format: str | None = None,
        add_generation_prompt: bool = True,
        thinking: bool | Effort = False,
    ) -> str:
        """The exact prompt text an exchange with these messages (and OpenAI tool specs or
        pydantic classes, as ``GenerationOptions.tools`` takes them) renders, as Hugging
        Face's ``apply_chat_template(conversation, tools=...)`` does."""
        checked = checked_tools(tools, tool_choice)
        check_tool_format(tool_format)
        check_thinking(thinking)
        return self._backend.render(
            messages, add_generation_prompt, thinking=thinking, tools=checked, tool_format=tool_format
        )

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens with special tokens parsed; BOS is added once even if the text starts with it."""
        if not isinstance(text, str):
            raise TypeError(f"tokenize takes a str, got {type(text).__name__}")
        return self._backend.tokenize(text, add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of token ids, as a reply shows them (a byte that is no text, and a NUL, as
        U+FFFD); an id outside the vocabulary raises ValueError naming it."""
        return self._backend.detokenize(tokens)

    def prompt_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any] | type] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        tool_format: str | None = None,
        thinking: bool | Effort = False,
        tenant: str | None = None,
        config: SessionConfig | None = None,
    ) -> list[int]:
        """The tokens of a text-only transcript's prompt, with these tools, as an exchange
        decodes them (``render``'s text, with the replies generated here as they were). With a
        ``tenant`` or a ``config``: as ``chat`` with them decodes it (a tenant kept apart,
        ``share_prefix=False``, splices only its own replies; ``config.thinking`` renders; the
        assistant's text it ends with, the text the call continues; without either, such a
        transcript is rendered whole, as ``render`` renders it). A transcript with images raises
        ``UnsupportedFeatureError`` (their positions are the projector's, counted as it decodes)."""
        checked = checked_tools(tools, tool_choice)
        check_tool_format(tool_format)
        check_thinking(thinking)
        messages = Transcript(messages)  # (checked once, here: not again below)
        if next(image_parts(messages), None) is not None:
            raise UnsupportedFeatureError("prompt_tokens counts text-only transcripts; this one holds images")
        if tenant is None and config is None:
            return self._backend.prompt_tokens(
                messages, thinking=thinking, tools=checked, tool_format=tool_format
            )
        settings = session_config(config, {"thinking": True} if thinking else {})
        return self._backend.call_tokens(messages, tenant, settings, checked, tool_format)

    def prompt_size(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any] | type] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        tool_format: str | None = None,
        thinking: bool | Effort = False,
        tenant: str | None = None,
        config: SessionConfig | None = None,
    ) -> int:
        """How many prompt tokens ``chat`` with these arguments decodes or reuses (its usage's
        ``prompt_tokens``): ``prompt_tokens``'s count as a call makes them, and a transcript's
        images too, as many as the projector makes of each (each image is read for it, not
        encoded); a model without a projector refuses images (``UnsupportedFeatureError``)."""
        checked = checked_tools(tools, tool_choice)
        check_tool_format(tool_format)
        check_thinking(thinking)
        settings = session_config(config, {"thinking": True} if thinking else {})
        return self._backend.call_size(Transcript(messages), tenant, settings, checked, tool_format)
