"""What ``api.Model`` delegates to: a model in this process (``runtime.local.LocalModel``) or in
a worker process (``remote.isolated.IsolatedModel``), with the same calls."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from llmsession.config import Effort, SessionConfig
    from llmsession.engine.budget import MemoryReport
    from llmsession.options import GenerationOptions
    from llmsession.runtime.choices import Choices
    from llmsession.runtime.embedding import Inputs
    from llmsession.runtime.face import Session, Stream
    from llmsession.text.renderer import Renderer
    from llmsession.text.tools import Tools


class Backend(Protocol):
    """What ``Model`` delegates to; ``LocalModel`` and ``IsolatedModel`` both are one."""

    path: Path
    mmproj_path: Path | None
    threads: int
    use_jinja: bool
    renderer: Renderer
    flash_attention: bool | None
    kv_type: str
    anticipate: bool
    template: str | None
    media_marker: str
    pooling: str | None

    @property
    def closed(self) -> bool: ...
    def session(self, config: SessionConfig) -> Session: ...
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        thinking: bool | Effort = False,
        tools: Tools | None = None,
        tool_format: str | None = None,
    ) -> str: ...
    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def prompt_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool | Effort = False,
        tools: Tools | None = None,
        tool_format: str | None = None,
    ) -> list[int]: ...
    def call_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> list[int]: ...
    def call_size(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> int: ...
    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        conversation: str | None = None,
    ) -> Stream: ...
    def complete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        conversation: str | None = None,
    ) -> Stream: ...
    def chat_choices(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        n: int,
        *,
        conversation: str | None = None,
    ) -> Choices: ...
    def complete_choices(
        self,
        prompt: str,
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        n: int,
        *,
        conversation: str | None = None,
    ) -> Choices: ...
    def load_session(self, path: str | Path, overrides: Mapping[str, Any]) -> Session: ...
    def conversations(self) -> list[str]: ...
    def take_conversation(
        self, conversation: str, tenants: Collection[str | None] | None = None
    ) -> tuple[Session, str | None] | None: ...
    def keep_conversation(self, session: Session, tenant: str | None, conversation: str) -> None: ...
    def memory(self) -> MemoryReport: ...
    def embed(self, inputs: Inputs, normalize: bool = True) -> np.ndarray: ...
    def identity(self) -> str: ...
    def projector_identity(self) -> str | None: ...
    def close(self) -> None: ...
