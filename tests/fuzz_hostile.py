"""The fuzzer's rules for the surface issue 25 hardened: ``share_prefix=False`` calls through
``Model.chat`` (each reuses only what its own tenant left, and shares nothing), constrained
replies at small ``max_tokens`` ("complete" only when the constraint allows nothing more) and
saves to odd paths (refused unless a regular file, nothing changed). A mixin of the state
machine: it acts through ``ShadowedSessions``."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

import internals
from fuzz_env import STATS, env
from fuzz_exchange import ShadowedSessions
from fuzz_inputs import SESSION, TEXTS
from hypothesis import strategies as st
from hypothesis.stateful import rule

from llmsession import GenerationOptions, SessionFileError
from llmsession.text.images import message_images

TENANTS = st.sampled_from([None, "alice", "bob"])
# (options, a regex the whole complete reply matches, whether the constraint can finish by itself)
CONSTRAINTS = (
    ({"json_schema": {"type": "integer"}}, r"-?[0-9]+", False),
    ({"regex": "[0-9]+"}, r"[0-9]+", False),
    ({"regex": "[0-9]{2}"}, r"[0-9]{2}", True),
    ({"json_schema": {"enum": [12, 345]}}, r"12|345", True),
)
ODD_PATHS = st.sampled_from(["device", "fifo", "socket", "directory", "link to a fifo", "link to a file"])


class HostileRules(ShadowedSessions):
    """Rules mixed into ``SessionFuzzer``."""

    def __init__(self) -> None:
        super().__init__()
        self.tenant_totals: dict[str, int] = {}  # the most positions a tenant's calls held

    @rule(content=TEXTS, tenant=TENANTS, max_tokens=st.integers(1, 3))
    def stateless_apart(self, content: str, tenant: str | None, max_tokens: int) -> None:
        """A ``share_prefix=False`` call: without a tenant it reuses nothing; with one, no more
        than its tenant's calls left (and what was decoded ahead after them); never shared."""
        if tenant is not None:  # the model's kept sessions outlive an example: a tenant per example
            tenant = f"{tenant} {STATS.examples}"
        self.note("stateless_apart", content=content, tenant=tenant, max_tokens=max_tokens)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content or "Hi"}]
        options = GenerationOptions(max_tokens=max_tokens, temperature=0)
        usage = env().model.chat(messages, options, share_prefix=False, tenant=tenant).usage
        assert usage.shared_tokens == 0, usage
        own = 0 if tenant is None else self.tenant_totals.get(tenant, 0)
        assert usage.reused_tokens - usage.anticipated_tokens <= own, (usage, tenant, own)
        if tenant is not None:
            held = usage.prompt_tokens + usage.completion_tokens
            self.tenant_totals[tenant] = max(own, held)

    @rule(i=SESSION, which=st.integers(0, len(CONSTRAINTS) - 1), max_tokens=st.integers(1, 4))
    def constrained_short(self, i: int, which: int, max_tokens: int) -> None:
        """A constrained reply at a small ``max_tokens``: "complete" means the whole reply
        matches and the constraint finished (a cut one would be "length", never parsed)."""
        given, pattern, can_finish = CONSTRAINTS[which]
        self.note("constrained_short", i=i, given=given, max_tokens=max_tokens)
        options = GenerationOptions(max_tokens=max_tokens, temperature=0, **given)
        reply = self.exchange(i, "Write the number 1234567.", options)
        if reply is None:  # refused (the context is full): checked by the exchange
            return
        STATS.outcomes[f"constrained {reply.finish_reason}"] += 1
        if reply.finish_reason == "complete":
            assert re.fullmatch(pattern, reply.text), reply
            if "json_schema" in given:
                assert reply.parsed == json.loads(reply.text), reply
            if not can_finish:  # only the model's end token completes it, before the cut
                assert reply.usage.completion_tokens < max_tokens, reply
        else:
            assert reply.parsed is None, reply

    @rule(i=SESSION, kind=ODD_PATHS)
    def save_to_an_odd_path(self, i: int, kind: str) -> None:
        """A save onto something that is not a regular file is refused and changes nothing; a
        symlink to a file writes the file, which loads back the same transcript."""
        self.note("save_to_an_odd_path", i=i, kind=kind)
        self.close_pending(i)
        session = self.sessions[i]
        folder = Path(tempfile.mkdtemp(prefix="fuzz-save-"))
        try:
            path = self._odd_path(folder, kind)
            before = (len(internals.record(session)), internals.placement(session), session.messages)
            if kind == "link to a file":
                session.save(path)
                assert path.is_symlink() and path.resolve().stat().st_size > 0
                loaded = env().model.load_session(path)
                assert same_transcript(loaded.messages, session.messages)
                loaded.close()
            else:
                try:
                    session.save(path)
                except SessionFileError:
                    STATS.outcomes["save refused"] += 1
                else:
                    raise AssertionError(f"a save onto {kind} was accepted")
                assert not path.resolve().is_file(), f"the save replaced the {kind}"
            assert (len(internals.record(session)), internals.placement(session), session.messages) == before
            assert session.messages == self.expected[i]
        finally:
            shutil.rmtree(folder)

    @staticmethod
    def _odd_path(folder: Path, kind: str) -> Path:
        """Never the machine's own ``/dev/null``: a regression would replace it."""
        if kind == "directory":
            return folder
        if kind in ("device", "fifo", "socket", "link to a fifo"):
            return not_a_regular_file(folder, kind.removeprefix("link to a "), link=kind.startswith("link"))
        target = folder / "file"
        target.write_bytes(b"old")
        (folder / "link").symlink_to(target)
        return folder / "link"


def same_transcript(loaded: list[Any], saved: list[Any]) -> bool:
    """A transcript as a file gives it back: JSON's lists for tuples, an image's pixels for its
    path, so compared as the model renders them, and image by image by their pixels."""
    if loaded == saved:
        return True
    model, pixels = env().model, [[image.digest for image in message_images(m)] for m in (loaded, saved)]
    render = functools.partial(model.render, add_generation_prompt=False)
    return render(loaded) == render(saved) and pixels[0] == pixels[1]


def not_a_regular_file(folder: Path, kind: str, link: bool = False) -> Path:
    """A device node (a null device of our own, as root; else a socket), a FIFO or a socket in
    ``folder``, or a symlink to one."""
    path = folder / kind
    if kind == "device" and os.geteuid() == 0:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))
    if not link:
        return path
    (folder / "link").symlink_to(path)
    return folder / "link"
