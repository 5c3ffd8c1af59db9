"""The parent's proxies of an isolated model's sessions and streams (``WorkerSession``,
``WorkerStream``), and the options they send (``portable``): each call one round trip to the
worker through the model that made them (``Host``: ``remote.isolated.IsolatedModel``)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from llmsession.config import SessionConfig
from llmsession.errors import BackendError, ModelClosedError, ReplyMismatchError, SessionBusyError
from llmsession.options import GenerationOptions, checked_options
from llmsession.remote.process import WorkerProcess
from llmsession.replies import Reply, Snapshot
from llmsession.runtime.face import Session, Stream
from llmsession.runtime.readers import CUT, Reader
from llmsession.runtime.said import editable, said_messages
from llmsession.text.messages import check_messages
from llmsession.text.schemas import schema_document
from llmsession.text.tools import tool_from


def absolute(path: str | Path) -> str:
    """A file's path as this process reads it, for a worker (whose working directory is the
    one this had when the model loaded): a text path or a ``PathLike`` of one, as in process."""
    if not isinstance(path, str | os.PathLike) or not isinstance(text := os.fspath(path), str):
        raise TypeError(f"a session file's path must be a str or a Path, got {type(path).__name__}")
    return os.path.abspath(text)


class Host(Protocol):
    """What a proxy needs of its model: its worker, and one operation there at a time."""

    @property
    def worker(self) -> WorkerProcess: ...

    @property
    def closed(self) -> bool: ...

    def call(self, op: str, *args: Any) -> Any: ...


def portable(options: GenerationOptions | None) -> tuple[GenerationOptions | None, type | None]:
    """Options that travel to the worker: a JSON schema as a plain JSON object, checked here as
    in-process (a schema that contains itself is a ``GrammarError``, not a pickling error); a
    pydantic class goes as its schema, and comes back with the reply (``WorkerStream``
    parses ``parsed`` into it here). Tools go as their specs, checked here first."""
    options = checked_options(options)
    if options.tools:
        tools = tuple(tool_from(spec, i).spec() for i, spec in enumerate(options.tools))
        options = dataclasses.replace(options, tools=tools)
    if options.json_schema is None:
        return options, None
    schema_class, document = schema_document(options.json_schema)
    return dataclasses.replace(options, json_schema=document), schema_class


class WorkerSession(Session):
    """A session of an ``IsolatedModel``: its transcript is here, its state in the worker."""

    def __init__(self, model: Host, handle: tuple[int, SessionConfig, list[Any]]) -> None:
        self._model = model
        self._key, config, messages = handle
        self._unseen = False  # a stream of it was dropped unfinished: its exchange is the worker's
        self._streaming: weakref.ref[WorkerStream] | None = None  # its last stream, superseded by the next
        self._sync(messages)
        self._config = config
        self._closed = False
        self._refusal = "this session is closed (or its model keeps it: keep_conversation)"
        weakref.finalize(self, model.worker.tell, None, "drop", (self._key,))

    @property
    def messages(self) -> list[Any]:
        """The transcript; after a stream of it was dropped unfinished, the worker's (read on
        first use), which holds that exchange as in-process, unless it was edited here since."""
        if self._unseen and not self.closed and self._messages == self._synced:
            with contextlib.suppress(BackendError, ModelClosedError):  # (then ours, as it was)
                self._sync(self._model.call("messages", self._key))
            self._unseen = False  # (not before: a Ctrl-C meanwhile leaves it to the next read)
        return self._messages

    @messages.setter
    def messages(self, messages: list[Any]) -> None:
        self._messages = messages

    @property
    def config(self) -> SessionConfig:
        return self._config

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError(self._refusal)

    def stream(self, content: Any, options: GenerationOptions | None = None) -> WorkerStream:
        self._check_open()
        check_messages([*editable(self.messages), *said_messages(content)])  # as in-process, before pickling
        options, schema_class = portable(options)
        edits = self._edits()
        before = self._unfinished()
        if before is not None:  # (the worker finishes it first, even for
            before._owner = None  # a call that fails after: its end, read later, changes nothing here)
            self._unseen = True  # (ours is then the worker's, with its exchange, unless edited here)
        with self._after_failure(edits):
            key, messages = self._model.call("stream", self._key, edits, content, options)
        self._sync(messages)  # with the exchange of an unfinished stream it finished first
        stream = WorkerStream(self._model, self, key, schema_class)
        self._streaming = weakref.ref(stream)
        return stream

    @contextlib.contextmanager
    def _after_failure(self, edits: list[Any] | None) -> Iterator[None]:
        """A call that failed in the worker may have changed its transcript first: taken the
        ``edits`` sent (then the next call sends ours, whatever it is: an edit undone would send
        nothing), or recorded a stream it finished first (then ours is read from it)."""
        try:
            yield
        except BaseException:
            if edits is None:
                self._unseen = True
            else:
                self.forget_sync()
            raise

    def _edits(self) -> list[Any] | None:
        """The transcript if it was changed here since the worker's was last seen, else None:
        the worker's stays (it holds exchanges of streams dropped unfinished, as locally)."""
        self.messages = editable(self.messages)
        return None if self.messages == self._synced else self.messages

    def _sync(self, messages: list[Any]) -> None:
        self.messages, self._synced = messages, copy.deepcopy(messages)

    def forget_sync(self) -> None:
        """The worker's transcript may hold an interrupted exchange: send ours next time."""
        self._synced = None

    _synced: list[Any] | None

    def _unfinished(self) -> WorkerStream | None:
        """Its last stream, if unfinished (the worker finishes it before the next call): one
        another thread or task reads is told so, if its end says it was cut short then
        (``WorkerStream.__next__``: a call that failed before finishing it cut nothing)."""
        before = self._streaming() if self._streaming is not None else None
        if before is None or before._done:
            return None
        before._cut = not (before._cancelled or Reader().same(before._reader))
        return before

    def _session_call(self, name: str, *args: Any) -> Any:
        self._check_open()
        if name != "close":  # (closing finishes it wherever it is read, as in-process)
            self._unfinished()
        edits = self._edits()
        with self._after_failure(edits):
            value, messages = self._model.call("session_call", self._key, edits, name, args)
        self._sync(messages)
        return value

    def clear_cached_context(self) -> None:
        self._session_call("clear_cached_context")

    def fork(self) -> WorkerSession:
        return WorkerSession(self._model, self._session_call("fork"))

    def save(self, path: str | Path) -> None:
        self._session_call("save", absolute(path))

    def close(self) -> None:
        if not self._closed and not self._model.closed:
            try:
                editable(self.messages)
            except TypeError:  # (no exchange can take them: the worker's go unedited, as they are)
                self.messages = copy.deepcopy(self._synced) if self._synced is not None else []
            self._session_call("close")
        self._closed = True

    def kept_by(self, model: Host, tenant: str | None, conversation: str | None) -> None:
        """``model.keep_conversation``: its model keeps it now, no longer this handle's to use."""
        if self._model is not model:
            raise ValueError("keep_conversation takes a session of this model")
        self._check_open()
        self._unfinished()  # (the worker finishes it: its reader, if another, is told)
        model.call("keep_conversation", self._key, tenant, conversation)
        self._closed = True
        self._refusal = "this session was handed to its model (keep_conversation): the model keeps it"

    @property
    def closed(self) -> bool:
        return self._closed or self._model.closed

    @property
    def cached_tokens(self) -> int:
        return 0 if self.closed else int(self._model.call("cached_tokens", self._key))  # (``face``)


