"""``Model``: what users hold. It checks the RPC servers once, then holds one of two backends
with the same calls: the model in this process (``runtime.local.LocalModel``) or in a worker
process (``remote.isolated.IsolatedModel``), which survives what kills llama.cpp."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from llmsession.api.backend import Backend
from llmsession.api.completions import RawCompletions
from llmsession.api.prompts import Prompts
from llmsession.config import MemoryConfig, ModelConfig, SessionConfig, model_configs, session_config
from llmsession.errors import UnsupportedFeatureError
from llmsession.options import GenerationOptions, checked_options
from llmsession.replies import Reply

if TYPE_CHECKING:  # (the backends load when a model is opened, not when this is imported)
    import numpy as np
    from typing_extensions import Unpack

    from llmsession.config import KvType, ModelSettings, SessionSettings
    from llmsession.engine.budget import MemoryReport
    from llmsession.runtime.aio import AsyncStream
    from llmsession.runtime.choices import Choices
    from llmsession.runtime.embedding import Inputs
    from llmsession.runtime.face import Session, Stream
    from llmsession.runtime.local import LocalModel
    from llmsession.text.renderer import Renderer


def local_model(model: Model) -> LocalModel:
    """The model in this process behind ``model`` (its engine, native model, prompts), for the
    package's own commands and the tests; a model in a worker process has none here:
    ``UnsupportedFeatureError``. Not part of the public surface."""
    from llmsession.runtime.local import LocalModel

    if not isinstance(model._backend, LocalModel):
        raise UnsupportedFeatureError("this model runs in a worker process: only the public API reaches it")
    return model._backend


T = TypeVar("T")


class Setting(Generic[T]):
    """A setting the model was loaded with, read from its backend (``model.threads``, ...)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, model: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, model: Model, owner: type) -> T: ...
    def __get__(self, model: Model | None, owner: type) -> Setting[T] | T:
        if model is None:
            return self
        value: T = getattr(model._backend, self.name)
        return value

    def __set__(self, model: Model, value: object) -> None:
        raise AttributeError(f"{self.name} is fixed when the model is loaded")


