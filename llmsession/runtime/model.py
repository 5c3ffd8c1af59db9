"""A loaded GGUF model: tokenizer, chat rendering, and the factory for sessions."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import llguidance

from llmsession.engine import anticipate
from llmsession.engine.budget import MemoryConfig, MemoryReport
from llmsession.engine.checkpoints import CheckpointConfig
from llmsession.engine.engine import Engine
from llmsession.engine.prompt import Prompt
from llmsession.engine.sessionfile import file_digest
from llmsession.errors import ModelClosedError, SessionFileError, TemplateError, UnsupportedFeatureError
from llmsession.native.constraints import Constraint, tokenizer
from llmsession.native.llama import NativeModel, default_threads, usable_cores
from llmsession.native.projector import Projector
from llmsession.options import INT32_MAX, MAX_POSITIONS, GenerationOptions, check_int
from llmsession.remote import rpc
from llmsession.replies import Reply
from llmsession.runtime.session import Session
from llmsession.runtime.stateless import StatelessPool
from llmsession.runtime.stream import Stream
from llmsession.text.images import message_images
from llmsession.text.messages import check_messages
from llmsession.text.splice import ReplyTokens, marker, splice, stretches
from llmsession.text.templates import render_prompt

log = logging.getLogger("llmsession")
DEFAULT_MEDIA_MARKER = "<__media__>"
MAX_THREADS = 512  # GGML_MAX_N_THREADS
MAX_LIVE_SESSIONS = 256  # LLAMA_MAX_SEQ
STRETCHES = 1024  # tokenized texts between spliced replies, kept for the next prompts
STATELESS_SESSIONS = 8  # sessions kept for Model.chat (their states live, parked or cold)


def choose_flash_attention(asked: bool | None) -> bool | None:
    """None leaves llama.cpp its choice (AUTO: on wherever supported, the CPU included). Off is
    faster for the prefill at depth on the CPU (``llama-bench -fa 0,1 -p 29 -d 993``: 246 vs 182
    tok/s on an AMD EPYC; 199 vs 152 for our own prefill on an Intel Xeon), but then a reply
    depends on where its session's cells lie in the shared cache (the kernels' sums change with
    the placement), so two sessions with one transcript may answer differently; with it on they
    have answered alike in every differential test. ``llmsession bench kernels`` measures both."""
    if asked is not None and not isinstance(asked, bool):
        raise TypeError(f"flash_attention must be True, False or None, got {asked!r}")
    return asked


class Model:
    """A model file loaded once; any number of sessions chat with it under one memory budget.

    Live sessions share one llama context of ``kv_tokens`` KV cells in up to ``max_live_sessions``
    sequences; when an exchange needs room, the least recently used idle session is parked in
    host RAM (up to ``host_cache_bytes``, then on disk in ``disk_cache_dir`` if given, else it
    goes cold: its next exchange decodes its whole prompt). ``batch_size`` is the largest prefill
    batch. On recurrent and hybrid models each session keeps ``checkpoints`` of its state so an
    edit or regenerate resumes near the cut instead of from scratch (``CheckpointConfig``).
    ``flash_attention`` None is llama.cpp's choice (on); False is a third faster for a prefill at
    depth on the CPU, at the price of replies that depend on the cache's placement
    (``choose_flash_attention``). ``anticipate``: after each reply, decode the next prompt's
    opening in the background (``anticipate``). ``rpc_servers`` ("host:port" of llama.cpp RPC
    servers) put the layers (all, unless ``gpu_layers`` says) on other hosts; each is checked
    from Python first (``rpc.preflight``). ``isolated`` runs the model in a worker process
    (default: with ``rpc_servers``), so a server that dies or hangs mid-decode is a
    ``BackendError`` within ``worker_timeout`` seconds, not the end of this process
    (``isolated``). ``with Model(path) as model:`` frees the model and every session's state on
    exit.
    """

    def __new__(cls, path: str | Path, **kwargs: Any) -> Model:
        """An ``isolated.IsolatedModel`` when asked for, or by default with ``rpc_servers``."""
        isolated = kwargs.get("isolated")
        if cls is Model and (isolated or (isolated is None and kwargs.get("rpc_servers"))):
            from llmsession.remote.isolated import IsolatedModel

            return super().__new__(IsolatedModel)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | Path,
        *,
        mmproj_path: str | Path | None = None,
        gpu_layers: int | None = None,
        threads: int | None = None,
        use_jinja: bool = False,
        kv_tokens: int = 8192,
        max_live_sessions: int = 8,
        host_cache_bytes: int = 1 << 30,
        disk_cache_dir: str | Path | None = None,
        batch_size: int = 512,
        checkpoints: CheckpointConfig | None = None,
        flash_attention: bool | None = None,
        anticipate: bool = True,
        rpc_servers: Sequence[str] = (),
        isolated: bool | None = None,
        worker_timeout: float = 60.0,
    ) -> None:
        servers = rpc.checked_servers(rpc_servers, worker_timeout)
        if gpu_layers is None:  # every layer on the RPC servers' devices, else none offloaded
            gpu_layers = -1 if servers else 0
        if threads is not None:
            check_int("threads", threads, 1, MAX_THREADS)
        check_int("gpu_layers", gpu_layers, -1, INT32_MAX)
        check_int("kv_tokens", kv_tokens, 16, MAX_POSITIONS)
        check_int("max_live_sessions", max_live_sessions, 1, MAX_LIVE_SESSIONS)
        check_int("host_cache_bytes", host_cache_bytes, 0, 2**62)
        check_int("batch_size", batch_size, 1, MAX_POSITIONS)
        config = MemoryConfig(
            kv_tokens=kv_tokens,
            max_live_sessions=max_live_sessions,
            host_cache_bytes=host_cache_bytes,
            disk_cache_dir=None if disk_cache_dir is None else Path(disk_cache_dir),
            batch_size=min(batch_size, kv_tokens),
            checkpoints=CheckpointConfig() if checkpoints is None else checkpoints,
        )
        self.path = Path(path)
        self.mmproj_path = None if mmproj_path is None else Path(mmproj_path)
        self._digests: dict[Path, str] = {}
        self.threads = threads or default_threads()
        if self.threads > (cores := usable_cores()):
            log.warning(
                "threads=%d is more than the %d cores this process may use: llama.cpp's threads wait "
                "for each other at every graph node, so each decode may run hundreds of times slower",
                self.threads,
                cores,
            )
        self.use_jinja = use_jinja
        self.flash_attention = choose_flash_attention(flash_attention)
        self.anticipate = bool(anticipate)
        reachable = rpc.preflight_all(servers, worker_timeout)  # llama.cpp aborts on one that is not
        self.native = NativeModel(self.path, gpu_layers=gpu_layers, rpc_servers=reachable)
        self.projector: Projector | None = None
        if self.native.has_encoder and (mmproj_path is not None or not self.native.has_decoder):
            self.native.close()
            raise UnsupportedFeatureError(
                f"{self.path.name}: an encoder-decoder model takes no images here"
                if self.native.has_decoder
                else f"{self.path.name} is encoder-only: it has no decoder to reply with"
            )
        if mmproj_path is not None:
            try:
                self.projector = Projector(
                    mmproj_path, self.native, threads=self.threads, use_gpu=gpu_layers != 0 and not servers
                )
            except BaseException:
                self.native.close()
                raise
        self._engine = Engine(
            self.native, self.projector, self.threads, config, flash_attention=self.flash_attention
        )
        self._engine.warm()
        self.template = self.native.chat_template()
        self.media_marker = self.projector.marker if self.projector else DEFAULT_MEDIA_MARKER
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._stateless = StatelessPool(self, capacity=STATELESS_SESSIONS)
        self._replies = ReplyTokens()
        self._guidance: llguidance.LLTokenizer | None = None
        self._guidance_lock = threading.Lock()
        # Tokenized texts between spliced replies, without and with BOS (``_stretch_tokens``).
        self._stretches = (ReplyTokens(STRETCHES), ReplyTokens(STRETCHES))

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
        may not exceed the model's ``kv_tokens`` (default: 4,096, or ``kv_tokens`` if smaller).
        ``batch_size`` is its prefill batch (at most the model's). With ``share_prefix``, an
        exchange that finds the session's memory empty starts from the longest prefix of its
        prompt another live session holds (a common system prompt: its cells are shared, not
        decoded again), and other sessions may start from this one's; ``False`` keeps the
        session apart both ways (its timings then tell nothing of what others said).
        """
        if self.closed:
            raise ModelClosedError("this model is closed")
        session = Session(
            self,
            system=system,
            context_size=context_size,
            batch_size=batch_size,
            thinking=thinking,
            swa_full=swa_full,
            share_prefix=share_prefix,
        )
        self._sessions.add(session)
        return session

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        thinking: bool = False,
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
        if add_special:
            self._drop_double_bos(tokens)
        return tokens

    def _drop_double_bos(self, tokens: list[int]) -> None:
        bos = self.native.bos()
        if self.native.add_bos and len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
            del tokens[0]

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of token ids; an id outside the vocabulary raises ValueError naming it."""
        return self.native.detokenize(tokens)

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]], *, thinking: bool = False) -> list[int]:
        """The tokens of a text-only transcript's prompt."""
        return self._text_tokens(messages, self.render(messages, thinking=thinking), thinking)

    def _text_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        text: str,
        thinking: bool,
        own: ReplyTokens | None = None,
        shared: bool = True,
    ) -> list[int]:
        """``text`` (the rendered ``messages``) tokenized, with the replies this model generated
        as the tokens it generated (``splice``) when that spells exactly the same text; a
        session's ``own`` replies first (another session may have said the same words otherwise),
        and only those unless ``shared``: how a prompt splits would tell what others were told."""

        def recorded(content: str) -> tuple[int, ...] | None:
            mine = own.get(content) if own is not None else None
            return mine or (self._replies.get(content) if shared else None)

        known = {
            i: tokens
            for i, m in enumerate(messages)
            if m.get("role") == "assistant"
            and isinstance(m.get("content"), str)
            and (tokens := recorded(m["content"])) is not None
        }
        if not known:
            return self.tokenize(text)
        marked = [{**m, "content": marker(i)} if i in known else m for i, m in enumerate(messages)]
        try:
            around = stretches(self.render(marked, thinking=thinking), list(known))
        except TemplateError:  # a template that cannot take the stand-ins: no splice
            return self.tokenize(text)
        if around is None:
            return self.tokenize(text)
        contents = [messages[i]["content"] for i in known]
        if "".join(a + c for a, c in zip(around, [*contents, ""], strict=True)) != text:
            return self.tokenize(text)
        # A prompt kept apart tokenizes its stretches afresh: how fast a remembered one came back
        # would tell whether another prompt held the same text.
        stretch_tokens = self._stretch_tokens if shared else self.tokenize
        spliced = splice(around, list(known.values()), stretch_tokens)
        spelled = self.native.detokenize(spliced, special=True)
        if spelled == text:  # exactly the rendered text
            return spliced
        plain = self.tokenize(text)  # (a tokenizer that adds BOS or spaces spells it otherwise)
        if spliced != plain and spelled == self.native.detokenize(plain, special=True):
            return spliced
        return plain

    def _stretch_tokens(self, stretch: str, first: bool) -> list[int]:
        """``tokenize`` for the text between spliced replies, remembered: a transcript's earlier
        stretches come back every turn, and tokenizing was most of a prompt's cost (7.9 ms of a
        933-token one, before)."""
        remembered = self._stretches[first]
        tokens = remembered.get(stretch)
        if tokens is None:
            tokens = tuple(self.tokenize(stretch, first))
            remembered.remember(stretch, tokens)
        return list(tokens)

    def remember_reply(
        self, text: str, tokens: Sequence[int], own: ReplyTokens | None = None, shared: bool = True
    ) -> None:
        """A reply generated here: later prompts hold it as ``tokens`` if they spell ``text``
        (in the session's ``own`` record too, which its prompts consult first; only there
        unless ``shared``)."""
        if tokens and self.native.detokenize(tokens) == text:
            if shared:
                self._replies.remember(text, tokens)
            if own is not None:
                own.remember(text, tokens)

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool = False,
        own: ReplyTokens | None = None,
        shared: bool = True,
    ) -> Prompt:
        """The tokenized prompt for a transcript; images go through the projector. Replies are
        spliced from ``own``, and from every session's unless not ``shared``."""
        check_messages(messages)
        images = list(message_images(messages))
        if images and self.projector is None:
            raise UnsupportedFeatureError(
                "this model has no multimodal projector, so it cannot take images: "
                "load one with Model(path, mmproj_path=...)"
            )
        began = time.perf_counter()
        text = self.render(messages, thinking=thinking)
        rendered = time.perf_counter()
        if not images:
            prompt = Prompt([self._text_tokens(messages, text, thinking, own, shared)])
            prompt.render_s, prompt.tokenize_s = rendered - began, time.perf_counter() - rendered
            return prompt
        assert self.projector is not None
        chunks = self.projector.tokenize(text, images)
        if chunks.pieces and isinstance(chunks.pieces[0], list):
            self._drop_double_bos(chunks.pieces[0])
        return Prompt(chunks.pieces, chunks, rendered - began, time.perf_counter() - rendered)

    def constraint(self, options: GenerationOptions) -> Constraint | None:
        """The options' constraint compiled for this model (GrammarError if it cannot be used);
        the matcher's tokenizer is built on first use, once."""
        if not options.constrained:
            return None
        with self._guidance_lock:
            if self._guidance is None:
                self._guidance = tokenizer(self.native)
        return Constraint.compile(options, self._guidance)

    def identity(self) -> str:
        """The model file's sha256 (what a saved KV state belongs to), computed once."""
        return self._digest(self.path)

    def projector_identity(self) -> str | None:
        return None if self.mmproj_path is None else self._digest(self.mmproj_path)

    def _digest(self, path: Path) -> str:
        if path not in self._digests:
            try:
                self._digests[path] = file_digest(path)
            except OSError as error:  # moved or deleted since it was loaded
                raise SessionFileError(f"cannot read {path} to identify it: {error}") from None
        return self._digests[path]

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
        its cells; with a tenant it reuses only that tenant's sessions (``StatelessPool``)."""
        stream = self.chat_stream(messages, options, tenant=tenant, **session_args)
        for _ in stream:
            pass
        assert stream.reply is not None
        return stream.reply

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None = None,
        *,
        tenant: str | None = None,
        **session_args: Any,
    ) -> Stream:
        """``chat`` as a stream of snapshots; ``session_args`` as for ``session()``."""
        return self._stateless.stream(messages, options, tenant, **session_args)

    def load_session(self, path: str | Path, **overrides: Any) -> Session:
        """A session saved with ``Session.save``: its transcript always, its KV cache when it
        belongs to this model and build (else the next reply's ``usage.cache_note`` says why).
        ``overrides`` take the place of saved ``session()`` arguments (``context_size``, ...)."""
        from llmsession.runtime.persistence import load

        return load(self, path, **overrides)

    def memory(self) -> MemoryReport:
        """Where every session's state is (live, parked, disk, cold), the budget's use, and the
        counts of parks, restores and drops so far."""
        return self._engine.memory()

    def close(self) -> None:
        """Stop every session's stream (each finishes its current step first), free the shared
        memory, then the projector and the model. Any later use raises ModelClosedError."""
        self._stateless.close()
        for session in list(self._sessions):
            session._shut()
        anticipate.stop_all(self._engine)  # collected sessions' too
        self._engine.close()
        if self.projector is not None:
            self.projector.close()
        self.native.close()

    @property
    def closed(self) -> bool:
        return self.native.closed

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
