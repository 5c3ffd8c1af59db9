"""``Model``: what users hold. It checks the RPC servers once, then holds one of two backends
with the same calls: the model in this process (``runtime.local.LocalModel``) or in a worker
process (``remote.isolated.IsolatedModel``), which survives what kills llama.cpp."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from llmsession.errors import UnsupportedFeatureError
from llmsession.options import GenerationOptions
from llmsession.replies import Reply

if TYPE_CHECKING:  # (the backends load when a model is opened, not when this is imported)
    from llmsession.engine.budget import MemoryReport
    from llmsession.native.llama import NativeModel
    from llmsession.native.projector import Projector
    from llmsession.runtime.local import LocalModel
    from llmsession.runtime.session import Session
    from llmsession.runtime.stream import Stream
    from llmsession.text.renderer import Renderer


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

    @property
    def closed(self) -> bool: ...
    def session(self, system: str | None = None, **settings: Any) -> Session: ...
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        thinking: bool = False,
    ) -> str: ...
    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], *, thinking: bool = False
    ) -> list[int]: ...
    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **settings: Any,
    ) -> Stream: ...
    def complete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **settings: Any,
    ) -> Stream: ...
    def load_session(self, path: str | Path, **overrides: Any) -> Session: ...
    def memory(self) -> MemoryReport: ...
    def identity(self) -> str: ...
    def projector_identity(self) -> str | None: ...
    def close(self) -> None: ...


class Setting:
    """A setting the model was loaded with, read from its backend (``model.threads``, ...)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, model: Model | None, owner: type) -> Any:
        return self if model is None else getattr(model.backend, self.name)

    def __set__(self, model: Model, value: object) -> None:
        raise AttributeError(f"{self.name} is fixed when the model is loaded")


