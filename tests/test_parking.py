"""The parking lot's disk tier: write-behind to unnamed files, served from RAM until written, no
descriptor left open on any path, a failed write a miss (never wrong bytes)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from llmsession import parking
from llmsession.parking import ParkingLot


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_spilled_states_come_back_equal_and_leave_nothing(tmp_path: Path) -> None:
    before = open_fds()
    lot = ParkingLot(tmp_path)
    blobs = {key: os.urandom(1000 + key) for key in range(6)}
    for key, blob in blobs.items():
        lot.park(key, blob)
        assert lot.spill(key)
    assert list(tmp_path.iterdir()) == [], "files on disk have no name"
    assert lot.disk_entries == 6 and lot.disk_bytes == sum(map(len, blobs.values()))
    assert bytes(lot.peek(3) or b"") == blobs[3]  # peek leaves it there
    assert lot.holds(3) == "disk" and bytes(lot.take(3) or b"") == blobs[3] and lot.holds(3) == ""
    lot.discard(4)
    lot.close()
    assert lot.disk_entries == 0 and open_fds() == before


def test_a_state_is_served_from_ram_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, started, before = threading.Event(), threading.Event(), open_fds()
    pwrite = os.pwrite

    def slow_pwrite(fd: int, data: memoryview, offset: int) -> int:
        started.set()
        assert gate.wait(10)
        return pwrite(fd, data, offset)

    monkeypatch.setattr(parking.os, "pwrite", slow_pwrite)
    lot = ParkingLot(tmp_path)
    lot.park("a", b"alpha")
    lot.park("b", b"bravo")
    assert lot.spill("a") and lot.spill("b")  # two writes may wait (MAX_WRITES)
    assert started.wait(10)
    assert lot.holds("a") == "disk" and lot.peek("a") == b"alpha"  # not written yet: from RAM
    lot.discard("b")  # while its write waits: the writer closes the file it made
    gate.set()
    lot.park("c", b"charlie")
    assert lot.spill("c")
    lot.close()  # waits for the writer
    assert open_fds() == before


def test_a_failed_write_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(parking.os, "pwrite", full)
    before = open_fds()
    lot = ParkingLot(tmp_path)
    lot.park("a", b"alpha")
    assert lot.spill("a")
    lot.close()  # waits for the writer
    assert "No space left" in caplog.text and open_fds() == before
    lot = ParkingLot(tmp_path)
    lot.park("a", b"alpha")
    lot.spill("a")
    assert lot._writer is not None
    lot._writer.submit(lambda: None).result()  # the write has ended
    assert lot.holds("a") == "" and lot.take("a") is None
    lot.close()


def test_without_a_disk_a_spilled_state_is_forgotten() -> None:
    lot = ParkingLot()
    lot.park("a", b"alpha")
    assert not lot.spill("a") and lot.holds("a") == "" and lot.take("a") is None
