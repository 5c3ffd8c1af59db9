"""A rendered transcript's tokens, with the replies this model generated spliced in as the tokens
they were (``text.splice``) when that spells exactly the same text: what makes a resent
conversation's prompt match the cells its replies left, token for token."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llmsession.errors import TemplateError
from llmsession.native.llama import NativeModel
from llmsession.runtime.tokenizer import PromptTokenizer
from llmsession.text.splice import ReplyTokens, found_in_order, marker, splice, stretches
from llmsession.text.tool_formats import ToolFormat, said_text, stand_in
from llmsession.text.tools import Tools


class Renders(Protocol):
    """What splicing needs of a model (``core.ModelCore``)."""

    native: NativeModel
    tokenizer: PromptTokenizer
    replies: ReplyTokens  # every reply generated here

    def tool_format(self, name: str | None = None) -> ToolFormat: ...

    def render_checked(
        self,
        plain: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        thinking: bool | str = False,
        tools: Tools | None = None,
        tool_format: str | None = None,
    ) -> str: ...


@dataclass(frozen=True)
class Rendering:
    """How a transcript was rendered: with thinking, these tools, in this tool format."""

    thinking: bool | str = False
    tools: Tools | None = None
    tool_format: str | None = None


def text_tokens(
    model: Renders,
    messages: Sequence[Mapping[str, Any]],
    text: str,
    how: Rendering,
    own: ReplyTokens | None = None,
    shared: bool = True,
) -> list[int]:
    """``text`` (the rendered, checked ``messages``) tokenized, with the replies this model
    generated as the tokens it generated when that spells exactly the same text; a session's
    ``own`` replies first (another session may have said the same words otherwise), and only
    those unless ``shared``: how a prompt splits would tell what others were told."""

    def recorded(content: str, back: int) -> tuple[int, ...] | None:
        mine = own.get(content, back) if own is not None else None
        return mine or (model.replies.get(content, back) if shared else None)

    fmt = model.tool_format(how.tool_format)
    said = [said_text(m, fmt) for m in messages]
    later, seen = [0] * len(said), Counter[str | None]()  # (a text said again: each its own split)
    for i in reversed(range(len(said))):
        later[i], seen[said[i]] = seen[said[i]], seen[said[i]] + 1
    known = {
        i: tokens
        for i, s in enumerate(said)
        if s is not None and (tokens := recorded(s, later[i])) is not None
    }
    if not known:
        return model.tokenizer.prompt(text, shared)
    around = _around(model, messages, known, text, how)
    if around is None:  # no stand-ins (a template that writes results inside the call's turn):
        known = {i: t for i, t in known.items() if fmt.trigger in (said[i] or "")}  # calls only,
        around = found_in_order(text, [said[i] or "" for i in known])  # where they are
    if around is None or not known:
        return model.tokenizer.prompt(text, shared)
    # A prompt kept apart tokenizes its stretches afresh: how fast a remembered one came back
    # would tell whether another prompt held the same text.
    stretch_tokens = model.tokenizer.remembered if shared else model.tokenizer.stretch
    spliced = splice(around, list(known.values()), stretch_tokens)
    native, shown = model.native, model.tokenizer.shown(text)  # (placeholders as their texts)
    spelled = native.detokenize(spliced, special=True)
    if spelled in (shown, _with_bos(native, shown, spliced)):  # exactly the rendered text
        return spliced
    plain = model.tokenizer.prompt(text, shared)  # (a tokenizer that adds spaces spells otherwise)
    if spliced != plain and spelled == native.detokenize(plain, special=True):
        return spliced
    return plain


def remembered(
    native: NativeModel,
    text: str,
    tokens: Sequence[int],
    records: tuple[ReplyTokens | None, ReplyTokens | None],
    block: str = "",
) -> None:
    """``text`` as the ``tokens`` it was generated as, in the ``records`` (the model's, the
    session's) where they spell it (a reply's text spells its calls' markers' special tokens).
    A reply that opened with a reasoning ``block`` is its content's tokens as well: a resent
    turn says its content apart from its reasoning (``tool_formats.said_text``)."""
    spellings = (native.detokenize(tokens), native.detokenize(tokens, special=True))
    if tokens and text in spellings:
        for record in records:
            if record is not None:
                record.remember(text, tokens)
    for cut, chars in block_cuts(native, tokens, block) if block and text.startswith(block) else ():
        remembered(native, text[chars:], tokens[cut:], records)


def block_cuts(native: NativeModel, tokens: Sequence[int], block: str) -> list[tuple[int, int]]:
    """Where a reply's ``tokens`` may be cut after its reasoning ``block``: each count of its
    first tokens that spells the block, or the block without some of the whitespace it ends
    with (the splitter drops what the content's first token began with: gpt-oss's call
    `` to=...``), and the characters they spell. None where a token spans the block's text."""
    wanted, at, cuts = block.encode(), 0, []
    least = len(block.rstrip().encode())
    for i, token in enumerate(tokens):
        if at >= least and i > 0:
            with contextlib.suppress(UnicodeDecodeError):  # (inside a character: no cut)
                cuts.append((i, len(wanted[:at].decode())))
        piece = native.piece(token, special=True)
        if at == len(wanted) or wanted[at : at + len(piece)] != piece:
            break
        at += len(piece)
    return cuts


def _with_bos(native: NativeModel, text: str, tokens: Sequence[int]) -> str:
    """How ``text`` is spelled with the BOS its tokens start with (text that spells none)."""
    bos = native.bos()
    if not (native.add_bos and tokens and tokens[0] == bos):
        return text
    return native.token_text(bos) + text


def _around(
    model: Renders,
    messages: Sequence[Mapping[str, Any]],
    known: Mapping[int, Any],
    text: str,
    how: Rendering,
) -> list[str] | None:
    """The text around the ``known`` replies, found by rendering them as stand-ins; None
    where the template cannot take the stand-ins or they do not rebuild ``text``."""
    marked = [stand_in(m, marker(i)) if i in known else m for i, m in enumerate(messages)]
    try:
        rendered = model.render_checked(
            marked, thinking=how.thinking, tools=how.tools, tool_format=how.tool_format
        )
    except TemplateError:
        return None
    around = stretches(rendered, list(known))
    fmt = model.tool_format(how.tool_format)
    contents = [said_text(messages[i], fmt) or "" for i in known]
    if around is None or "".join(a + c for a, c in zip(around, [*contents, ""], strict=True)) != text:
        return None
    return around