class Model:
    """A model file loaded once; any number of sessions chat with it under one memory budget.

    Live sessions share one llama context of ``kv_tokens`` KV cells in up to ``max_live_sessions``
    sequences (default 4). ``kv_tokens`` None (default) gives each live session the model's
    training context (at most 32,768 positions), halved while the cells would take more than
    half the memory available (``engine.sizing``; ``memory()`` says what was chosen and what it
    takes); cells asked for that cannot fit in memory are a ValueError. ``kv_layout``
    "per_session" (default) gives each live session
    ``kv_tokens / max_live_sessions`` cells of its own (rounded down to a multiple of 256): its
    attention runs over its own cells only, so other live sessions cost it nothing, and that is
    the most a session holds. "shared" pools the cells: a session may hold all ``kv_tokens``,
    but every decode attends over every cell in use, other sessions' included (at 7 other
    sessions of 1,000 tokens, generation ran at a third of a lone session's speed without flash
    attention). When an exchange needs room, the least recently used idle session is parked in
    host RAM (up to ``host_cache_bytes``, then on disk in ``disk_cache_dir`` if given, else it
    goes cold: its next exchange decodes its whole prompt). ``batch_size`` is the largest prefill
    batch. On recurrent and hybrid models each session keeps ``checkpoints`` of its state so an
    edit or regenerate resumes near the cut instead of from scratch (``CheckpointConfig``).
    ``flash_attention`` None is off on the CPU with f16 cells (a third faster for a prefill at
    depth; a reply then depends on the cache's placement within rounding noise) and llama.cpp's
    choice otherwise (``runtime.loading.choose_flash_attention``). ``kv_type``: the KV cells'
    type, "f16" (default), "q8_0" (half the bytes per cell: a parked state half the size, the
    same memory for twice the ``kv_tokens``) or "q4_0"; quantized cells need flash attention,
    and a saved state reloads only under its own type (else its transcript alone).
    ``anticipate``: after each reply, decode the next prompt's opening in the background
    (``engine.anticipate``). ``rpc_servers`` ("host:port" of
    llama.cpp RPC servers) put the layers (all, unless ``gpu_layers`` says) on other hosts; each
    is checked from Python first (``native.rpc.preflight``). ``isolated`` runs the model in a
    worker process (default: with ``rpc_servers``), so a server that dies or hangs mid-decode is
    a ``BackendError`` within ``worker_timeout`` seconds, not the end of this process
    (``remote.isolated``). ``stateless_sessions``: how many conversations stateless calls
    (``chat``, ``complete``) keep, their states live, parked or cold as the budget decides
    (default: 64, or four per live session if more; 8 on a recurrent model, whose sessions keep
    checkpoints). Prompts are rendered by the file's own chat template through jinja2 (as
    Hugging Face and llama-server do) when jinja renders it, else by llama.cpp's built-in
    templates; a file without a template gets the built-in one of its architecture (Gemma 3:
    Gemma's turns), else ChatML. ``use_jinja`` True or False insists on one renderer;
    ``chat_template`` (jinja text, a built-in template's name such as "gemma", or a Path to a
    template file; jinja text that does not render is a TemplateError) replaces the file's
    (``renderer`` says what was chosen: ``text.renderer``).
    ``with Model(path) as model:`` frees the
    model and every session's state on exit.
    """

    threads = Setting()
    use_jinja = Setting()  # whether jinja renders the prompts (as chosen at load)
    renderer = Setting()  # how prompts are rendered, and why (``text.renderer.Renderer``)
    flash_attention = Setting()
    kv_type = Setting()
    anticipate = Setting()
    template = Setting()  # the chat template in use (text or a llama.cpp built-in's name; None: chatml)
    media_marker = Setting()

    def __init__(
        self,
        path: str | Path,
        *,
        rpc_servers: Sequence[str] = (),
        isolated: bool | None = None,
        worker_timeout: float = 60.0,
        **settings: Any,
    ) -> None:
        """``settings``: ``mmproj_path``, ``gpu_layers``, ``threads``, ``use_jinja``,
        ``chat_template``, ``kv_tokens``, ``max_live_sessions``, ``kv_layout``, ``host_cache_bytes``,
        ``disk_cache_dir``, ``batch_size``, ``checkpoints``, ``flash_attention``, ``kv_type``,
        ``anticipate``, ``stateless_sessions`` (see the class)."""
        from llmsession.native import rpc

        servers = [str(endpoint) for endpoint in rpc.checked_servers(rpc_servers, worker_timeout)]
        self.isolated = bool(isolated or (isolated is None and servers))
        self.backend: Backend
        if self.isolated:  # (its worker's LocalModel checks the servers, right before llama.cpp)
            from llmsession.remote.isolated import IsolatedModel

            self.backend = IsolatedModel(path, worker_timeout=worker_timeout, rpc_servers=servers, **settings)
        else:
            from llmsession.runtime.local import LocalModel

            self.backend = LocalModel(path, rpc_servers=servers, worker_timeout=worker_timeout, **settings)
        self.path, self.mmproj_path = self.backend.path, self.backend.mmproj_path

    @property
    def local(self) -> LocalModel:
        """The model in this process (its engine, native model, prompts); an isolated model has
        none here: ``UnsupportedFeatureError``."""
        from llmsession.runtime.local import LocalModel

        if not isinstance(self.backend, LocalModel):
            raise UnsupportedFeatureError(
                "this model runs in a worker process: only the public API reaches it"
            )
        return self.backend

    @property
    def native(self) -> NativeModel:
        """The loaded llama.cpp model (in-process models only)."""
        return self.local.native

    @property
    def projector(self) -> Projector | None:
        return self.local.projector

    def session(
        self,
        system: str | None = None,
        *,
        context_size: int | None = None,
        batch_size: int = 512,
        thinking: bool = False,
        swa_full: bool = True,
        share_prefix: bool = True,
    ) -> Session:
        """A new conversation; its KV state lives in the model's shared memory.

        ``context_size`` bounds the positions the session uses (prompt and reply), exactly; it
        may not exceed what a live session holds (``kv_tokens / max_live_sessions`` with
        ``kv_layout="per_session"``, else ``kv_tokens``); default: the model's default context
        (``memory().context_size``: its training context, as sized), or that if smaller.
        ``batch_size`` is its prefill batch (at most the model's). With ``share_prefix``, an
        exchange that finds the session's memory empty starts from the longest prefix of its
        prompt another live session holds (a common system prompt: its cells are shared, not
        decoded again), and other sessions may start from this one's; ``False`` keeps the
        session apart both ways (its timings then tell nothing of what others said).
        """
        return self.backend.session(
            system,
            context_size=context_size,
            batch_size=batch_size,
            thinking=thinking,
            swa_full=swa_full,
            share_prefix=share_prefix,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        thinking: bool = False,
    ) -> str:
        """The exact prompt text a session would tokenize for these messages."""
        return self.backend.render(messages, add_generation_prompt, thinking=thinking)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens with special tokens parsed; BOS is added once even if the text starts with it."""
        return self.backend.tokenize(text, add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of token ids; an id outside the vocabulary raises ValueError naming it."""
        return self.backend.detokenize(tokens)

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]], *, thinking: bool = False) -> list[int]:
        """The tokens of a text-only transcript's prompt."""
        return self.backend.prompt_tokens(messages, thinking=thinking)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **session_args: Any,
    ) -> Reply:
        """Answer the last (user) message of a whole message list, reusing the cached prefix of
        an earlier call: a client that resends a growing history decodes only what is new.

        ``tenant`` names whose call this is (a user, an API key): a call reuses only sessions
        its own tenant's calls left. With ``share_prefix=False`` nothing crosses either way: a
        call without a tenant starts from nothing of any other call's, and no call starts from
        its cells; with a tenant it reuses only that tenant's sessions (``StatelessSessions``)."""
        from llmsession.runtime.stream import drain

        return drain(self.chat_stream(messages, options, tenant=tenant, **session_args))

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **session_args: Any,
    ) -> Stream:
        """``chat`` as a stream of snapshots; ``session_args`` as for ``session()``."""
        return self.backend.chat_stream(messages, options, tenant=tenant, **session_args)

    def complete(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **session_args: Any,
    ) -> Reply:
        """Continue ``prompt`` as it is, without the chat template (OpenAI's completions): the
        text is tokenized as given, BOS added as the model adds it. Calls are routed and kept
        apart by ``tenant`` as ``chat`` calls are, so a prompt that grows decodes only its end."""
        from llmsession.runtime.stream import drain

        return drain(self.complete_stream(prompt, options, tenant=tenant, **session_args))

    def complete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **session_args: Any,
    ) -> Stream:
        """``complete`` as a stream of snapshots."""
        return self.backend.complete_stream(prompt, options, tenant=tenant, **session_args)

    def load_session(self, path: str | Path, **overrides: Any) -> Session:
        """A session saved with ``Session.save``: its transcript always, its KV cache when it
        belongs to this model and build (else the next reply's ``usage.cache_note`` says why).
        ``overrides`` take the place of saved ``session()`` arguments (``context_size``, ...)."""
        return self.backend.load_session(path, **overrides)

    def memory(self) -> MemoryReport:
        """Where every session's state is (live, parked, disk, cold), the budget's use, and the
        counts of parks, restores and drops so far."""
        return self.backend.memory()

    def identity(self) -> str:
        """The model file's sha256 (what a saved KV state belongs to), computed once."""
        return self.backend.identity()

    def projector_identity(self) -> str | None:
        return self.backend.projector_identity()

    def close(self) -> None:
        """Stop every session's stream (each finishes its current step first), free the shared
        memory, then the projector and the model. Any later use raises ModelClosedError."""
        self.backend.close()

    @property
    def closed(self) -> bool:
        return self.backend.closed

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