class WorkerStream(Stream):
    """A stream whose steps run in the worker, one round trip each (nothing decodes between)."""

    def __init__(
        self,
        model: Host,
        session: WorkerSession | None,
        key: int,
        schema_class: type | None = None,
    ) -> None:
        self.session = self._owner = session  # None for Model.chat_stream: its session is the worker's own
        self._model, self._key, self._schema_class = model, key, schema_class
        self._reply: Reply | None = None
        self._done = self._cancelled = self._cut = self._told = False  # (``_cut``: maybe; ``_told``: so)
        self._reader = Reader()  # (who made it, or took its latest step: ``readers``)
        self._drop = weakref.finalize(self, _dropped, model.worker, session, key)

    @property
    def reply(self) -> Reply | None:
        return self._reply

    def __next__(self) -> Snapshot:
        if self._done:
            if self._told:
                raise SessionBusyError(CUT)
            raise StopIteration
        self._reader.note()
        try:
            kind, *rest = self._model.call("next", self._key)
        except KeyboardInterrupt:  # as in-process: the decode stops, the transcript stays
            self._model.worker.tell("interrupt")
            if self._owner is not None:
                self._owner.forget_sync()
            raise
        if kind == "snapshot":
            snapshot: Snapshot = rest[0]
            return snapshot
        self._end(*rest[:2])
        self._told = self._cut and rest[0].finish_reason == "cancelled"  # (another's call ended it)
        if self._told:
            raise SessionBusyError(CUT)
        if len(rest) > 2:  # (raised once the exchange was recorded: the reply is here too)
            raise rest[2]
        raise StopIteration

    def _end(self, reply: Reply, messages: list[Any]) -> None:
        """The exchange ended in the worker: here too, and the reply parsed into the caller's
        pydantic class (the worker knew its schema only: the class's own validators run here, a
        failure being the GrammarError it is in-process, after the transcript is in step)."""
        self._done = True
        self._drop.detach()
        if self._owner is not None:
            self._owner._sync(messages)
        if self._schema_class is not None and reply.parsed is not None:  # the schema held
            try:
                parsed = self._schema_class.model_validate_json(reply.text)  # type: ignore[attr-defined]
            except ValueError as problem:
                self._reply = dataclasses.replace(reply, parsed=None)
                raise ReplyMismatchError(f"the reply does not match its schema: {problem}") from None
            reply = dataclasses.replace(reply, parsed=parsed)
        self._reply = reply

    def cancel(self) -> None:
        self._cancelled = True
        self._model.worker.tell("cancel", self._key)

    def close(self) -> None:
        if self._done:
            return
        if self._model.closed:  # (as in-process: nothing left to finish; a next step raises)
            self._drop.detach()
            return
        _, reply, messages = self._model.call("close_stream", self._key)
        self._end(reply, messages)


def _dropped(worker: WorkerProcess, session: WorkerSession | None, key: int) -> None:
    """A stream dropped unfinished: the worker finishes it (its session records the exchange
    there), and its session here reads its transcript from the worker next."""
    worker.tell(None, "close_stream", (key,))
    if session is not None:  # (after: a read it makes goes to the worker after the close)
        session._unseen = True
