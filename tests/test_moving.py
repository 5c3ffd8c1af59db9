"""Conversations moving between models with their state (``Model.take_conversation`` /
``keep_conversation``, and the cluster's shared folder, ``cluster.moving`` and ``handoff``),
on real models: the moved conversation's next turn decodes only what is new and answers exactly
as the model it left would have; a file that was changed, forged, sealed for another
conversation or saved from another model is refused and its turn decodes from scratch."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmsession import GenerationOptions, Model, ModelClosedError, SessionConfig
from llmsession.cluster.handoff import Handoff, Tenant
from llmsession.cluster.moving import COPY, COPY_S, MAX_AGE_S, STALE_S, SharedSpill, load_secret

SECRET = b"s" * 32
KEY = "0123456789abcdef0123456789abcdef"
OTHER_KEY = "fedcba9876543210fedcba9876543210"
GREEDY = GenerationOptions(max_tokens=12, temperature=0.0)
KEPT = SessionConfig(share_prefix=False)  # (as the server's calls: kept apart by tenant)
SYSTEM = {"role": "system", "content": "You answer briefly. " * 24}


def opening() -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": "Name three fruits."}]


def next_turn(messages: list[dict[str, Any]], reply: str, question: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


@pytest.fixture(autouse=True)
def own_temp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Claimed copies go to the system's temporary folder: here, one of each test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("temp")))


@pytest.fixture
def second(smollm2_path: Path) -> Iterator[Model]:
    """Another replica's model: the same file, loaded apart."""
    with Model(smollm2_path, threads=2) as model:
        yield model


def fake_session(body: bytes) -> Any:
    """A ``save`` that writes a file ending in its body's sha256, as a session file does."""

    def save(path: Path) -> None:
        path.write_bytes(body + hashlib.sha256(body).digest())

    return save


# -- the shared folder, pure ------------------------------------------------------------------


def test_a_sealed_file_is_claimed_once_with_its_tenant(tmp_path: Path) -> None:
    spill = SharedSpill(tmp_path, SECRET, "replica-a")
    assert spill.put(KEY, "alice", fake_session(b"state"))
    assert spill.put(OTHER_KEY, None, fake_session(b"other"))
    here, there = SharedSpill(tmp_path, SECRET, "b"), SharedSpill(tmp_path, SECRET, "c")
    claimed = here.claim(KEY)
    assert claimed is not None and claimed.tenant == "alice"
    body = b"state"
    assert claimed.path.read_bytes() == body + hashlib.sha256(body).digest()  # (the seal cut off)
    assert there.claim(KEY) is None and here.claim(KEY) is None  # (claimed: gone for everyone)
    other = there.claim(OTHER_KEY)
    assert other is not None and other.tenant is None
    assert here.refused == there.refused == 0


def test_a_claimed_file_is_checked_and_loaded_from_a_private_copy(tmp_path: Path) -> None:
    """Out of reach of anyone who can write the shared folder between the check and the load."""
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert spill.put(KEY, "alice", fake_session(b"state"))
    claimer = SharedSpill(tmp_path, SECRET, "b")
    claimed = claimer.claim(KEY)
    assert claimed is not None and spill.folder not in claimed.path.parents
    assert claimed.path.stat().st_mode & 0o077 == 0  # (a file only this user reads or writes)
    assert not [p for p in spill.folder.iterdir() if not p.name.startswith(".replica-")]
    claimed.path.unlink()  # (the caller's, once loaded: nothing else of the claim is left)
    assert not list(Path(tempfile.gettempdir()).glob(f"llmsession-claimed-{KEY}-*"))
    assert spill.put(KEY, "alice", fake_session(b"state"))
    (spill.folder / f"{KEY}.conversation").write_bytes(b"not sealed")
    assert claimer.claim(KEY) is None and claimer.refused == 1  # (refused: its copy removed too)
    assert not list(Path(tempfile.gettempdir()).glob(f"llmsession-claimed-{KEY}-*"))


def test_a_replica_gives_only_to_one_that_sees_the_folder(tmp_path: Path) -> None:
    here, there = SharedSpill(tmp_path, SECRET, "a"), SharedSpill(tmp_path, SECRET, "b")
    assert not here.sees("b")  # (not announced: its folder may be another host's own)
    there.announce()
    assert here.sees("b") and not here.sees("c")
    assert SharedSpill(tmp_path / "elsewhere", SECRET, "a").sees("b") is False


