"""A model run in a worker process (``Model(..., isolated=True)``; the default with
``rpc_servers``): the same public API, and a process that survives what kills llama.cpp.

The parent keeps each session's transcript (an exchange sends it along when it was edited), so
when the worker dies (SIGABRT from a dead RPC server) or stops answering (a decode waiting on a
stopped one for longer than ``worker_timeout``), the call raises ``BackendError``, the
transcript is as it was before that exchange, and a new ``Model`` can take over. Calls into one
worker run one at a time (a stream's ``cancel()`` and the caller's Ctrl-C overtake them); each
step of a stream is one round trip.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmsession.config import MemoryConfig, ModelConfig, SessionConfig
from llmsession.engine.budget import MemoryReport
from llmsession.errors import BackendError, ModelClosedError
from llmsession.options import GenerationOptions, checked_options
from llmsession.remote.process import WorkerProcess
from llmsession.remote.proxies import WorkerSession, WorkerStream, absolute, portable
from llmsession.runtime.choices import Choices, separate
from llmsession.runtime.continuing import check_choices
from llmsession.runtime.embedding import EMBED_INPUTS, is_token, wrong_item
from llmsession.runtime.face import Session, Stream
from llmsession.runtime.stateless_calls import check_answerable, check_stateless, check_tenant, checked_label
from llmsession.text.renderer import Renderer
from llmsession.text.tools import Tools
from llmsession.text.transcript import Transcript

if TYPE_CHECKING:
    from llmsession.runtime.embedding import Inputs

LOAD_TIMEOUT_S = 600.0  # a load sends the weights to the servers: allow for a slow network


def _plain(index: int, item: Any) -> Any:
    """An input's item as the pipe carries it: a str or an int as it is, a sequence of token
    ids (a numpy one's too) as a list; anything else is the in-process ValueError (an object of
    a class the worker cannot import failed its unpickling there, which ended the worker: the
    model closed)."""
    if isinstance(item, str | int):
        return item
    if isinstance(item, Sequence) and all(is_token(x) for x in item):
        return list(item)
    raise wrong_item(index, item)


class IsolatedModel:
    """The worker backend of ``api.Model``: the model's llama.cpp runs in a worker process, and
    this object speaks for it (the same calls as ``runtime.local.LocalModel``)."""

    def __init__(self, path: str | Path, config: ModelConfig, memory: MemoryConfig) -> None:
        """The worker makes a ``LocalModel`` with the same configs."""
        self.path = Path(path)
        self.mmproj_path = config.mmproj_path
        self._worker = WorkerProcess(config.worker_timeout)
        weakref.finalize(self, self._worker.stop)  # dropped unclosed: the worker goes too
        try:
            info = self._worker.call("load", str(path), config, memory, limit=LOAD_TIMEOUT_S)
        except BaseException:
            self._worker.stop()
            raise
        self.threads: int = info["threads"]
        self.use_jinja: bool = info["use_jinja"]
        self.flash_attention: bool | None = info["flash_attention"]
        self.kv_type: str = info["kv_type"]
        self.anticipate: bool = info["anticipate"]
        self.template: str | None = info["template"]
        self.renderer: Renderer = info["renderer"]
        self.pooling: str | None = info["pooling"]
        self.media_marker: str = info["media_marker"]
        self._closed = False

    @property
    def worker(self) -> WorkerProcess:
        """The worker process's parent end (its ``process`` is the ``Popen``)."""
        return self._worker

    def call(self, op: str, *args: Any) -> Any:
        """One operation in the worker (``remote.worker``), unless this model is closed."""
        if self._closed:
            raise ModelClosedError("this model is closed")
        return self._worker.call(op, *args)

    def _model_call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.call("model", name, args, kwargs)

    def session(self, config: SessionConfig) -> WorkerSession:
        return WorkerSession(self, self.call("session", config))

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        transcript = Transcript(messages)  # checked as in-process, before pickling
        return str(self._model_call("render", transcript, add_generation_prompt, **kw))

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self._model_call("tokenize", text, add_special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self._model_call("detokenize", list(tokens)))

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]], **kw: Any) -> list[int]:
        transcript = Transcript(messages)  # checked as in-process, before pickling
        return list(self._model_call("prompt_tokens", transcript, **kw))

    def call_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> list[int]:
        transcript = Transcript(messages)  # checked as in-process, before pickling
        return list(self._model_call("call_tokens", transcript, tenant, config, tools, tool_format))

    def call_size(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str | None,
        config: SessionConfig,
        tools: Tools | None,
        tool_format: str | None,
    ) -> int:
        transcript = Transcript(messages)  # checked as in-process, before pickling
        return int(self._model_call("call_size", transcript, tenant, config, tools, tool_format))

    def embed(self, inputs: Inputs, normalize: bool = True) -> np.ndarray:
        """As in-process: what is not a str, a list of str or token ids, or a list of those is
        the same ValueError (a numpy array's ints or a bare int were a TypeError here)."""
        if isinstance(inputs, str):
            items: Any = inputs
        elif isinstance(inputs, Sequence) and not isinstance(inputs, np.ndarray):
            items = [_plain(index, x) for index, x in enumerate(inputs)]
        else:
            raise ValueError(EMBED_INPUTS)
        # (plain lists, str and ints: what the worker's pipe carries; the worker checks the rest)
        return np.asarray(self._model_call("embed", items, normalize), dtype=np.float32)

    def identity(self) -> str:
        return str(self._model_call("identity"))

    def projector_identity(self) -> str | None:
        value = self._model_call("projector_identity")
        return None if value is None else str(value)

    def memory(self) -> MemoryReport:
        report: MemoryReport = self._model_call("memory")
        return report

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        conversation: str | None = None,
    ) -> Stream:
        transcript = Transcript(messages)  # checked as in-process, before pickling
        options, schema_class = portable(options)
        key = self.call("chat_stream", transcript, options, tenant, config, checked_label(conversation))
        return WorkerStream(self, None, key, schema_class)

    def complete_stream(
        self,
        prompt: str,
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        *,
        conversation: str | None = None,
    ) -> Stream:
        options, schema_class = portable(options)
        key = self.call("complete_stream", prompt, options, tenant, config, checked_label(conversation))
        return WorkerStream(self, None, key, schema_class)

    def chat_choices(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        n: int,
        *,
        conversation: str | None = None,
    ) -> Choices:
        """``n`` stateless calls, each started when first iterated (the worker's sessions are
        not here to fork: each choice decodes the prompt, reusing what its session holds)."""
        check_stateless(config)
        check_tenant(tenant)  # (both now, as a call checks them: not at the first choice)
        checked_label(conversation)
        transcript = Transcript(messages)  # (checked now, as they are now: the calls come later)
        check_choices(transcript)
        check_answerable(transcript)  # (something to answer, as in-process)
        return separate(
            n,
            checked_options(options),
            lambda chosen: self.chat_stream(transcript, chosen, tenant, config, conversation=conversation),
        )

    def complete_choices(
        self,
        prompt: str,
        options: GenerationOptions | None,
        tenant: str | None,
        config: SessionConfig,
        n: int,
        *,
        conversation: str | None = None,
    ) -> Choices:
        check_stateless(config)
        check_tenant(tenant)
        checked_label(conversation)
        return separate(
            n,
            checked_options(options),
            lambda chosen: self.complete_stream(prompt, chosen, tenant, config, conversation=conversation),
        )

    def load_session(self, path: str | Path, overrides: Mapping[str, Any]) -> WorkerSession:
        return WorkerSession(self, self.call("load_session", absolute(path), dict(overrides)))

    def conversations(self) -> list[str]:
        return list(self._model_call("conversations"))

    def take_conversation(
        self, conversation: str, tenants: Collection[str | None] | None = None
    ) -> tuple[WorkerSession, str | None] | None:
        taken = self.call("take_conversation", conversation, None if tenants is None else list(tenants))
        return None if taken is None else (WorkerSession(self, taken[0]), taken[1])

    def keep_conversation(self, session: Session, tenant: str | None, conversation: str) -> None:
        if not isinstance(session, WorkerSession):
            raise ValueError("keep_conversation takes a session of this model")
        session.kept_by(self, tenant, checked_label(conversation))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                if self._worker.failure is None:
                    with contextlib.suppress(BackendError):
                        self._worker.call("close")
            finally:  # (whatever the close raised: the process goes)
                self._worker.stop()

    @property
    def closed(self) -> bool:
        return self._closed or self._worker.failure is not None
