"""Which model answers a request: the server's one model whatever the request names (clients
such as Claude Code and Codex name their own models), or, on a server of several
(``llmsession.Models``), the one its ``model`` field names, loaded for it and held until its
last stream ends (``Held``). Each loaded model has its own ``Host``: its admission (its live
sessions) and the server's shared counters."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from llmsession.api.modelfiles import LOAD_RETRY_SECONDS, kind_of
from llmsession.config import SessionConfig
from llmsession.errors import ModelLoadError, ModelNotFoundError, ModelsFullError
from llmsession.serve.chat import Held, Host
from llmsession.serve.errors import ApiError
from llmsession.serve.metrics import Metrics
from llmsession.serve.runner import Admission
from llmsession.serve.tally import Tally, keys_share

if TYPE_CHECKING:
    from llmsession.api.model import Model
    from llmsession.api.modelfiles import ModelStatus
    from llmsession.api.models import Models

log = logging.getLogger("llmsession.serve")


def not_found(name: str | None, names: list[str]) -> ApiError:
    """A 404 for a model not served; a 400 for a request that names none (or not as a string)."""
    if not name:
        return ApiError(f"a model must be named: one of {', '.join(names)}", "model")
    return ApiError(
        f"no model named {name!r:.80}; served: {', '.join(names)}", "model", "model_not_found", 404
    )


def no_room(error: ModelsFullError, name: str) -> ApiError:
    """A 503: the model cannot load now, retried after 5 seconds, unless it is larger than the
    memory limit by itself (no retry helps). What is held, and by whom in use, is the
    operators' to read (logged, and ``/api/ps``): not any tenant's."""
    if error.too_large:
        return ApiError(str(error), "model", "model_too_large", 503, "server_error")
    log.warning("%s", error)
    said = f"model {name!r} cannot load now: the models loaded are in use; retry shortly"
    return ApiError(said, "model", "model_not_loaded", 503, "server_error", 5)


class OneModel:
    """A server of one model, which answers whatever model a request names."""

    def __init__(
        self, model: Model, name: str, settings: SessionConfig, queue: int, metrics: Metrics
    ) -> None:
        admission = Admission(model.memory().max_live_sessions, queue)
        self.host = Host(model, name, settings, admission, metrics)
        self.names, self.metrics = [name], metrics

    def images(self, name: str | None) -> bool:
        return self.host.model.mmproj_path is not None

    def served(self, name: str | None) -> str:
        return self.host.name

    async def held(
        self, name: str | None, keep_alive: float | None, caller: str | None = None
    ) -> tuple[Host, Held]:
        return self.host, Held()

    def cards(self) -> list[dict[str, Any]]:
        model = self.host.model
        kind = kind_of(getattr(model, "pooling", None))  # (what behaves as a model may not say)
        return [card(self.host.name, model.mmproj_path is not None, loaded=not model.closed, kind=kind)]

    def loaded(self) -> list[Model]:
        return [] if self.host.model.closed else [self.host.model]

    @property
    def closed(self) -> bool:
        return self.host.model.closed


class ManyModels:
    """A server of several models (``Models``): a request names one, which loads for it."""

    def __init__(self, models: Models, settings: SessionConfig, queue: int, metrics: Metrics) -> None:
        self.models, self.settings, self.queue, self.metrics = models, settings, queue, metrics
        self.names = models.names
        self._hosts: dict[str, Host] = {}
        # The models the server's settings did not fit, and the others loaded then (their
        # memory may have made it smaller): refused without loading while those stay loaded.
        self._misfits: dict[str, tuple[ApiError, frozenset[str]]] = {}
        self._failures: dict[str, tuple[str, float]] = {}  # (the load failure logged last, and when)
        self._contexts: dict[str, int] = {}  # each model's own context, once it loaded
        self._lock = threading.Lock()
        # One thread a model waits for its load; the other requests for it wait in the event
        # loop (``_turns``), so loads never take the threads that parse bodies and answer.
        self._loader = ThreadPoolExecutor(len(self.names) + 1, thread_name_prefix="llmsession-load")
        self._turns: dict[str, asyncio.Lock] = {}
        self._waiters = Tally()  # by model, and by model and key

    def images(self, name: str | None) -> bool:
        return name in self.models and self.models.file(name or "").mmproj_path is not None

    def served(self, name: str | None) -> str:
        if name is None or name not in self.models:
            raise not_found(name, self.names)
        return name

    async def held(
        self, name: str | None, keep_alive: float | None, caller: str | None = None
    ) -> tuple[Host, Held]:
        """The host of model ``name``, loaded (in a thread; concurrent first requests wait for
        one load) and held until the request's ``Held`` is dropped. At most ``queue`` requests
        wait for one model, a quarter of them a ``caller``'s (its key): a 503 past that (each
        waits holding its parsed request, for as long as a load takes)."""
        served = self.served(name)
        self._misfit(served)
        with self._waiting(served, caller):
            return await self._held(served, name, keep_alive)

    @contextlib.contextmanager
    def _waiting(self, served: str, caller: str | None) -> Iterator[None]:
        share = keys_share(caller, max(1, self.queue // 4))
        with self._waiters.counting(
            (served, self.queue, f"too many requests wait for model {served!r}"),
            ((served, caller), share, f"too many of this key's requests wait for model {served!r}"),
        ):
            yield

    async def _held(self, served: str, name: str | None, keep_alive: float | None) -> tuple[Host, Held]:
        turn = self._turns.setdefault(served, asyncio.Lock())
        await turn.acquire()
        later = False  # (a cancelled wait gives the turn back once the loader thread is done)
        try:
            acquiring = asyncio.get_running_loop().run_in_executor(
                self._loader, lambda: self.models.acquire(served, keep_alive=keep_alive)
            )
            try:
                model = await asyncio.shield(acquiring)
            except asyncio.CancelledError:  # (the client left while it loaded: let go once loaded)
                acquiring.add_done_callback(lambda done: self._gone(done, served, turn))
                later = True
                raise
        except ModelNotFoundError:
            raise not_found(name, self.names) from None
        except ModelsFullError as error:
            raise no_room(error, served) from None
        except ModelLoadError as error:  # (the operator's file: logged; its path is not the client's)
            self._failed(served, error)
            said = f"model {name!r:.80} failed to load on this server (its log says why)"
            raise ApiError(said, "model", "model_load_failed", 500, "server_error", final=True) from None
        finally:
            if not later:
                turn.release()
        held = Held(lambda: self.models.release(served))
        try:
            return self._host(served, model), held
        except ApiError:  # (a misfit: refused as it comes from now on, so not kept loaded)
            held.drop()
            await asyncio.get_running_loop().run_in_executor(self._loader, self.models.unload, served)
            raise
        except BaseException:
            held.drop()
            raise

    def _failed(self, name: str, error: ModelLoadError) -> None:
        """A load failure logged, once while it is remembered (each refused request is not)."""
        said, now = str(error), time.monotonic()
        last = self._failures.get(name)
        if last is None or last[0] != said or now - last[1] >= LOAD_RETRY_SECONDS:
            log.error("model %r failed to load: %s", name, said)
            self._failures[name] = said, now

    def _gone(self, done: asyncio.Future[Model], name: str, turn: asyncio.Lock) -> None:
        turn.release()
        if not done.cancelled() and done.exception() is None:
            self.models.release(name)

    def _host(self, name: str, model: Model) -> Host:
        with self._lock:
            host = self._hosts.get(name)
            if host is None or host.model is not model:  # (loaded again: a new model, a new host)
                try:
                    if model.pooling is None:  # (an embedding model's inputs take its own context)
                        fitting(model, name, self.settings)
                except ApiError as misfit:
                    self._misfits[name] = misfit, self._beside(name)
                    raise
                admission = Admission(model.memory().max_live_sessions, self.queue)
                host = self._hosts[name] = Host(model, name, self.settings, admission, self.metrics)
            return host

    def _misfit(self, name: str) -> None:
        """Refuse ``name`` as it was refused once it loaded, while the models loaded beside it
        then still are (with fewer, it may fit now: it loads and is checked again)."""
        known = self._misfits.get(name)
        if known is None:
            return
        misfit, beside = known
        if beside <= self._beside(name):
            raise dataclasses.replace(misfit)
        del self._misfits[name]

    def _beside(self, name: str) -> frozenset[str]:
        return frozenset(s.name for s in self.models.status() if s.loaded and s.name != name)

    def cards(self) -> list[dict[str, Any]]:
        cards = []
        for status in self.models.status():
            context = self.context_size(status)
            busy = "unloading" if status.unloading else "loading" if status.busy else None
            cards.append(card(status.name, status.images, status.loaded, busy, context, status.kind))
        return cards

    def context_size(self, status: ModelStatus) -> int | None:
        """The context a request of this model gets: the server's setting where it has one (not
        an embedding model's: its inputs take the model's own), else the model's own (None until
        it first loaded; then kept: had it gone with each unload, a tenant's ``/v1/models`` would
        have shown the others' loads and unloads)."""
        if status.context_size is not None:
            self._contexts[status.name] = status.context_size
        own = self._contexts.get(status.name)
        return own if status.kind == "embedding" else self.settings.context_size or own

    def loaded(self) -> list[Model]:
        with self._lock:
            return [host.model for host in self._hosts.values() if not host.model.closed]

    @property
    def closed(self) -> bool:
        return self.models.closed


