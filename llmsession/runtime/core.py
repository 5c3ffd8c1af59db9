"""A GGUF model loaded in this process: its native model and projector, the engine that keeps
its sessions' memory, and how a transcript becomes a prompt (rendered, tokenized, with the
replies generated here spliced in as the tokens they were) or a constraint a compiled matcher.

``local.LocalModel`` adds its sessions on top; ``api.Model`` is what users hold."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmsession.config import MemoryConfig, ModelConfig
from llmsession.engine import anticipate
from llmsession.engine.budget import MemoryReport
from llmsession.engine.engine import Engine
from llmsession.engine.prompt import Prompt
from llmsession.errors import GrammarError, TemplateError, UnsupportedFeatureError
from llmsession.native import rpc
from llmsession.options import GenerationOptions
from llmsession.runtime import exiting
from llmsession.runtime.attention import probed
from llmsession.runtime.embedding import Embedder, Inputs
from llmsession.runtime.identity import FileIdentities
from llmsession.runtime.loading import (
    Loaded,
    checked_threads,
    choose_flash_attention,
    load_native,
    memory_plan,
    probes_attention,
    session_positions,
)
from llmsession.runtime.spliced import Rendering, remembered, text_tokens
from llmsession.runtime.thinking import markup_for
from llmsession.runtime.tokenizer import PromptTokenizer
from llmsession.text.gemma4 import is_gemma4_template
from llmsession.text.images import image_parts, message_images
from llmsession.text.reasoning import Markers, markers_for
from llmsession.text.splice import ReplyTokens
from llmsession.text.templates import render_checked
from llmsession.text.tool_formats import FORMATS, GEMMA4, GENERIC, ToolFormat, detect
from llmsession.text.tool_grammar import ANY_TEXT, answered, grammar
from llmsession.text.tools import Tools
from llmsession.text.transcript import Transcript

if TYPE_CHECKING:
    import llguidance

    from llmsession.native.constraints import Constraint

log = logging.getLogger("llmsession")
DEFAULT_MEDIA_MARKER = "<__media__>"


class ModelCore:
    """A model file loaded once, with its engine; see ``api.Model`` for the settings. Sessions
    built on it register in ``sessions`` (its ``close`` stops them first)."""

    def __init__(self, path: str | Path, config: ModelConfig, memory: MemoryConfig) -> None:
        """``config.rpc_servers`` ("host:port") are preflighted here, after every other check:
        llama.cpp aborts the process on one that is not there."""
        self.config = config
        gpu_layers = config.gpu_layers
        if gpu_layers is None:  # every layer on the RPC servers' devices, else none offloaded
            gpu_layers = -1 if config.rpc_servers else 0
        self.threads = checked_threads(config.threads)
        self.path = Path(path)
        self.mmproj_path = config.mmproj_path
        self.kv_type: str = config.kv_type
        self.flash_attention = choose_flash_attention(config.flash_attention, self.kv_type, gpu_layers)
        self.anticipate = config.anticipate
        timeout = config.worker_timeout
        servers = rpc.preflight_all(rpc.checked_servers(config.rpc_servers, timeout), timeout)
        cells: dict[str, Any] = {"flash_attention": self.flash_attention, "kv_type": self.kv_type}
        where: dict[str, Any] = {"gpu_layers": gpu_layers, "threads": self.threads, "rpc_servers": servers}
        prompts: dict[str, Any] = {"use_jinja": config.use_jinja, "chat_template": config.chat_template}
        self._identities = FileIdentities(self.path, self.mmproj_path)  # (pinned before it loads)
        loaded = load_native(
            self.path,
            self.mmproj_path,
            **where,
            cells=cells,
            memory=memory_plan(memory),
            kv_tokens=memory.kv_tokens,
            **prompts,
        )
        if probes_attention(config.flash_attention, self.kv_type, gpu_layers):
            try:
                positions, batch = session_positions(loaded.memory), loaded.memory.batch_size
                self.flash_attention = probed(loaded.native, self.path, self.threads, positions, batch)
            except BaseException:
                loaded.close()
                raise
            cells["flash_attention"] = self.flash_attention
        try:
            self._adopt(loaded, cells)
        except BaseException:  # (an embedding model's context is made here, and may fail)
            loaded.close()
            raise
        self.sessions: weakref.WeakSet[exiting.Shuttable] = weakref.WeakSet()
        self.replies = ReplyTokens()  # every reply generated here, for splicing
        self._guidance: llguidance.LLTokenizer | None = None
        self._guidance_lock = threading.Lock()
        self._specials: dict[str, Mapping[str, int]] = {}  # per tool format (``special_markers``)

    def _adopt(self, loaded: Loaded, cells: Mapping[str, Any]) -> None:
        """What the loaded model brings: its engine (warming up), how its memory was sized, and
        how its prompts are rendered and tokenized."""
        self.native, self.projector, self.sizing = loaded.native, loaded.projector, loaded.sizing
        self.renderer = loaded.renderer
        self.engine = Engine(self.native, self.projector, self.threads, loaded.memory, **cells)
        self.embedder = Embedder(self.native, self.threads)
        self.pooling = self.embedder.pooling  # (None: a chat model)
        # An embedding model's context is made now; a chat model's shared one in the background.
        self._warming = self.engine.warm() if self.pooling is None else None
        self.embedder.open()
        self.use_jinja, self.template = self.renderer.jinja, self.renderer.template
        markers = markers_for(self.template, gemma4=is_gemma4_template(self.template))
        self.reasoning = markup_for(self.native, markers)  # (its tokens read once)
        self.tokenizer = PromptTokenizer(self.native, self.template)
        self.media_marker = self.projector.marker if self.projector else DEFAULT_MEDIA_MARKER
        exiting.track(self)  # (closed at exit if still open: ``exiting``)

    def embed(self, inputs: Inputs, normalize: bool = True) -> np.ndarray:
        """``inputs``' embeddings (``api.Model.embed``; ``runtime.embedding``)."""
        return self.embedder.embed(inputs, self.tokenize, normalize)

    def check_chat(self) -> None:
        """An embedding model has no language-model head: it does not chat or complete."""
        if self.embedder.pooling is not None:
            raise UnsupportedFeatureError(
                f"this is an embedding model ({self.embedder.pooling} pooling): it "
                "embeds text (Model.embed, /v1/embeddings), it does not chat or complete"
            )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        thinking: bool | str = False,
        tools: Tools | None = None,
        tool_format: str | None = None,
    ) -> str:
        """The exact prompt text a session would tokenize for these messages (and tools), its
        users' and tools' text plain (``text.guard``): checked unless a ``Transcript``."""
        plain, generate = Transcript(messages).messages(), add_generation_prompt
        text = self.render_checked(plain, generate, thinking=thinking, tools=tools, tool_format=tool_format)
        return self.tokenizer.shown(text)

    def render_checked(
        self,
        plain: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        thinking: bool | str = False,
        tools: Tools | None = None,
        tool_format: str | None = None,
    ) -> str:
        """``render`` for a checked transcript's editable copy (or one with stand-ins for its
        replies: ``spliced``), with the placeholders its tokenizer reads (``tokenizer.stretch``).
        A value nested too deep to render (a call's arguments, say) is a TemplateError."""
        fmt = self.tool_format(tool_format)
        try:
            text = render_checked(
                self.tokenizer.marked(plain),
                template=self.template,
                native=self.native.apply_template,
                add_generation_prompt=add_generation_prompt,
                thinking=thinking,
                use_jinja=self.use_jinja,
                bos_token=self.native.token_text(self.native.bos()),
                eos_token=self.native.token_text(self.native.eos()),
                media_marker=self.media_marker,
                tools=self.tokenizer.marked_tools(tools),
                tool_format=fmt,
                typed_content=self.renderer.typed_content,
            )
        except RecursionError:
            raise TemplateError("a message, a call's arguments or a tool nests too deep to render") from None
        if "\x00" in text:  # (a renderer wrote one from a tool or a call: refused as in raw prompts)
            raise TemplateError("a message, a tool or a call must not contain NUL characters")
        return text

    def tool_format(self, name: str | None = None) -> ToolFormat:
        """How calls are written: ``name``'s format, else the template's own where jinja
        renders it, else the generic one (llama.cpp's built-in templates know no tools)."""
        gemma4 = is_gemma4_template(self.template)  # (rendered in Python, calls in Gemma 4's syntax)
        native = self.use_jinja or gemma4
        fmt = FORMATS[name] if name is not None else detect(self.template) if native else GENERIC
        if fmt is not GENERIC and not self.use_jinja and not (gemma4 and fmt is GEMMA4):
            raise ValueError(
                f"tool_format {fmt.name!r} needs the template rendered by jinja (use_jinja=True)"
            )
        return fmt

    def special_markers(self, fmt: ToolFormat) -> Mapping[str, int]:
        """The format's markers this vocabulary holds as one special token each, and their ids:
        the grammar names them by id, and the reply's text spells them. Found once per format
        (an exchange with tools asks twice: for its grammar and for its text)."""
        known = self._specials.get(fmt.name)
        if known is None:
            found = {}
            for spelling in fmt.markers:
                tokens = self.native.tokenize(spelling, add_special=False)
                if len(tokens) == 1 and self.native.is_special(tokens[0]):
                    found[spelling] = tokens[0]
            known = self._specials[fmt.name] = found
        return known

    def raw_prompt(self, text: str) -> Prompt:
        """A completion's prompt: ``text`` tokenized as it is (BOS as the model adds it, special
        tokens parsed), no chat template."""
        if not isinstance(text, str):
            raise TypeError(f"a prompt must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError("a prompt must not be empty")
        if "\x00" in text:
            raise ValueError("a prompt must not contain NUL characters")
        self.check_chat()
        began = time.perf_counter()
        tokens = self.tokenize(text)
        if not tokens:  # (a model that adds no BOS, and text that tokenizes to nothing)
            raise ValueError("the prompt tokenizes to nothing")
        prompt = Prompt([tokens], raw=True)
        prompt.tokenize_s = time.perf_counter() - began
        return prompt

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens with special tokens parsed; BOS is added once even if the text starts with it."""
        return self.tokenizer.tokenize(text, add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of token ids; an id outside the vocabulary raises ValueError naming it."""
        return self.native.detokenize(tokens)

    def prompt_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool | str = False,
        tools: Tools | None = None,
        tool_format: str | None = None,
        own: ReplyTokens | None = None,
        shared: bool = True,
    ) -> list[int]:
        """The tokens of a text-only transcript's prompt (with these tools), as an exchange makes
        them: its replies generated here spliced in as the tokens they were (``own``'s first, and
        every session's unless not ``shared``, as ``prompt``); checked unless a ``Transcript``."""
        plain = Transcript(messages).messages()
        text = self.render_checked(plain, thinking=thinking, tools=tools, tool_format=tool_format)
        return text_tokens(self, plain, text, Rendering(thinking, tools, tool_format), own, shared)

    def remember_reply(
        self,
        text: str,
        tokens: Sequence[int],
        own: ReplyTokens | None = None,
        shared: bool = True,
        block: str = "",
    ) -> None:
        """A reply generated here: later prompts hold it as ``tokens`` if they spell ``text``
        (in the session's ``own`` record too, which its prompts consult first; only there
        unless ``shared``); one that opened with a reasoning ``block``, its content too
        (``spliced.remembered``)."""
        remembered(self.native, text, tokens, (self.replies if shared else None, own), block)

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool | str = False,
        own: ReplyTokens | None = None,
        shared: bool = True,
        tools: Tools | None = None,
        tool_format: str | None = None,
    ) -> Prompt:
        """The tokenized prompt for a transcript (and the exchange's tools); images go through
        the projector. Replies are spliced from ``own``, and from every session's unless not
        ``shared``. The messages are checked unless they are a ``Transcript``."""
        self.check_chat()
        plain = Transcript(messages).messages()
        if self.projector is None and next(image_parts(plain), None) is not None:  # (none decoded)
            raise UnsupportedFeatureError(
                "this model has no multimodal projector, so it cannot take images: "
                "load one with Model(path, mmproj_path=...)"
            )
        images = list(message_images(plain))
        began = time.perf_counter()
        text = self.render_checked(plain, thinking=thinking, tools=tools, tool_format=tool_format)
        rendered = time.perf_counter()
        if not images:
            how = Rendering(thinking, tools, tool_format)
            prompt = Prompt([text_tokens(self, plain, text, how, own, shared)])
            prompt.render_s, prompt.tokenize_s = rendered - began, time.perf_counter() - rendered
            return prompt
        assert self.projector is not None
        chunks = self.projector.tokenize(self.tokenizer.pieces(text), images)
        if chunks.pieces and isinstance(chunks.pieces[0], list):
            self.tokenizer.drop_double_bos(chunks.pieces[0])
        return Prompt(chunks.pieces, chunks, rendered - began, time.perf_counter() - rendered)

    def constraint(
        self,
        options: GenerationOptions,
        tools: Tools | None = None,
        ids: Sequence[str] = (),
        thought: Markers | None = None,
        *,
        after_block: bool = False,
    ) -> Constraint | None:
        """The options' constraint compiled for this model (GrammarError if it cannot be used),
        or the tool calls' (written with ``ids`` where the format carries them; after a block
        of reasoning the reply may open if ``thought`` gives its markers, or after the one its
        prompt opened, ``after_block``). Where ``thought``'s answer opens with a header of its
        own (gpt-oss), a JSON schema's, a regex's or a grammar's answer follows it, after the
        reasoning the reply may open. Under tools it may not call (``tool_choice`` "none") such a
        reply answers in its final channel, as text: a call is a message of its own there, whose
        channel tags are no text. The matcher's tokenizer is built on first use, once."""
        uncalled = tools is not None and tools.mode == "none" and thought is not None and bool(thought.answer)
        if not options.constrained and not uncalled:
            return None
        from llmsession.native.constraints import Constraint, tokenizer  # (llguidance: loaded when needed)

        with self._guidance_lock:
            if self._guidance is None:
                self._guidance = tokenizer(self.native)
        if tools is not None and tools.mode != "none":
            fmt = self.tool_format(options.tool_format)
            try:
                specials = dict(self.special_markers(fmt))
                if thought is not None and self.reasoning is not None:
                    specials |= self.reasoning.special
                resume = self.reasoning.markers.resume if after_block and self.reasoning is not None else ""
                lark = grammar(fmt, tools, ids, specials, thought, after_block=after_block, resume=resume)
            except RecursionError:
                raise GrammarError("tools: a schema is nested too deep") from None
            return Constraint.from_lark(lark, self._guidance)
        if thought is not None and thought.answer and self.reasoning is not None:  # (gpt-oss)
            specials = dict(self.reasoning.special)
            if not options.constrained:  # (tool_choice "none": text in the final channel)
                return Constraint.from_lark(
                    answered(ANY_TEXT, thought, specials), self._guidance, "text", plain=True
                )
            return Constraint.compile(options, self._guidance, lambda body: answered(body, thought, specials))
        return Constraint.compile(options, self._guidance)

    def identity(self) -> str:
        """The model file's sha256 (what a saved KV state belongs to), computed once."""
        return self._identities.of(self.path)

    def projector_identity(self) -> str | None:
        return None if self.mmproj_path is None else self._identities.of(self.mmproj_path)

    def memory(self) -> MemoryReport:
        """Where every session's state is (live, parked, disk, cold), the budget's use, and the
        counts of parks, restores and drops so far; how the KV cells were sized and what they
        take, and llama.cpp's buffers; how prompts are rendered."""
        if self._warming is not None:
            self._warming.join()  # (what the shared context holds, once it is made)
        report = self.engine.memory()
        return dataclasses.replace(
            report,
            # (an embedding model has no chat cells: its embedding context's count among buffers)
            kv_bytes=self.sizing.kv_bytes if self.pooling is None else 0,
            kv_sizing=self.sizing.note,
            context_size=self.sizing.context_size,
            renderer=str(self.renderer),
            buffer_bytes=self.native.held_buffers(),
        )

    def close(self) -> None:
        """Stop every session's stream (each finishes its current step first), free the shared
        memory, then the projector and the model, each once the calls using it outside sessions
        are done (a prompt's images tokenized, a text tokenized or rendered: ``native.in_use``).
        Any later use raises ModelClosedError; from inside a session's step, SessionBusyError."""
        exiting.shut_all(self.sessions)
        anticipate.stop_all(self.engine)  # collected sessions' too
        self.embedder.close()  # (waits for an embed under way)
        self.engine.close()
        if self.projector is not None:
            with self.projector.lock:  # (a stateless prompt's images may be tokenizing)
                self.projector.close()
        self.native.close()  # (waits for the calls under way; refuses new ones)

    @property
    def closed(self) -> bool:
        return self.native.closed
