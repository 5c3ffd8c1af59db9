"""Argument types for the commands: a bad value or an output path that cannot be written is
argparse's ``error: ...`` and exit status 2 before any work, not a traceback after it. Pure."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from llmsession.serve.access import presentable  # (the one rule: no web framework loaded)


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def port(text: str) -> int:
    value = _int_at_least(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is at most 65535, not {value}")
    return value


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
    return value


def seconds(text: str) -> float:
    """A finite, non-negative number of seconds (``time.sleep`` refuses the others)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def temperature(text: str) -> float:
    return seconds(text)  # the same rule: finite and not negative


def positive_ints(text: str) -> list[int]:
    """Comma-separated counts, each at least 1: ``4,16,64``."""
    return [positive_int(part.strip()) for part in text.split(",")]


def output_file(text: str) -> Path:
    """A file a command writes when it ends: checked now, so a long run does not end in an
    error. A regular file or nothing, in a directory that exists and takes a new file."""
    path = Path(text)
    existed = path.exists()
    if existed and not path.is_file():
        raise argparse.ArgumentTypeError(f"cannot write {text}: it exists and is not a regular file")
    try:
        with path.open("a"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {error.strerror or error}") from None
    if not existed:
        path.unlink(missing_ok=True)
    return path


def directory(text: str) -> Path:
    """A directory a command fills (made now if missing)."""
    path = Path(text).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"cannot make the directory {text}: {error.strerror or error}"
        ) from None
    return path.resolve()


MAX_KEY_FILE = 1 << 20  # bytes of a file of keys


def key_file(text: str) -> list[str]:
    """The keys a file holds (``--api-key-file``, ``--operator-key-file``): one a line, blank
    lines and ``#`` comments skipped, the whitespace around each dropped. A key on the command
    line is seen by every user of the machine (``ps``); one in a file only by who may read it.
    A file that holds no key, or a key with whitespace or a control character inside (no
    header could present it), is refused: the server would not be the one meant."""
    try:
        with Path(text).expanduser().open("rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {error.strerror or error}") from None
    if len(data) > MAX_KEY_FILE:
        raise argparse.ArgumentTypeError(f"{text} is larger than {MAX_KEY_FILE} bytes: not a file of keys")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{text} is not UTF-8 text") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    for number, key in enumerate(keys, 1):
        if not presentable(key):
            raise argparse.ArgumentTypeError(
                f"{text}: key {number} has whitespace, a control character or a non-ASCII one in it"
            )
    if not keys:
        raise argparse.ArgumentTypeError(f"{text} holds no key (one a line; # begins a comment)")
    return keys


def api_key(text: str) -> str:
    """A key given on the command line (``--api-key``, ``--operator-key``): one a header can
    carry, checked before anything loads."""
    if not presentable(text):
        raise argparse.ArgumentTypeError("a key must be printable ASCII without whitespace")
    return text
