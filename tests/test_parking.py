"""The parking lot's disk tier: write-behind into a private folder, served from RAM until
written, no descriptor held per state, discarded writes skipped or removed, a failed write a
miss (never wrong bytes), and nothing left behind: on close, or by a process that was killed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from llmsession.engine import parking
from llmsession.engine.parking import ParkingLot, host_name


def open_fds(under: Path) -> int:
    """This process's descriptors open on files under ``under`` (a count of all of them would
    also see what other tests' threads open meanwhile)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith(str(under))
        except OSError:
            continue  # (closed meanwhile)
    return found


def states(folder: Path) -> list[Path]:
    """The state files in a lot's folder (not its lock, ``parking.ALIVE``)."""
    return [path for path in folder.iterdir() if path.name != parking.ALIVE]


def test_spilled_states_come_back_equal_and_leave_nothing(tmp_path: Path) -> None:
    lot = ParkingLot(tmp_path)
    blobs = {key: os.urandom(1000 + key) for key in range(40)}
    for key, blob in blobs.items():
        lot.park(key, blob)
        assert lot.spill(key)
    assert lot.disk_entries == 40 and lot.disk_bytes == sum(map(len, blobs.values()))
    assert bytes(lot.peek(3) or b"") == blobs[3]  # peek leaves it there
    assert lot.holds(3) == "disk" and bytes(lot.take(3) or b"") == blobs[3] and lot.holds(3) == ""
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith(f"llmsession-{os.getpid()}@{host_name()}-")
    assert open_fds(tmp_path) == 1, "no descriptor is held per state on disk (one: the folder's lock)"
    lot.discard(4)
    lot.close()
    assert lot.disk_entries == 0 and list(tmp_path.iterdir()) == [] and open_fds(tmp_path) == 0


def test_a_state_is_served_from_ram_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, started = threading.Event(), threading.Event()
    write = parking.ParkingLot._write

    def slow_write(self: ParkingLot, *args: Any) -> None:
        started.set()
        assert gate.wait(10)
        write(self, *args)

    monkeypatch.setattr(parking.ParkingLot, "_write", slow_write)
    lot = ParkingLot(tmp_path)
    lot.park("a", b"alpha")
    lot.park("b", b"bravo")
    assert lot.spill("a") and lot.spill("b")  # two writes may be outstanding (MAX_WRITES)
    assert started.wait(10)
    assert lot.holds("a") == "disk" and lot.peek("a") == b"alpha"  # not written yet: from RAM
    lot.discard("b")  # while its write waits: the writer skips it
    outstanding = list(lot._outstanding)
    gate.set()
    lot.park("c", b"charlie")
    assert lot.spill("c")  # waited for the oldest write: the discarded one still counted
    for future in outstanding:
        assert future.done()
    lot.close()  # waits for the writer
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(path: Path) -> Any:
        raise OSError(28, "No space left on device")

    lot = ParkingLot(tmp_path)
    monkeypatch.setattr(parking, "new_file", full)
    lot.park("a", b"alpha")
    assert lot.spill("a")
    assert lot._writer is not None
    lot._writer.submit(lambda: None).result()  # the write has ended
    monkeypatch.undo()
    assert "No space left" in caplog.text
    assert lot.holds("a") == "" and lot.take("a") is None
    lot.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_state_file_that_changed_is_a_miss_never_handed_over(tmp_path: Path, damage: str) -> None:
    lot = ParkingLot(tmp_path)
    blob = os.urandom(5000)
    lot.park("a", blob)
    assert lot.spill("a")
    assert lot._writer is not None
    lot._writer.submit(lambda: None).result()  # the write has ended
    (folder,) = tmp_path.iterdir()
    (path,) = states(folder)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[2500] ^= 0x40
    else:
        del data[-100:]
    path.write_bytes(bytes(data))
    assert lot.holds("a") == "disk" and lot.take("a") is None
    lot.close()


