"""A loaded GGUF model: tokenizer, chat rendering, and the factory for sessions."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .native import NativeContext, NativeModel, default_threads
from .session import Session
from .templates import render_prompt


class Model:
    """A model file loaded once; any number of sessions chat with it, each with its own context.

    ``with Model(path) as model:`` frees the model and every session's context on exit.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        mmproj_path: str | Path | None = None,
        gpu_layers: int = 0,
        threads: int | None = None,
        use_jinja: bool = False,
    ) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads: must be at least 1, got {threads}")
        self.path = Path(path)
        self.threads = threads or default_threads()
        self.use_jinja = use_jinja
        self.native = NativeModel(self.path, gpu_layers=gpu_layers)
        self.template = self.native.chat_template()
        self.media_marker = "<__media__>"
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        if mmproj_path is not None:
            raise NotImplementedError("projectors arrive with the images issue")

    def session(
        self,
        system: str | None = None,
        *,
        context_size: int = 4096,
        batch_size: int = 512,
        thinking: bool = False,
        swa_full: bool = True,
    ) -> Session:
        """A new conversation with its own llama context (created on its first exchange)."""
        session = Session(
            self,
            system=system,
            context_size=context_size,
            batch_size=batch_size,
            thinking=thinking,
            swa_full=swa_full,
        )
        self._sessions.add(session)
        return session

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *, thinking: bool = False
    ) -> str:
        """The exact prompt text a session would tokenize for these messages."""
        return render_prompt(
            messages,
            template=self.template,
            native=self.native.apply_template,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            use_jinja=self.use_jinja,
            bos_token=self.native.token_text(self.native.bos()),
            eos_token=self.native.token_text(self.native.eos()),
            media_marker=self.media_marker,
        )

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens with special tokens parsed; BOS is added once even if the text starts with it."""
        tokens = self.native.tokenize(text, add_special=add_special)
        bos = self.native.bos()
        if add_special and self.native.add_bos and len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
            del tokens[0]
        return tokens

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.native.detokenize(tokens)

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]], *, thinking: bool = False) -> list[int]:
        return self.tokenize(self.render(messages, thinking=thinking))

    def close(self) -> None:
        """Free every session's context, then the model."""
        for session in list(self._sessions):
            session._discard_context()
        self.native.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_context(self, n_ctx: int, n_batch: int, swa_full: bool) -> NativeContext:
        return NativeContext(self.native, n_ctx=n_ctx, n_batch=n_batch, threads=self.threads, swa_full=swa_full)