def test_concurrent_claims_give_the_file_to_one(tmp_path: Path) -> None:
    spill = SharedSpill(tmp_path, SECRET, "a")
    for _ in range(20):
        assert spill.put(KEY, "alice", fake_session(b"x" * 1000))
        got: list[object] = []
        claimers = [SharedSpill(tmp_path, SECRET, f"r{i}") for i in range(4)]
        threads = [threading.Thread(target=lambda s=s, got=got: got.append(s.claim(KEY))) for s in claimers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(claim is not None for claim in got) == 1


@pytest.mark.parametrize("how", ["seal", "checksum", "secret", "renamed", "unsealed", "short"])
def test_a_forged_or_changed_seal_is_refused_and_removed(tmp_path: Path, how: str) -> None:
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert spill.put(KEY, "alice", fake_session(b"state" * 100))
    path = spill.folder / f"{KEY}.conversation"
    data = bytearray(path.read_bytes())
    if how == "seal":  # (another tenant named in the seal)
        data = bytearray(bytes(data).replace(b'"alice"', b'"mallo"'))
    elif how == "checksum":  # (the session file's own checksum, which the seal covers)
        data[500 + 2] ^= 0x01
    elif how == "secret":  # (sealed by someone without this cluster's secret)
        path.unlink()
        assert SharedSpill(tmp_path, b"t" * 32, "x").put(KEY, "alice", fake_session(b"state" * 100))
        data = bytearray(path.read_bytes())
    elif how == "renamed":  # (another conversation's file under this one's name)
        assert spill.put(OTHER_KEY, "alice", fake_session(b"state" * 100))
        data = bytearray((spill.folder / f"{OTHER_KEY}.conversation").read_bytes())
    elif how == "unsealed":  # (a plain session file with a valid checksum)
        data = bytearray(b"state" * 100 + hashlib.sha256(b"state" * 100).digest())
    else:
        data = data[:20]
    path.write_bytes(bytes(data))
    claimer = SharedSpill(tmp_path, SECRET, "b")
    assert claimer.claim(KEY) is None
    assert claimer.refused == 1
    assert not [p for p in spill.folder.iterdir() if KEY in p.name or p.name.startswith(".claimed")]


def test_a_file_swapped_in_while_it_is_saved_is_never_sealed(tmp_path: Path) -> None:
    """Someone who may write the shared folder (not read the secret) replaces the file being
    saved once it is written: the seal covered the checksum read back from it, so their file
    went out sealed for the conversation's tenant. It is saved and sealed apart now."""
    spill = SharedSpill(tmp_path, SECRET, "a")
    forged = b"forged" * 100

    def save_and_swap(path: Path) -> None:
        fake_session(b"state" * 100)(path)
        for hidden in spill.folder.glob(".*"):  # (the writer's files, named in the folder)
            if not hidden.name.startswith(".replica-"):
                theirs = tmp_path / "theirs"
                theirs.write_bytes(forged + hashlib.sha256(forged).digest())
                os.replace(theirs, hidden)

    assert spill.put(KEY, "alice", save_and_swap)
    claimed = SharedSpill(tmp_path, SECRET, "b").claim(KEY)
    assert claimed is not None and claimed.path.read_bytes().startswith(b"state" * 100)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "link to a sealed file", "directory"])