def fitting(model: Model, name: str, settings: SessionConfig) -> None:
    """The server's session settings checked against a model just loaded (one server's model
    is checked at its start): a misfit is the operator's, a 500 that says what to change."""
    try:
        model.session(config=settings).close()
    except ValueError as error:
        raise ApiError(
            f"model {name!r}: the server's settings do not fit it: {error}", None, None, 500, "server_error"
        ) from None


def card(
    name: str,
    images: bool,
    loaded: bool,
    busy: str | None = None,
    context: int | None = None,
    kind: str | None = "chat",
) -> dict[str, Any]:
    """A model's entry in ``/v1/models``: OpenAI's fields, whether it is loaded (as llama-server's
    router says it: ``status.value``; ``busy``: "loading" or "unloading" now), and what it does
    (``kind``: chat or embedding; None until it has loaded: its file says it)."""
    value = busy if busy == "unloading" or (busy and not loaded) else "loaded" if loaded else "unloaded"
    chat = None if kind is None else kind == "chat"
    embeds = None if kind is None else kind == "embedding"
    capabilities = {"chat": chat, "embeddings": embeds, "images": images}
    capabilities |= {"tools": chat, "json_schema": chat}  # (what a chat model takes; null: unknown yet)
    return {
        "id": name,
        "object": "model",
        "owned_by": "llmsession",
        "status": {"value": value},
        "context_size": context,
        "capabilities": capabilities,
    }
