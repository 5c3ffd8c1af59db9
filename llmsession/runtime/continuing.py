"""A reply that continues the assistant's text a stateless call ends with: a prefill, as
Anthropic's API and llama-server take one (``Transcript.prefilled``). The prompt is the
transcript before that text, with the generation prompt, then the text, tokenized as the
assistant's text is in any prompt (special tokens read: the client's own, as its system text; a
user's or a tool's text is read plain, ``text.guard``), so a later prompt that holds the message
tokenizes it alike wherever it is cached. The reply is what follows it;
the session's transcript and reply record hold the assistant's whole message (the text, then
the reply), so the next turn, which sends that message back, reads it from the cache.

Not with tools, a constraint or a thinking template (llama-server refuses the last too): a call
or a schema's answer would begin inside the text, a reasoning block before it. Nor on a model
with an encoder: its prompt is the encoder's input, not the start of the reply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmsession.errors import TemplateError, UnsupportedFeatureError
from llmsession.options import GenerationOptions
from llmsession.replies import Reply
from llmsession.text.tools import Tools
from llmsession.text.transcript import Transcript

if TYPE_CHECKING:
    from llmsession.engine.prompt import Prompt
    from llmsession.runtime.core import ModelCore


@dataclass(frozen=True)
class Prefill:
    """The assistant's text a reply continues, and its tokens as the prompt ends with them."""

    text: str
    tokens: tuple[int, ...]

    def whole(self, reply: Reply) -> Reply:
        """``reply`` as the assistant's whole message: this text, then the reply's."""
        return dataclasses.replace(reply, text=self.text + reply.text)


def check_prefill(
    model: ModelCore, text: str, options: GenerationOptions, tools: Tools | None, thinking: bool | str
) -> None:
    """An ``UnsupportedFeatureError`` for what a prefill cannot be combined with; a
    ``TemplateError`` for a text with a NUL, which no rendered message may hold (the next turn,
    which sends the message back, would be refused so)."""
    if "\x00" in text:
        raise TemplateError("a message must not contain NUL characters")
    if tools is not None:
        raise UnsupportedFeatureError(
            "a reply that continues the assistant's text (a prefill) cannot call tools"
        )
    if options.constrained:
        raise UnsupportedFeatureError(
            "a reply that continues the assistant's text (a prefill) cannot be constrained"
        )
    if model.native.has_encoder:
        raise UnsupportedFeatureError(
            "a model with an encoder cannot continue the assistant's text (a prefill)"
        )
    markup = model.reasoning
    if markup is not None and (thinking or markup.markers.always):
        raise UnsupportedFeatureError(
            "a reply that continues the assistant's text (a prefill) cannot follow a thinking template's "
            "reasoning: turn thinking off"
        )


def prefilled(model: ModelCore, prompt: Prompt, text: str) -> Prefill:
    """``text`` tokenized (as the assistant's text is in any prompt) and put at the end of
    ``prompt``."""
    tokens = prefill_tokens(model, text)
    prompt.extend(tokens)
    return Prefill(text, tuple(tokens))


def prefill_tokens(model: ModelCore, text: str) -> list[int]:
    """The tokens a prompt ends with for the assistant's ``text`` (as its text is in any prompt)."""
    return model.tokenizer.vocabulary.tokenize(text, add_special=False)


def prefill_of(transcript: Transcript) -> tuple[Transcript, str | None]:
    """A transcript that ends with the assistant's text its reply continues (``Prefill``): the
    transcript before it, and the text; else itself and None."""
    prefilled = transcript.prefilled()
    return (transcript, None) if prefilled is None else prefilled


def check_choices(transcript: Transcript) -> None:
    """``n`` choices do not continue the assistant's text: an ``UnsupportedFeatureError`` (each
    of the forks answers the transcript's messages anew)."""
    if transcript.prefilled() is not None:
        raise UnsupportedFeatureError(
            "n choices cannot continue the assistant's text (a prefill): ask for one at a time"
        )