def test_what_is_not_a_plain_file_in_a_conversations_place_is_refused_unread(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO blocked the claim's open forever (a thread and the conversation held); a link to
    ``/dev/zero`` was copied without end; a link is never followed."""
    spill = SharedSpill(tmp_path, SECRET, "a")
    path = spill.folder / f"{KEY}.conversation"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":  # (it raised out of the claim, and stayed for good)
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    else:
        assert spill.put(OTHER_KEY, "alice", fake_session(b"state" * 100))
        path.symlink_to(spill.folder / f"{OTHER_KEY}.conversation")
    claimer = SharedSpill(tmp_path, SECRET, "b")
    got: list[Any] = []
    for tenants in (["alice"], None):  # (read for its tenant first, then claimed)
        thread = threading.Thread(target=lambda t=tenants: got.append(claimer.claim(KEY, t)), daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"a claim of a {kind} never returned"
    assert got == [None, None] and claimer.refused == 1
    assert [p.name for p in spill.folder.iterdir() if not p.name.startswith(".replica")] == (
        [f"{OTHER_KEY}.conversation"] if kind == "link to a sealed file" else []
    )


def test_an_announcement_never_follows_a_link(tmp_path: Path) -> None:
    spill = SharedSpill(tmp_path, SECRET, "a")
    victim = tmp_path / "victim"
    (spill.folder / ".replica-a").symlink_to(victim)
    spill.announce()
    assert not victim.exists() and spill.sees("a")
    assert not (spill.folder / ".replica-a").is_symlink()


def test_the_variant_that_must_pass_an_untouched_file_is_claimed(tmp_path: Path) -> None:
    """The control for the test above: the same file, unchanged, is accepted."""
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert spill.put(KEY, "alice", fake_session(b"state" * 100))
    assert SharedSpill(tmp_path, SECRET, "b").claim(KEY) is not None


def test_names_the_folder_does_not_take_are_never_opened(tmp_path: Path) -> None:
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert not spill.put("../../etc/passwd", "alice", fake_session(b"x"))
    assert not spill.put(KEY, "x" * 600, fake_session(b"x"))  # (a tenant too long to seal)
    assert spill.claim("../" + KEY) is None and spill.claim("*") is None
    assert list(spill.folder.iterdir()) == []


def test_a_newer_file_replaces_an_older_one(tmp_path: Path) -> None:
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert spill.put(KEY, "alice", fake_session(b"old"))
    assert spill.put(KEY, "alice", fake_session(b"new"))
    claimer = SharedSpill(tmp_path, SECRET, "b")
    claimed = claimer.claim(KEY)
    assert claimed is not None and claimed.path.read_bytes().startswith(b"new")


def test_unclaimed_and_abandoned_files_age_out(tmp_path: Path) -> None:
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert spill.put(KEY, "alice", fake_session(b"old"))
    assert spill.put(OTHER_KEY, "alice", fake_session(b"fresh"))
    abandoned = spill.folder / ".claimed-dead-0000"
    abandoned.write_bytes(b"left by a replica that died")
    now = time.time()
    os.utime(spill.folder / f"{KEY}.conversation", (now - MAX_AGE_S - 5, now - MAX_AGE_S - 5))
    os.utime(abandoned, (now - STALE_S - 5, now - STALE_S - 5))
    assert spill.sweep() == 2
    assert [p.name for p in spill.folder.iterdir()] == [f"{OTHER_KEY}.conversation"]


def test_a_claimed_copy_a_killed_process_left_is_swept(tmp_path: Path) -> None:
    """A claimed file is copied to the temporary folder until it is loaded: a replica killed
    meanwhile (a state may be gigabytes) left it there for good. The copy names its process;
    a sweep removes those whose process is gone, never a live one's."""
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert spill.put(KEY, "alice", fake_session(b"state"))
    claimed = spill.claim(KEY)
    assert claimed is not None and claimed.path.name.startswith(f"{COPY}{os.getpid()}-")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = Path(tempfile.gettempdir()) / f"{COPY}{int(gone.stdout)}-left.llmsession"
    dead.write_bytes(b"a state a killed replica was loading")
    saving = Path(tempfile.gettempdir()) / f".{COPY}{int(gone.stdout)}-x.llmsession.y.tmp"
    saving.write_bytes(b"a state a killed replica was saving (the save's own hidden file)")
    unrelated = Path(tempfile.gettempdir()) / f"{COPY}not-a-pid.llmsession"
    unrelated.write_bytes(b"")
    assert spill.sweep() == 0  # (young: it may be a process's this one cannot see, loading it)
    for path in (dead, saving, claimed.path, unrelated):
        os.utime(path, (time.time() - COPY_S - 5, time.time() - COPY_S - 5))
    assert spill.sweep() == 2
    assert not dead.exists() and not saving.exists() and claimed.path.exists() and unrelated.exists()


def test_a_claim_this_replica_cannot_copy_leaves_the_file_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full temporary folder here is not the file's fault: it was counted refused and
    removed from the shared folder, and no replica could restore the conversation."""
    spill = SharedSpill(tmp_path, SECRET, "a")
    assert spill.put(KEY, "alice", fake_session(b"state" * 100))
    full = SharedSpill(tmp_path, SECRET, "b")
    own = tempfile.tempdir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # (mkstemp fails there)
    assert full.claim(KEY) is None and full.refused == 0
    monkeypatch.setattr(tempfile, "tempdir", own)
    assert [p.name for p in spill.folder.iterdir() if not p.name.startswith(".replica")] == [
        f"{KEY}.conversation"
    ]
    assert SharedSpill(tmp_path, SECRET, "c").claim(KEY) is not None


def test_the_secret_is_made_once_and_kept_private(tmp_path: Path) -> None:
    path = tmp_path / "cluster-secret"
    secret = load_secret(path)
    assert len(secret) == 32 and load_secret(path) == secret
    assert path.stat().st_mode & 0o077 == 0 and [p.name for p in tmp_path.iterdir()] == [path.name]
    path.chmod(0o644)
    with pytest.raises(ValueError, match="read by others"):
        load_secret(path)
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="remove it"):
        load_secret(path)


# -- moving conversations between models --------------------------------------------------------


def test_a_conversation_moves_with_its_state_and_answers_as_it_would_have(
    smollm2: Model, second: Model, tmp_path: Path
) -> None:
    """The differential: the same turn answered where the conversation was (its session put
    back) and where it moved (the file loaded): the same tokens, and the moved one decodes only
    the new turn."""
    first = smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert KEY in smollm2.conversations()
    taken = smollm2.take_conversation(KEY)
    assert taken is not None and KEY not in smollm2.conversations()
    session, tenant = taken
    assert tenant == "alice"
    session.save(tmp_path / "moved.llmsession")
    held = session.cached_tokens
    smollm2.keep_conversation(session, tenant="alice", conversation=KEY)  # (stays, for the control)
    moved = second.load_session(tmp_path / "moved.llmsession")
    second.keep_conversation(moved, tenant="alice", conversation=KEY)
    asked = next_turn(opening(), first.text, "And two colours?")
    new_tokens = len(smollm2.prompt_tokens(asked, tenant="alice", config=KEPT)) - held
    scored = GenerationOptions(max_tokens=12, temperature=0.0, logprobs=2)
    stayed = smollm2.chat(asked, scored, tenant="alice", conversation=KEY, config=KEPT)
    there = second.chat(asked, scored, tenant="alice", conversation=KEY, config=KEPT)
    assert there.text == stayed.text and there.logprobs == stayed.logprobs  # (the same numbers)
    assert there.usage.restored_tokens == held > 0
    assert there.usage.decoded_prompt_tokens <= new_tokens + 1
    assert stayed.usage.decoded_prompt_tokens <= new_tokens + 1


def test_a_moved_conversation_stays_its_tenants(smollm2: Model, second: Model, tmp_path: Path) -> None:
    """Kept for alice, it is nothing to bob: his identical call decodes everything."""
    first = smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    taken = smollm2.take_conversation(KEY)
    assert taken is not None
    taken[0].save(tmp_path / "moved.llmsession")
    taken[0].close()
    second.keep_conversation(
        second.load_session(tmp_path / "moved.llmsession"), tenant="alice", conversation=KEY
    )
    asked = next_turn(opening(), first.text, "And two colours?")
    bob = second.chat(asked, GREEDY, tenant="bob", config=KEPT)
    assert bob.usage.reused_tokens == 0
    alice = second.chat(asked, GREEDY, tenant="alice", config=KEPT)
    assert alice.usage.reused_tokens > 0


def test_a_session_of_another_model_is_refused(smollm2: Model, second: Model) -> None:
    session = second.session()
    with pytest.raises(ValueError, match="of this model"):
        smollm2.keep_conversation(session, tenant=None, conversation=KEY)
    session.close()
    with pytest.raises(ValueError, match="256"):
        smollm2.chat(opening(), GREEDY, conversation="x" * 257)


def test_handoff_restores_through_the_shared_folder(smollm2: Model, second: Model, tmp_path: Path) -> None:
    here = Handoff(smollm2, SharedSpill(tmp_path, SECRET, "a"))
    there = Handoff(second, SharedSpill(tmp_path, SECRET, "b"))
    first = smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert there.restore(KEY) is False  # (nothing saved yet)
    assert here.drain(10.0) == 1 and smollm2.conversations() == []
    assert there.restore(KEY) is True and second.conversations() == [KEY]
    assert list(there.spill.folder.iterdir()) == []  # (the claimed file removed once loaded)
    reply = second.chat(next_turn(opening(), first.text, "Why?"), GREEDY, tenant="alice", config=KEPT)
    assert reply.usage.restored_tokens > 0
    assert "llmsession_cluster_conversations_restored_total 1" in there.render()
    assert 'llmsession_cluster_conversations_moved_total{why="drained"} 1' in here.render()


def test_a_changed_state_is_refused_and_the_turn_decodes_it_all(
    smollm2: Model, second: Model, tmp_path: Path
) -> None:
    """The variant that must fail: a byte of the state changed under its seal (the seal holds,
    the session file's checksum does not): refused, and the turn answers from scratch."""
    here = Handoff(smollm2, SharedSpill(tmp_path, SECRET, "a"))
    there = Handoff(second, SharedSpill(tmp_path, SECRET, "b"))
    first = smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert here.give(KEY, "handed")
    path = here.spill.folder / f"{KEY}.conversation"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))
    assert there.restore(KEY) is False and there.moves.refused == 1
    reply = second.chat(next_turn(opening(), first.text, "Why?"), GREEDY, tenant="alice", config=KEPT)
    assert reply.usage.reused_tokens == 0