def test_states_go_only_into_a_private_folder_and_come_back_only_from_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The folder taken away (a sweep, a cleaner) is made again, private; one made meanwhile
    that others may enter is not written into (a miss); a state's file swapped for a FIFO is
    a miss, not a read that never ends."""
    lot = ParkingLot(tmp_path)

    def spilled(key: str, blob: bytes) -> None:
        lot.park(key, blob)
        assert lot.spill(key) and lot._writer is not None
        lot._writer.submit(lambda: None).result()  # the write has ended

    spilled("a", b"alpha")
    (folder,) = tmp_path.iterdir()
    shutil.rmtree(folder)
    spilled("b", b"bravo")
    assert folder.stat().st_mode & 0o777 == 0o700 and bytes(lot.peek("b") or b"") == b"bravo"
    shutil.rmtree(folder)
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    spilled("c", b"charlie")
    assert "not a private folder" in caplog.text and lot.holds("c") == "" and not states(folder)
    folder.chmod(0o700)
    spilled("d", b"delta")
    (path,) = states(folder)
    path.unlink()
    os.mkfifo(path)
    began = time.monotonic()
    assert lot.peek("d") is None and time.monotonic() - began < 5
    lot.close()


def test_a_killed_process_folder_is_swept(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f"llmsession-{int(child.stdout)}-abc"
    dead.mkdir()
    (dead / "0.state").write_bytes(b"left by a crash")
    here = tmp_path / f"llmsession-{int(child.stdout)}@{host_name()}-abc"  # (the name it writes now)
    here.mkdir()
    elsewhere = tmp_path / f"llmsession-{int(child.stdout)}@another-host.example-abc"  # its host's to sweep
    elsewhere.mkdir()
    gone = tmp_path / f"llmsession-{int(child.stdout)}@gone-host.example-abc"  # a host long gone
    gone.mkdir()
    os.utime(gone, (time.time() - 8 * 24 * 3600, time.time() - 8 * 24 * 3600))
    mine = tmp_path / f"llmsession-{os.getpid()}-other"  # another lot of this process: kept
    mine.mkdir()
    lot = ParkingLot(tmp_path)
    lot.park("a", b"alpha")
    assert lot.spill("a")
    assert not dead.exists() and not here.exists() and not gone.exists()
    assert mine.exists() and elsewhere.exists()
    lot.close()


def test_a_folder_is_swept_when_its_lock_is_free_whatever_its_name_says(tmp_path: Path) -> None:
    """A server in a container, killed and restarted, has another pid namespace (its old folder
    looked like another host's: kept for a week) or its old pid again (its own: never swept);
    its spilled states, gigabytes a crash, filled the disk. A folder's lock tells now: the system
    lets it go when its process ends. And a name a local user left in /tmp that reads as a pid
    and is none (20 digits, a superscript two) failed every ``Models()`` and spill (an
    OverflowError, a ValueError): such a name is let be."""
    owner, other = ParkingLot(), ParkingLot()  # (what owns a folder: it goes when they do)
    folder, remove = parking.own_folder(tmp_path, owner)  # (this process's: locked)
    assert (folder / parking.ALIVE).exists() and parking.abandoned(folder) is False
    crashed = tmp_path / f"llmsession-{os.getpid()}@{host_name()}.999-x"  # (restarted: its pid again)
    crashed.mkdir()
    (crashed / parking.ALIVE).touch()  # (its lock went with its process)
    (crashed / "1.state").write_bytes(b"left by a crash")
    odd = [tmp_path / "llmsession-99999999999999999999-x", tmp_path / "llmsession-\u00b2-x"]
    for name in odd:
        name.touch()
    parking.sweep(tmp_path)
    assert not crashed.exists() and folder.exists() and all(name.exists() for name in odd)
    again, remove_again = parking.own_folder(tmp_path, other)  # (the sweep it runs first: fine)
    remove()
    remove_again()
    assert not folder.exists() and not again.exists()


def test_a_container_of_the_same_host_name_is_another_host() -> None:
    """Two containers sharing a host name and a disk cache folder, in pid namespaces of their
    own: each saw the other's live processes as gone and removed their folders."""
    space = re.sub(r"[^0-9]", "", os.readlink("/proc/self/ns/pid"))
    assert space and host_name().endswith(f".{space}")
    assert host_name().removesuffix(f".{space}") == re.sub(r"[^A-Za-z0-9.]", "", socket.gethostname())[:64]


def test_without_a_disk_a_spilled_state_is_forgotten() -> None:
    lot = ParkingLot()
    lot.park("a", b"alpha")
    assert not lot.spill("a") and lot.holds("a") == "" and lot.take("a") is None
