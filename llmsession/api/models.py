"""``Models``: several model files by name, loaded on demand and unloaded when idle, under one
memory limit: what ``llmsession serve --model NAME=PATH ...`` serves, and what a Python caller
can hold the same way.

- **On demand.** ``acquire(name)`` (or ``with models.use(name) as model:``) loads the model on
  first use; concurrent first uses wait on the same load. A model in use is never unloaded.
- **Bounds.** ``max_loaded`` models at once and ``memory_limit`` bytes in all: a load that would
  pass either first unloads the least recently used idle models, else it is refused
  (``ModelsFullError``, saying what is held) and nothing is unloaded. A model counts its files
  until its first load, then what it measured: files, KV cells, llama.cpp's
  buffers and host cache for parked states.
- **Idle.** ``idle_unload`` seconds after its last use a model unloads; a use's ``keep_alive``
  (Ollama's: seconds, ``0`` unload once idle, ``-1`` keep) replaces that for the model.
- **Conversations survive an unload.** The conversations its stateless calls named
  (``Model.conversations``) are saved with their state before the model closes and kept again
  when it reloads, so a conversation that comes back decodes only its new turn
  (``_parking``). Unnamed ones are dropped with the model.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsession.api import _parking, _sweeper
from llmsession.api.model import Model
from llmsession.api.modelfiles import Entry, ModelFile, ModelStatus, folder_models, kind_of, model_file
from llmsession.config import MemoryConfig, ModelConfig, model_configs
from llmsession.errors import ModelClosedError, ModelLoadError, ModelNotFoundError, ModelsFullError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from llmsession.config import ModelSettings

log = logging.getLogger(__name__)


class Models:
    """Model files by name (``ModelFile`` or a path), loaded on demand (see the module).
    ``config``, ``memory`` and keyword ``overrides`` are every model's settings, as ``Model``
    takes them (a file's projector comes from its ``ModelFile``)."""

    def __init__(
        self,
        models: Mapping[str, ModelFile | str | Path],
        *,
        max_loaded: int | None = None,
        memory_limit: int | None = None,
        idle_unload: float | None = None,
        config: ModelConfig | None = None,
        memory: MemoryConfig | None = None,
        **overrides: Unpack[ModelSettings],
    ) -> None:
        self.config, self.memory = model_configs(config, memory, dict(overrides))
        self.max_loaded = _parking.checked_count("max_loaded", max_loaded)
        self.memory_limit = _parking.checked_count("memory_limit", memory_limit)
        self.idle_unload = _parking.checked_seconds("idle_unload", idle_unload)
        files = {_parking.checked_name(name): model_file(spec) for name, spec in models.items()}
        if not files:
            raise ValueError("Models needs at least one model")
        self._entries = {name: Entry(file) for name, file in files.items()}
        self._changed = threading.Condition()
        self._closed = False
        self._folder = _parking.Folder(self.memory.disk_cache_dir)  # (parked conversations, private)
        swept = (weakref.WeakMethod(self._swept), self._changed)  # (weakly: ``_sweeper``)
        self._sweeper = threading.Thread(
            target=_sweeper.sweeping, args=swept, name="llmsession-models", daemon=True
        )
        self._sweeper.start()
        self._drop = weakref.finalize(self, _sweeper.dropped, self._entries, self._changed, self._folder)

    @classmethod
    def from_folder(cls, folder: str | Path, **kwargs: Any) -> Models:
        """The models of ``folder`` (``files_in``); ``kwargs`` as ``Models`` takes them."""
        return cls(cls.files_in(folder), **kwargs)

    @staticmethod
    def files_in(folder: str | Path) -> dict[str, ModelFile]:
        """Every ``.gguf`` in ``folder`` by its name without the suffix, each with its projector
        when one lies beside it (``NAME.mmproj.gguf`` or ``mmproj-NAME.gguf``)."""
        return folder_models(Path(folder))

    @staticmethod
    def is_name(text: str) -> bool:
        """Whether ``text`` may name a model: 1 to 128 of A-Z a-z 0-9 . _ : / - (no ``..``)."""
        return _parking.is_name(text)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def file(self, name: str) -> ModelFile:
        """The files of model ``name`` (``ModelNotFoundError`` if there is none)."""
        return self._entry(name).file

    def acquire(self, name: str, *, keep_alive: float | None = None) -> Model:
        """Model ``name``, loaded if it is not (waiting for a load already under way), in use
        until ``release(name)``. ``keep_alive``: seconds it stays loaded once idle from now on
        (0: unload once idle; -1: keep). ``ModelsFullError`` if there is no room for it."""
        keep = _parking.checked_keep_alive(keep_alive)
        entry = self._entry(name)
        with self._changed:
            while True:
                if self._closed:
                    raise ModelClosedError("these models were closed")
                self._forget_closed()
                if entry.model is not None and not entry.busy:
                    return self._used(entry, keep)
                failed = entry.failed_load() if not entry.busy else None
                if failed is not None:  # (nothing unloaded for a file that just failed)
                    raise ModelLoadError(str(failed)) from None
                doomed = None if entry.busy else self._room_for(name, entry.footprint)
                if doomed is not None:
                    break
                self._changed.wait()  # (its load, or another's load or unload, under way)
            entry.busy = True
        done = 0
        try:
            for other in doomed:
                self._unload(other)
                done += 1
            model = self._load(entry)
        except BaseException as error:
            with self._changed:
                entry.busy = False
                entry.failing(error, remembered=not self.config.rpc_servers)
                for other in doomed[done + 1 :]:  # (``_unload`` let go of the one that failed)
                    other.busy = False
                self._changed.notify_all()
            raise
        with self._changed:
            entry.busy = False
            self._changed.notify_all()
            closed = self._closed
            if not closed:
                entry.model = model
                used, surplus = self._used(entry, keep), self._surplus()
        if closed:
            model.close()  # (the models were closed while it loaded)
            raise ModelClosedError("these models were closed")
        try:
            self._trim(surplus)
        except BaseException:  # (interrupted: the use granted is given back)
            self.release(name)
            raise
        return used

    def release(self, name: str) -> None:
        """One use of ``name`` is over (its idle time starts once none is left)."""
        entry = self._entry(name)
        with self._changed:
            if entry.users <= 0:
                raise RuntimeError(f"model {name!r} was released more often than acquired")
            entry.users -= 1
            entry.last_used = time.monotonic()
            self._changed.notify_all()  # (the sweeper looks again)

    @contextlib.contextmanager
    def use(self, name: str, *, keep_alive: float | None = None) -> Iterator[Model]:
        """``with models.use(name) as model:`` acquires and releases it."""
        model = self.acquire(name, keep_alive=keep_alive)
        try:
            yield model
        finally:
            self.release(name)

    def load(self, name: str) -> None:
        """Load ``name`` now (an operator's ``POST /models/load``)."""
        self.acquire(name)
        self.release(name)

    def unload(self, name: str) -> bool:
        """Unload ``name`` now, its named conversations parked; False if it is in use (or
        loading), True once it is unloaded (or was not loaded)."""
        entry = self._entry(name)
        with self._changed:
            if entry.model is None and not entry.busy:
                return True
            if not entry.idle:
                return False
            entry.busy = True
        self._unload(entry)
        return True

    def status(self) -> list[ModelStatus]:
        """Every model's state, in the order they were given."""
        now = time.monotonic()
        with self._changed:
            return [self._status(name, entry, now) for name, entry in self._entries.items()]

    def close(self) -> None:
        """Close every loaded model (in-flight uses end with ``ModelClosedError``) and remove
        the parked conversations; idempotent."""
        self._drop.detach()  # (closed here: nothing is left for its collection to close)
        with self._changed:
            if self._closed:
                return
            self._closed = True
            models = [e.model for e in self._entries.values() if e.model is not None]
            for entry in self._entries.values():
                entry.model = None
            self._changed.notify_all()
        self._sweeper.join(30)
        for model in models:
            model.close()
        self._folder.remove()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Models:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------
    def _entry(self, name: str) -> Entry:
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ModelNotFoundError(f"no model named {name!r:.80} (served: {', '.join(self._entries)})")
        return entry

    def _used(self, entry: Entry, keep: float | None) -> Model:
        assert entry.model is not None
        entry.users += 1
        entry.last_used = time.monotonic()
        if keep is not None:
            entry.keep_alive = keep
        return entry.model

    def _forget_closed(self) -> None:
        """Models that closed by themselves (a worker process gone) are unloaded (the lock held)."""
        for entry in self._entries.values():
            if entry.model is not None and entry.model.closed and not entry.busy:
                entry.model, entry.keep_alive = None, None

    def _room_for(self, name: str, needed: int) -> list[Entry] | None:
        """The idle models to unload (least recently used first, marked busy) so that ``name``
        fits; None to wait while another model loads or unloads; ``ModelsFullError`` if no
        choice fits (the lock held)."""
        held = [e for _, e in self._holding()]
        idle = sorted((e for e in held if e.idle), key=lambda e: e.last_used)
        doomed: list[Entry] = []

        def fits(gone: list[Entry]) -> bool:
            kept = [e for e in held if e not in gone]
            count_ok = self.max_loaded is None or len(kept) + 1 <= self.max_loaded
            total = sum(e.footprint for e in kept) + needed
            return count_ok and (self.memory_limit is None or total <= self.memory_limit)

        if not fits([]) and fits([e for e in held if e.unloading]):
            return None  # (the unloads under way leave room: no other idle model need go)
        while not fits(doomed) and idle:
            doomed.append(idle.pop(0))
        if not fits(doomed) and any(e.busy for e in held):
            return None  # (an unload under way may leave room; a load, take it)
        if not fits(doomed):
            held_now = [(other, e.footprint, e.busy) for other, e in self._holding()]
            too_large = self.memory_limit is not None and needed > self.memory_limit
            message = _parking.full_message(name, needed, self.memory_limit, held_now, too_large=too_large)
            raise ModelsFullError(message, too_large=too_large)
        for entry in doomed:
            entry.busy = True
        return doomed

    def _surplus(self, *, warn: bool = True) -> list[Entry]:
        """The idle models to unload (least recently used first, marked busy) so that the ones
        held are within the memory limit again, once a load measured a model larger than its
        files counted (the lock held): right after that load, and by the sweeper once those in
        use are idle (a model over the limit by itself served its first uses, then goes)."""
        if self.memory_limit is None:
            return []
        held = [e for _, e in self._holding() if not e.unloading]
        total = sum(e.footprint for e in held)
        doomed: list[Entry] = []
        for entry in sorted((e for e in held if e.idle), key=lambda e: e.last_used):
            if total <= self.memory_limit:
                break
            doomed.append(entry)
            entry.busy, total = True, total - entry.footprint
        if total > self.memory_limit and warn:
            log.warning("the models loaded take %d MiB, over the memory limit; none is idle", total >> 20)
        return doomed

    def _trim(self, surplus: list[Entry]) -> None:
        """Unload ``surplus`` (``_surplus``): a failure is logged (the load it follows stands);
        interrupted, the ones not begun are no longer busy."""
        done = 0
        try:
            for other in surplus:
                try:
                    self._unload(other)
                except Exception:
                    log.exception("unloading an idle model to keep within the memory limit failed")
                done += 1
        finally:
            if done < len(surplus):
                with self._changed:
                    for other in surplus[done + 1 :]:  # (``_unload`` let go of the one it was in)
                        other.busy = False
                    self._changed.notify_all()

    def _holding(self) -> list[tuple[str, Entry]]:
        """The models that hold memory: loaded, loading or unloading (the lock held)."""
        return [(name, e) for name, e in self._entries.items() if e.model is not None or e.busy]

    def _keep(self, entry: Entry) -> float | None:
        """How long ``entry`` stays loaded once idle (None or negative: kept)."""
        return self.idle_unload if entry.keep_alive is None else entry.keep_alive

    def _load(self, entry: Entry) -> Model:
        file = entry.file
        model = Model(file.path, config=self.config, memory=self.memory, mmproj_path=file.mmproj_path)
        try:
            report = model.memory()
            entry.footprint = _parking.footprint(report, file.path, file.mmproj_path)
            entry.context_size = report.context_size
            entry.pooling = model.pooling
            entry.loads += 1
            entry.parked = _parking.restore(model, entry.parked)
        except BaseException:
            model.close()
            raise
        return model

    def _unload(self, entry: Entry) -> None:
        """Park ``entry``'s named conversations and close its model (it is marked busy)."""
        model = entry.model
        try:
            if model is not None and not model.closed:
                entry.parked = _parking.park(model, self._folder)
        finally:
            try:
                if model is not None:
                    model.close()
            finally:  # (whatever closing raised: never a model left busy for good)
                with self._changed:
                    entry.model, entry.busy, entry.keep_alive = None, False, None
                    self._changed.notify_all()

    def _status(self, name: str, entry: Entry, now: float) -> ModelStatus:
        model = entry.model
        loaded = model is not None and not model.closed
        idle = now - entry.last_used if loaded and entry.users == 0 else None
        keep = self._keep(entry)
        return ModelStatus(
            name=name,
            path=entry.file.path,
            loaded=loaded,
            busy=entry.busy,
            users=entry.users,
            images=entry.file.mmproj_path is not None,
            context_size=entry.context_size if loaded else None,
            resident_bytes=entry.footprint,
            idle_seconds=idle,
            unloads_in=None if idle is None or keep is None or keep < 0 else max(0.0, keep - idle),
            loads=entry.loads,
            kind=None if entry.loads == 0 else kind_of(entry.pooling),
            unloading=entry.unloading,
        )

    def _swept(self) -> float | None:
        """Unload the models idle past their keep-alive (the lock held on entry, and on return);
        the seconds until the next is due (None: none is), or -1 once closed."""
        if self._closed:
            return -1
        due, wait = _sweeper.due(self._entries.values(), self._keep, time.monotonic())
        for entry in due:
            entry.busy = True
        due += self._surplus(warn=False)  # (over the memory limit: the idle go, even one alone)
        if not due:
            return wait
        self._changed.release()
        try:
            for entry in due:
                try:
                    self._unload(entry)
                except Exception:  # (logged: the sweeper must go on)
                    log.exception("unloading an idle model failed")
        finally:
            self._changed.acquire()
        return 0