def test_a_state_of_another_model_is_refused(smollm2: Model, gemma3: Model, tmp_path: Path) -> None:
    """Saved from Gemma 3, offered to SmolLM2: the seal holds, the state does not fit."""
    here = Handoff(gemma3, SharedSpill(tmp_path, SECRET, "a"))
    there = Handoff(smollm2, SharedSpill(tmp_path, SECRET, "b"))
    gemma3.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert here.give(KEY, "handed")
    assert there.restore(KEY) is False and there.moves.refused == 1
    assert KEY not in smollm2.conversations()


def test_a_session_kept_twice_is_kept_once(smollm2: Model) -> None:
    """Keeping a session the model keeps already (a stateless call's, its stream's ``session``)
    only renames it (a second entry would break every later call); a handle kept once is the
    model's, and refused a second time."""
    first = smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    taken = smollm2.take_conversation(KEY)
    assert taken is not None
    smollm2.keep_conversation(taken[0], tenant="alice", conversation=KEY)
    with pytest.raises(ModelClosedError, match="keep_conversation"):
        smollm2.keep_conversation(taken[0], tenant="alice", conversation=OTHER_KEY)
    asked = next_turn(opening(), first.text, "Why?")
    stream = smollm2.chat_stream(asked, GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    for _ in stream:
        pass
    assert (
        stream.reply is not None and stream.session is not None and KEY in smollm2.conversations()
    )  # (the kept one, taken)
    smollm2.keep_conversation(stream.session, tenant="alice", conversation=OTHER_KEY)
    assert smollm2.conversations().count(OTHER_KEY) == 1 and KEY not in smollm2.conversations()
    assert smollm2.take_conversation(OTHER_KEY) is not None
    again = smollm2.chat(next_turn(asked, stream.reply.text, "And?"), GREEDY, tenant="alice", config=KEPT)
    assert again.text


def test_a_holder_past_the_askers_deadline_keeps_the_conversation(smollm2: Model, tmp_path: Path) -> None:
    here = Handoff(smollm2, SharedSpill(tmp_path, SECRET, "a"))
    smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert here.give(KEY, "handed", deadline=time.time() - 1) is False
    assert KEY in smollm2.conversations() and list(here.spill.folder.glob("*.conversation")) == []
    assert "llmsession_cluster_asks_late_total 1" in here.render()


def test_a_holder_that_saves_past_the_deadline_takes_its_file_back(smollm2: Model, tmp_path: Path) -> None:
    """The save outlasts the asker's wait: the file is withdrawn and the conversation stays."""
    here = Handoff(smollm2, SharedSpill(tmp_path, SECRET, "a"))
    smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert here.give(KEY, "handed", deadline=time.time() + 0.001) is False  # (a save takes longer)
    assert KEY in smollm2.conversations() and list(here.spill.folder.glob("*.conversation")) == []
    assert here.moves.given["handed"] == 0


def test_a_conversation_no_tenant_keeps_is_not_counted_restored(
    smollm2: Model, second: Model, tmp_path: Path
) -> None:
    """Kept apart without a tenant, nobody's calls may take it: refused, not restored."""
    here = Handoff(smollm2, SharedSpill(tmp_path, SECRET, "a"))
    there = Handoff(second, SharedSpill(tmp_path, SECRET, "b"))
    session = smollm2.session(share_prefix=False)
    session.respond("Name three fruits.", GREEDY)
    assert here.spill.put(KEY, None, session.save)  # (as if sealed for no tenant)
    smollm2.keep_conversation(session, tenant="alice", conversation=KEY)  # (kept, under alice)
    assert there.restore(KEY) is False and there.moves.refused == 1 and there.moves.restored == 0


def test_a_conversation_moves_only_for_a_request_of_its_tenant(
    smollm2: Model, second: Model, tmp_path: Path
) -> None:
    """Another tenant's request under the same key (one who had seen a response's id, which
    names it) neither takes the conversation from its holder nor claims its saved file: both
    stay for alice's, which moves it."""
    here = Handoff(smollm2, SharedSpill(tmp_path, SECRET, "a"))
    there = Handoff(second, SharedSpill(tmp_path, SECRET, "b"))
    smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert smollm2.take_conversation(KEY, tenants=["bob", None]) is None
    with pytest.raises(TypeError, match="collection of str"):
        smollm2.take_conversation(KEY, tenants="alice")  # (a str: its characters, not a tenant)
    assert here.give(KEY, "handed", asking=Tenant("bob")) is False
    assert here.give(KEY, "handed", asking=Tenant(None)) is False
    assert KEY in smollm2.conversations() and list(here.spill.folder.glob("*.conversation")) == []
    assert here.give(KEY, "handed", asking=Tenant("alice")) is True and smollm2.conversations() == []
    (saved,) = here.spill.folder.glob("*.conversation")
    assert there.restore(KEY, Tenant("bob")) is False and saved.exists()  # (left for alice's)
    assert there.moves.refused == 0 and second.conversations() == []
    assert there.restore(KEY, Tenant("alice")) is True and second.conversations() == [KEY]


def test_a_holder_counts_the_askers_wait_from_the_ask(smollm2: Model, tmp_path: Path) -> None:
    """The ask names when the asker stops waiting: an ask that queued at the holder past it
    is declined (the conversation stays), not saved for an asker that has gone on without it
    (the file would lie unclaimed and the conversation be lost to both)."""
    from llmsession.cluster.peers import Mover

    here = Mover(Handoff(smollm2, SharedSpill(tmp_path, SECRET, "a")), "a", ("engine", "app"))
    SharedSpill(tmp_path, SECRET, "b").announce()
    smollm2.chat(opening(), GREEDY, tenant="alice", conversation=KEY, config=KEPT)
    assert here.surrender(KEY, "a", "b", time.time() - 1, Tenant("alice")) is False
    assert KEY in smollm2.conversations()
    assert here.surrender(KEY, "a", "b", time.time() + 20, Tenant("alice")) is True
    assert smollm2.conversations() == []


def test_a_copys_name_that_reads_as_a_pid_and_is_none_is_let_be() -> None:
    """A name in the temporary folder that ``str.isdigit`` reads as a pid and ``int`` does not (a
    superscript two, anyone's in /tmp) raised out of the sweep of orphaned copies; it is let be,
    as the parking folders' sweep lets such a name be."""
    from llmsession.cluster.moving import COPY, _orphaned_copies

    odd = Path(tempfile.gettempdir()) / f"{COPY}\u00b2-x"
    odd.touch()
    try:
        assert _orphaned_copies(time.time() + 10**6) >= 0 and odd.exists()
    finally:
        odd.unlink()
