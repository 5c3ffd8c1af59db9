"""Files a caller names, opened only where they are regular files: a FIFO would block the
opening for ever, a device (``/dev/zero``) would never end, and a directory is no file. Both
raise ``OSError`` (its ``strerror`` saying why) for the caller to make its own typed error."""

from __future__ import annotations

import errno
import io
import os
import stat


def opened_regular(path: str | os.PathLike[str]) -> tuple[io.BufferedReader, int]:
    """``path`` opened for reading, and its size, if it is a regular file (checked on the open
    file: never blocking on a FIFO's writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return open(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], most: int) -> bytes:
    """The bytes of regular file ``path``, at most ``most`` of them (a larger file, or one that
    grows past them while read, is refused, unread)."""
    f, size = opened_regular(path)
    with f:
        if size > most:
            raise OSError(errno.EFBIG, f"larger than {most} bytes ({size})", str(path))
        data = f.read(min(size, most) + 1)  # (not ``most``: a buffer of it is made at once)
    if len(data) > most:
        raise OSError(errno.EFBIG, f"grew past {most} bytes while it was read", str(path))
    return data
