"""A GGUF model loaded in this process: its native model and projector, the engine that keeps
its sessions' memory, and how a transcript becomes a prompt (rendered, tokenized, with the
replies generated here spliced in as the tokens they were) or a constraint a compiled matcher.

``local.LocalModel`` adds its sessions on top; ``api.Model`` is what users hold."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from llmsession.engine import anticipate
from llmsession.engine.budget import MemoryConfig, MemoryReport
from llmsession.engine.checkpoints import CheckpointConfig
from llmsession.engine.engine import Engine
from llmsession.engine.prompt import Prompt
from llmsession.engine.sessionfile import file_digest
from llmsession.errors import SessionFileError, TemplateError, UnsupportedFeatureError
from llmsession.native import rpc
from llmsession.native.llama import NativeModel, default_threads, usable_cores
from llmsession.native.projector import Projector
from llmsession.options import INT32_MAX, MAX_POSITIONS, GenerationOptions, check_int
from llmsession.text.images import message_images
from llmsession.text.messages import check_messages
from llmsession.text.splice import ReplyTokens, marker, splice, stretches
from llmsession.text.templates import render_prompt

if TYPE_CHECKING:
    import llguidance

    from llmsession.native.constraints import Constraint

log = logging.getLogger("llmsession")
DEFAULT_MEDIA_MARKER = "<__media__>"
MAX_THREADS = 512  # GGML_MAX_N_THREADS
MAX_LIVE_SESSIONS = 256  # LLAMA_MAX_SEQ
STRETCHES = 1024  # tokenized texts between spliced replies, kept for the next prompts


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


def memory_config(
    *,
    kv_tokens: int,
    max_live_sessions: int,
    host_cache_bytes: int,
    disk_cache_dir: str | Path | None,
    batch_size: int,
    checkpoints: CheckpointConfig | None,
) -> MemoryConfig:
    """The memory settings, checked (TypeError or ValueError naming the first wrong one)."""
    check_int("kv_tokens", kv_tokens, 16, MAX_POSITIONS)
    check_int("max_live_sessions", max_live_sessions, 1, MAX_LIVE_SESSIONS)
    check_int("host_cache_bytes", host_cache_bytes, 0, 2**62)
    check_int("batch_size", batch_size, 1, MAX_POSITIONS)
    return MemoryConfig(
        kv_tokens=kv_tokens,
        max_live_sessions=max_live_sessions,
        host_cache_bytes=host_cache_bytes,
        disk_cache_dir=None if disk_cache_dir is None else Path(disk_cache_dir),
        batch_size=min(batch_size, kv_tokens),
        checkpoints=CheckpointConfig() if checkpoints is None else checkpoints,
    )


def checked_threads(threads: int | None) -> int:
    """The decode threads: the caller's (warned about if more than this process may use), or
    a default for this machine."""
    if threads is None:
        return default_threads()
    check_int("threads", threads, 1, MAX_THREADS)
    if threads > (cores := usable_cores()):
        log.warning(
            "threads=%d is more than the %d cores this process may use: llama.cpp's threads wait "
            "for each other at every graph node, so each decode may run hundreds of times slower",
            threads,
            cores,
        )
    return threads


def load_native(
    path: Path, mmproj_path: Path | None, *, gpu_layers: int, threads: int, rpc_servers: Sequence[str]
) -> tuple[NativeModel, Projector | None]:
    """The model, and its projector if given; neither is left open on an error."""
    native = NativeModel(path, gpu_layers=gpu_layers, rpc_servers=rpc_servers)
    if native.has_encoder and (mmproj_path is not None or not native.has_decoder):
        native.close()
        raise UnsupportedFeatureError(
            f"{path.name}: an encoder-decoder model takes no images here"
            if native.has_decoder
            else f"{path.name} is encoder-only: it has no decoder to reply with"
        )
    if mmproj_path is None:
        return native, None
    try:
        use_gpu = gpu_layers != 0 and not rpc_servers
        return native, Projector(mmproj_path, native, threads=threads, use_gpu=use_gpu)
    except BaseException:
        native.close()
        raise


class Shuttable(Protocol):
    def shut(self) -> None: ...


class ModelCore:
    """A model file loaded once, with its engine; see ``api.Model`` for the settings. Sessions
    built on it register in ``sessions`` (its ``close`` stops them first)."""

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
        worker_timeout: float = 60.0,
    ) -> None:
        """``rpc_servers`` ("host:port") are preflighted here, after every other check:
        llama.cpp aborts the process on one that is not there."""
        if gpu_layers is None:  # every layer on the RPC servers' devices, else none offloaded
            gpu_layers = -1 if rpc_servers else 0
        self.threads = checked_threads(threads)
        check_int("gpu_layers", gpu_layers, -1, INT32_MAX)
        config = memory_config(
            kv_tokens=kv_tokens,
            max_live_sessions=max_live_sessions,
            host_cache_bytes=host_cache_bytes,
            disk_cache_dir=disk_cache_dir,
            batch_size=batch_size,
            checkpoints=checkpoints,
        )
        self.path = Path(path)
        self.mmproj_path = None if mmproj_path is None else Path(mmproj_path)
        self.use_jinja = use_jinja
        self.flash_attention = choose_flash_attention(flash_attention)
        self.anticipate = bool(anticipate)
        servers = rpc.preflight_all(rpc.checked_servers(rpc_servers, worker_timeout), worker_timeout)
        self.native, self.projector = load_native(
            self.path, self.mmproj_path, gpu_layers=gpu_layers, threads=self.threads, rpc_servers=servers
        )
        self.engine = Engine(
            self.native, self.projector, self.threads, config, flash_attention=self.flash_attention
        )
        self.engine.warm()
        self.template = self.native.chat_template()
        self.media_marker = self.projector.marker if self.projector else DEFAULT_MEDIA_MARKER
        self.sessions: weakref.WeakSet[Shuttable] = weakref.WeakSet()
        self.replies = ReplyTokens()  # every reply generated here, for splicing
        self._digests: dict[Path, str] = {}
        self._guidance: llguidance.LLTokenizer | None = None
        self._guidance_lock = threading.Lock()
        # Tokenized texts between spliced replies, without and with BOS (``_stretch_tokens``).
        self._stretches = (ReplyTokens(STRETCHES), ReplyTokens(STRETCHES))

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
            return mine or (self.replies.get(content) if shared else None)

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
                self.replies.remember(text, tokens)
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
        from llmsession.native.constraints import Constraint, tokenizer  # (llguidance: loaded when needed)

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

    def memory(self) -> MemoryReport:
        """Where every session's state is (live, parked, disk, cold), the budget's use, and the
        counts of parks, restores and drops so far."""
        return self.engine.memory()

    def close(self) -> None:
        """Stop every session's stream (each finishes its current step first), free the shared
        memory, then the projector and the model. Any later use raises ModelClosedError."""
        for session in list(self.sessions):
            session.shut()
        anticipate.stop_all(self.engine)  # collected sessions' too
        self.engine.close()
        if self.projector is not None:
            self.projector.close()
        self.native.close()

    @property
    def closed(self) -> bool:
        return self.native.closed