class Model(Prompts, RawCompletions):
    """A model file loaded once; any number of sessions chat with it under one memory budget.

    ``config`` (``ModelConfig``: threads, devices, attention, KV cells, prompts, isolation) and
    ``memory`` (``MemoryConfig``: the KV cells every session shares, parking, checkpoints) say
    how; keyword ``overrides`` set any of their fields (``Model(path, kv_tokens=4096)``), typed
    as ``ModelSettings``. Live sessions share one llama context of ``kv_tokens`` KV cells in up
    to ``max_live_sessions`` sequences; when an exchange needs room, the least recently used
    idle session is parked in host RAM, then on disk, else it goes cold (its next exchange
    decodes its whole prompt). ``memory()`` says what was chosen and where every session's
    state is. Prompts are rendered by the file's own chat template through jinja2 when it
    renders (as Hugging Face and llama-server do), else by llama.cpp's built-in templates
    (``renderer`` says which, and why). With ``rpc_servers`` or ``isolated=True`` the model
    runs in a worker process, so a server that dies or hangs mid-decode is a ``BackendError``
    within ``worker_timeout`` seconds, not the end of this process. ``with Model(path) as
    model:`` frees the model and every session's state on exit.
    """

    threads: Setting[int] = Setting()  # the decode threads (as chosen at load)
    use_jinja: Setting[bool] = Setting()  # whether jinja renders the prompts (as chosen at load)
    renderer: Setting[Renderer] = Setting()  # how prompts are rendered, and why
    flash_attention: Setting[bool | None] = Setting()  # as chosen at load (None: llama.cpp's choice)
    kv_type: Setting[KvType] = Setting()
    anticipate: Setting[bool] = Setting()
    template: Setting[str | None] = Setting()  # the template in use (None: chatml)
    media_marker: Setting[str] = Setting()  # where an image's embeddings go in a rendered prompt
    pooling: Setting[str | None] = Setting()  # an embedding model's (mean, cls, last; rank: a reranker)

    def __init__(
        self,
        path: str | Path,
        *,
        config: ModelConfig | None = None,
        memory: MemoryConfig | None = None,
        **overrides: Unpack[ModelSettings],
    ) -> None:
        from llmsession.native import rpc

        config, memory = model_configs(config, memory, dict(overrides))
        servers = rpc.checked_servers(config.rpc_servers, config.worker_timeout)
        config = dataclasses.replace(config, rpc_servers=tuple(str(endpoint) for endpoint in servers))
        self.config, self.memory_config = config, memory  # as asked (``memory()``: as chosen)
        self.isolated = config.runs_isolated
        self._backend: Backend
        if self.isolated:  # (its worker's LocalModel checks the servers, right before llama.cpp)
            from llmsession.remote.isolated import IsolatedModel

            self._backend = IsolatedModel(path, config, memory)
        else:
            from llmsession.runtime.local import LocalModel

            self._backend = LocalModel(path, config, memory)
        self.path, self.mmproj_path = self._backend.path, self._backend.mmproj_path

    def session(
        self,
        system: str | None = None,
        *,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Session:
        """A new conversation; its KV state lives in the model's shared memory. ``config``
        (``SessionConfig``) and keyword ``overrides`` of its fields say how; ``system``, if
        given, is its system prompt.

        ``context_size`` bounds the positions the session uses (prompt and reply), exactly; it
        may not exceed what a live session holds (``kv_tokens / max_live_sessions`` with
        ``kv_layout="per_session"``, else ``kv_tokens``); default: the model's default context
        (``memory().context_size``), or that if smaller. With ``share_prefix``, an exchange
        that finds the session's memory empty starts from the longest prefix of its prompt
        another live session holds (a common system prompt: its cells are shared, not decoded
        again), and other sessions may start from this one's; ``False`` keeps the session apart
        both ways (its timings then tell nothing of what others said).
        """
        settings: dict[str, Any] = dict(overrides)
        if system is not None:
            settings["system"] = system
        return self._backend.session(session_config(config, settings))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Reply:
        """Answer the last (user) message of a whole message list, reusing the cached prefix of
        an earlier call: a client that resends a growing history decodes only what is new. A
        list that ends with the assistant's text after it has that text continued (a prefill,
        ``Transcript.prefilled``): the reply is what follows the text.
        ``config`` and ``overrides`` are the kept sessions' settings (their system prompt is
        the messages', so ``system`` is refused).

        ``tenant`` names whose call this is (a user, an API key): a call reuses only sessions
        its own tenant's calls left; one named ``owner/name`` shares its owner's fair share of
        the kept sessions with the owner's other names (a server's key owns its users). With
        ``share_prefix=False`` nothing crosses either way: a call without a tenant starts from
        nothing of any other call's, and no call starts from its cells; with a tenant it reuses
        only that tenant's sessions.

        ``conversation`` names the conversation the call continues (a session id its client
        sent, 1 to 256 characters): the session that answers it is labelled so, for
        ``take_conversation``. It never chooses a session: the messages' prefix does."""
        from llmsession.runtime.face import drain

        return drain(
            self.chat_stream(
                messages, options, tenant=tenant, conversation=conversation, config=config, **overrides
            )
        )

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Stream:
        """``chat`` as a stream of snapshots."""
        settings = session_config(config, dict(overrides))
        return self._backend.chat_stream(messages, options, tenant, settings, conversation=conversation)

    def achat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> AsyncStream:
        """``chat_stream`` for asyncio: ``async for snapshot in model.achat_stream(...)``; the
        stream runs in a thread of its own, and cancelling the task cancels the exchange."""
        from llmsession.runtime.aio import AsyncStream

        settings = session_config(config, dict(overrides))
        checked = checked_options(options)  # (here: not in the stream's thread at its first step)
        return AsyncStream(
            lambda: self._backend.chat_stream(messages, checked, tenant, settings, conversation=conversation)
        )

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Reply:
        """``chat`` for asyncio; the event loop runs on while the reply decodes."""
        from llmsession.runtime.aio import adrain

        return await adrain(
            self.achat_stream(
                messages, options, tenant=tenant, conversation=conversation, config=config, **overrides
            )
        )

    def chat_choices(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        n: int,
        tenant: str | None = None,
        conversation: str | None = None,
        config: SessionConfig | None = None,
        **overrides: Unpack[SessionSettings],
    ) -> Choices:
        """``n`` answers to the last message of ``messages`` (OpenAI's ``n``), as ``chat``'s
        calls are routed: the prompt is decoded once, then each choice answers on a fork of its
        state (a copy, not a re-decode), sampling with ``options.seed + i`` so the choices
        differ. Each choice's ``Stream`` starts when first iterated (each may run in a thread of
        its own); ``prompt`` is then the prompt's usage, counted once. On a model in a worker
        process the choices are ``n`` calls."""
        settings = session_config(config, dict(overrides))
        return self._backend.chat_choices(messages, options, tenant, settings, n, conversation=conversation)

    def load_session(self, path: str | Path, **overrides: Unpack[SessionSettings]) -> Session:
        """A session saved with ``Session.save``: its transcript always, its KV cache when it
        belongs to this model and build (else the next reply's ``usage.cache_note`` says why).
        ``overrides`` take the place of its saved settings (``context_size``, ...)."""
        if "system" in overrides:
            raise TypeError("load_session keeps the saved transcript: it takes no system prompt")
        session_config(None, dict(overrides))  # (checked here: an unknown or wrong one is refused)
        return self._backend.load_session(path, dict(overrides))

    def conversations(self) -> list[str]:
        """The ``conversation`` names of the sessions kept for stateless calls, least recently
        used first: what ``take_conversation`` can hand on."""
        return self._backend.conversations()

    def take_conversation(
        self, conversation: str, *, tenants: Collection[str | None] | None = None
    ) -> tuple[Session, str | None] | None:
        """The session kept for the stateless calls that named ``conversation`` (the latest to
        answer one), and its tenant, taken out of the kept ones: the caller owns it (to save it
        for another model's ``keep_conversation``, say, then close it). None if none is kept
        (for one of ``tenants``, unless that is None: whoever's) or it is answering a call now."""
        if tenants is not None:  # (a str is a collection too: of its characters)
            listed = () if isinstance(tenants, str) else tuple(tenants)
            if isinstance(tenants, str) or not all(t is None or isinstance(t, str) for t in listed):
                raise TypeError("tenants must be a collection of str or None")
            tenants = frozenset(listed)
        return self._backend.take_conversation(conversation, tenants)

    def keep_conversation(self, session: Session, *, tenant: str | None, conversation: str) -> None:
        """Keep one of this model's sessions (one loaded with ``load_session``, say) for the
        stateless calls of ``tenant``, named ``conversation``: a call whose messages its cache
        begins decodes only the rest, as if this model had answered the earlier turns. The
        model owns the session from here (it may close it to keep within its bounds): the
        handle passed is closed (an unfinished stream of it finished first), and any later use
        of it raises ``ModelClosedError``, as does keeping a session already closed."""
        if tenant is not None and not isinstance(tenant, str):  # (a list would break every later call)
            raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
        self._backend.keep_conversation(session, tenant, conversation)

    def embed(self, inputs: Inputs, *, normalize: bool = True) -> np.ndarray:
        """Embeddings of ``inputs`` (a str, a list of str, a list of token ids, or a list of
        those) from an embedding model (its GGUF names a pooling: mean, CLS or last), one
        float32 row each, L2-normalized unless not ``normalize``; batched over sequences of a
        context of their own. A chat model raises ``UnsupportedFeatureError``; an input longer
        than the model's context (at most 8,192 tokens), ``ContextOverflowError``; bytes (a
        sequence of ints, which would be read as token ids), ``ValueError``."""
        bytes_like = bytes | bytearray | memoryview
        if isinstance(inputs, bytes_like) or (
            isinstance(inputs, list | tuple) and any(isinstance(item, bytes_like) for item in inputs)
        ):
            raise ValueError("embed takes text as str (decode bytes first), or token ids")
        if not isinstance(normalize, bool):  # (a "no" normalized: any non-empty string is true)
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        return self._backend.embed(inputs, normalize)

    def memory(self) -> MemoryReport:
        """Where every session's state is (live, parked, disk, cold), the budget's use, and the
        counts of parks, restores and drops so far."""
        return self._backend.memory()

    def identity(self) -> str:
        """The model file's sha256 (what a saved KV state belongs to), computed once."""
        return self._backend.identity()

    def projector_identity(self) -> str | None:
        """The projector file's sha256, or None without one."""
        return self._backend.projector_identity()

    def close(self) -> None:
        """Stop every session's stream (each finishes its current step first), free the shared
        memory, then the projector and the model. Any later use of the model or its sessions
        raises ModelClosedError; what stays readable: the model's settings and ``closed``, and
        each session's ``messages``, ``config``, ``closed`` and ``cached_tokens`` (0)."""
        self._backend.close()

    @property
    def closed(self) -> bool:
        """Whether the model was closed (or its worker process is gone)."""
        return self._backend.closed

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
