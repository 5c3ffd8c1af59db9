"""The settings a model and its sessions are made with, as typed objects checked when made.

``ModelConfig`` (how the model file runs), ``MemoryConfig`` (its sessions' memory budget) and
``SessionConfig`` (one conversation's settings) are frozen dataclasses: a wrong value is a
``TypeError`` or ``ValueError`` naming it, raised where the object is made, before any model is
loaded. ``Model(path, config=..., memory=..., **overrides)`` and ``model.session(config=...,
**overrides)`` take them; the keyword overrides are typed (``ModelSettings``,
``SessionSettings``), so a type checker sees a misspelled setting. Nothing here loads a library.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar, get_args

from llmsession.options import INT32_MAX, KV_LAYOUTS, KV_TYPES, MAX_POSITIONS, check_int

KvType = Literal["f16", "q8_0", "q4_0"]  # the KV cells' type (``options.KV_TYPES``)
KvLayout = Literal["per_session", "shared"]  # live sessions' cells: their own each, or one pool
MAX_THREADS = 512  # GGML_MAX_N_THREADS
MAX_LIVE_SESSIONS = 256  # LLAMA_MAX_SEQ
MAX_STATELESS_SESSIONS = 1 << 16
LONGEST_WAIT = (2**31 - 1) / 1000 - 1  # seconds: what Connection.poll and a socket take (in ms, an int)
MiB = 1 << 20


# a thinking template's reasoning effort (``SessionConfig.thinking``)
Effort = Literal["low", "medium", "high"]
EFFORTS: tuple[Effort, ...] = get_args(Effort)


def check_thinking(value: object) -> None:
    """A thinking setting: a bool or an effort (a "yes", or an effort misspelled, would be read
    as true); a TypeError otherwise."""
    if not (isinstance(value, bool) or value in EFFORTS):
        raise TypeError(f"thinking must be a bool or one of {list(EFFORTS)}, got {value!r:.40}")


def _check_bool(name: str, value: object, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "a bool"
        raise TypeError(f"{name} must be {allowed}, got {value!r:.40}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r:.40}")


def checked_path(name: str, value: object) -> Path | None:
    """``value`` as a ``Path`` (a str or ``os.PathLike``; None stays None), else a TypeError."""
    if value is None or isinstance(value, Path):
        return value
    if (isinstance(value, str) and value) or isinstance(value, os.PathLike):
        return Path(value)
    raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {value!r:.40}")


@dataclass(frozen=True)
class CheckpointConfig:
    """How many checkpoints a session keeps (newest first) and how often a long prefill takes one.

    Besides every ``every`` positions, a prefill takes one where it starts (the state an edit of
    the newest message resumes from) and one before its last item (where a regenerate resumes).
    ``max_count`` 0 turns checkpoints off. Only recurrent and hybrid models take checkpoints.
    """

    max_count: int = 8
    max_bytes: int = 64 * MiB
    every: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_count", "max_bytes", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"checkpoints: {name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """How a model file runs: its projector, threads and devices, attention and KV cells, how
    its prompts are rendered, and where (this process or a worker).

    ``mmproj_path``: the multimodal projector for images. ``threads``: decode threads (None:
    this machine's default). ``gpu_layers``: layers offloaded (None: all with ``rpc_servers``,
    else none). ``flash_attention`` None is, on the CPU with f16 cells, what a probe of the
    model on this machine found faster (measured once, kept in the cache folder:
    ``runtime.attention``), llama.cpp's choice otherwise. ``kv_type``: the KV cells' type;
    quantized cells need flash attention.
    ``use_jinja`` True or False insists on a renderer (None: the file's template through jinja
    when it renders, else llama.cpp's built-in ones); ``chat_template`` replaces the file's
    (jinja text, a built-in template's name, or a Path to a template file). ``anticipate``:
    decode the next prompt's opening after each reply. ``rpc_servers``: "host:port" of
    llama.cpp RPC servers. ``isolated``: run the model in a worker process (None: with
    ``rpc_servers``), a hang or crash there being a ``BackendError`` within ``worker_timeout``
    seconds. ``stateless_sessions``: conversations ``chat`` and ``complete`` keep (None: 64, or
    four per live session if more; 8 on a recurrent model).
    """

    mmproj_path: Path | None = None
    threads: int | None = None
    gpu_layers: int | None = None
    flash_attention: bool | None = None
    kv_type: KvType = "f16"
    use_jinja: bool | None = None
    chat_template: str | Path | None = None
    anticipate: bool = True
    rpc_servers: tuple[str, ...] = ()
    isolated: bool | None = None
    worker_timeout: float = 60.0
    stateless_sessions: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mmproj_path", checked_path("mmproj_path", self.mmproj_path))
        if self.threads is not None:
            check_int("threads", self.threads, 1, MAX_THREADS)
        if self.gpu_layers is not None:
            check_int("gpu_layers", self.gpu_layers, -1, INT32_MAX)
        _check_bool("flash_attention", self.flash_attention, optional=True)
        _check_choice("kv_type", self.kv_type, KV_TYPES)
        if self.kv_type != "f16" and self.flash_attention is False:
            raise ValueError(
                f"kv_type={self.kv_type!r} quantizes the V cache, which llama.cpp holds only with "
                "flash attention: leave flash_attention on (None or True) or use kv_type='f16'"
            )
        _check_bool("use_jinja", self.use_jinja, optional=True)
        if not (self.chat_template is None or isinstance(self.chat_template, str | Path)):
            raise TypeError(f"chat_template must be a str, a Path or None, got {self.chat_template!r:.40}")
        _check_bool("anticipate", self.anticipate)
        servers = self.rpc_servers
        try:
            listed = () if isinstance(servers, str) else tuple(servers)
        except TypeError:
            listed = ()
        if (not listed and servers) or not all(isinstance(server, str) for server in listed):
            raise TypeError("rpc_servers must be a sequence of 'host:port' strings")
        object.__setattr__(self, "rpc_servers", listed)
        _check_bool("isolated", self.isolated, optional=True)
        timeout = self.worker_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"worker_timeout must be a number of seconds, got {timeout!r:.40}")
        if not timeout > 0:  # (NaN too)
            raise ValueError(f"worker_timeout must be positive, got {timeout!r}")
        # infinity, or any wait longer than a poll or a socket takes (24.8 days), waits for ever
        object.__setattr__(self, "worker_timeout", float(min(timeout, LONGEST_WAIT)))
        if self.stateless_sessions is not None:
            check_int("stateless_sessions", self.stateless_sessions, 1, MAX_STATELESS_SESSIONS)

    @property
    def runs_isolated(self) -> bool:
        """Whether the model runs in a worker process (``isolated``, by default with RPC)."""
        return bool(self.isolated or (self.isolated is None and self.rpc_servers))


@dataclass(frozen=True)
class MemoryConfig:
    """The memory budget every session of a model shares.

    Live sessions share one llama context of ``kv_tokens`` KV cells in up to
    ``max_live_sessions`` sequences. ``kv_tokens`` None gives each live session the model's
    training context (at most 32,768 positions), halved while the cells would take more than
    half the memory available. ``kv_layout`` "per_session" gives each live session
    ``kv_tokens / max_live_sessions`` cells of its own; "shared" pools them. Idle sessions are
    parked in host RAM (up to ``host_cache_bytes``), then on disk in ``disk_cache_dir`` if
    given, else they go cold. ``batch_size`` is the largest prefill batch; ``checkpoints``: what
    a recurrent or hybrid model's sessions keep to rewind to.
    """

    kv_tokens: int | None = None
    max_live_sessions: int = 4
    kv_layout: KvLayout = "per_session"
    host_cache_bytes: int = 1 << 30
    disk_cache_dir: Path | None = None
    batch_size: int = 512
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.kv_tokens is not None:
            check_int("kv_tokens", self.kv_tokens, 16, MAX_POSITIONS)
        check_int("max_live_sessions", self.max_live_sessions, 1, MAX_LIVE_SESSIONS)
        check_int("host_cache_bytes", self.host_cache_bytes, 0, 2**62)
        _check_choice("kv_layout", self.kv_layout, KV_LAYOUTS)
        object.__setattr__(self, "disk_cache_dir", checked_path("disk_cache_dir", self.disk_cache_dir))
        check_int("batch_size", self.batch_size, 1, MAX_POSITIONS)
        if self.checkpoints is None:  # (the default, as earlier versions took it)
            object.__setattr__(self, "checkpoints", CheckpointConfig())
        if not isinstance(self.checkpoints, CheckpointConfig):
            raise TypeError(f"checkpoints must be a CheckpointConfig, got {type(self.checkpoints).__name__}")


@dataclass(frozen=True)
class SessionConfig:
    """One conversation's settings (``model.session(config=...)``, and for ``chat`` and
    ``complete`` the sessions they keep).

    ``system``: the system prompt a new session starts with (``chat`` takes it in its
    messages). ``context_size`` bounds the positions the session uses, prompt and reply (None:
    the model's default context, or what a live session holds if less). ``batch_size``: its
    prefill batch (at most the model's). ``thinking``: the template's thinking mode, True or
    False, or on with a reasoning effort, ``"low"``, ``"medium"`` or ``"high"`` (the template's
    ``reasoning_effort``: gpt-oss's system message says it; other templates read none).
    ``swa_full``: a sliding-window model keeps its full cache (False: the small window cache,
    one live session). ``share_prefix``: it may start from another live session's prefix, and
    others from its (False keeps it apart both ways).
    """

    system: str | None = None
    context_size: int | None = None
    batch_size: int = 512
    thinking: bool | Effort = False
    swa_full: bool = True
    share_prefix: bool = True

    def __post_init__(self) -> None:
        if self.system is not None and not isinstance(self.system, str):
            raise TypeError(f"system must be a str or None, got {type(self.system).__name__}")
        if self.context_size is not None:
            check_int("context_size", self.context_size, 16, MAX_POSITIONS)
        check_int("batch_size", self.batch_size, 1, MAX_POSITIONS)
        check_thinking(self.thinking)
        for name in ("swa_full", "share_prefix"):
            _check_bool(name, getattr(self, name))


class SessionSettings(TypedDict, total=False):
    """``SessionConfig``'s fields but ``system`` as keyword overrides (``model.session(thinking=
    True)``; ``model.session(system)`` takes the system prompt first, a stateless call in its
    messages)."""

    context_size: int | None
    batch_size: int
    thinking: bool | Effort
    swa_full: bool
    share_prefix: bool


class ModelSettings(TypedDict, total=False):
    """``ModelConfig``'s and ``MemoryConfig``'s fields as keyword overrides
    (``Model(path, kv_tokens=4096, threads=2)``)."""

    mmproj_path: Path | str | None
    threads: int | None
    gpu_layers: int | None
    flash_attention: bool | None
    kv_type: KvType
    use_jinja: bool | None
    chat_template: str | Path | None
    anticipate: bool
    rpc_servers: tuple[str, ...] | list[str]
    isolated: bool | None
    worker_timeout: float
    stateless_sessions: int | None
    kv_tokens: int | None
    max_live_sessions: int
    kv_layout: KvLayout
    host_cache_bytes: int
    disk_cache_dir: Path | str | None
    batch_size: int
    checkpoints: CheckpointConfig


Config = TypeVar("Config", ModelConfig, MemoryConfig, SessionConfig)


def overridden(base: Config, overrides: dict[str, Any]) -> Config:
    """``base`` with the overrides its fields name (checked again); the rest are left."""
    names = {f.name for f in dataclasses.fields(base)}
    mine = {name: value for name, value in overrides.items() if name in names}
    return dataclasses.replace(base, **mine) if mine else base


def model_configs(
    config: ModelConfig | None, memory: MemoryConfig | None, overrides: dict[str, Any]
) -> tuple[ModelConfig, MemoryConfig]:
    """A model's two configs with keyword overrides applied; an override neither names is a
    ``TypeError`` (as a misspelled keyword argument is)."""
    config, memory = config or ModelConfig(), memory or MemoryConfig()
    for name, value, kind in (("config", config, ModelConfig), ("memory", memory, MemoryConfig)):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(ModelConfig)} | {
        f.name for f in dataclasses.fields(MemoryConfig)
    }
    if unknown := sorted(set(overrides) - known):
        raise TypeError(f"unknown model setting {unknown[0]!r} (see ModelConfig and MemoryConfig)")
    return overridden(config, overrides), overridden(memory, overrides)


def session_config(config: SessionConfig | None, overrides: dict[str, Any]) -> SessionConfig:
    """A session's config with keyword overrides applied (an unknown one: ``TypeError``)."""
    config = config or SessionConfig()
    if not isinstance(config, SessionConfig):
        raise TypeError(f"config must be a SessionConfig, got {type(config).__name__}")
    if unknown := sorted(set(overrides) - {f.name for f in dataclasses.fields(SessionConfig)}):
        raise TypeError(f"unknown session setting {unknown[0]!r} (see SessionConfig)")
    return overridden(config, overrides)
