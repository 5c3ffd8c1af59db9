"""llama.cpp's RPC backend, from the client's side: what an endpoint is, and a preflight that
speaks the protocol's hello from Python.

llama.cpp aborts the whole process when it cannot reach a server it is given
(``ggml_backend_rpc_add_server``: "Failed to connect", SIGABRT, after waiting out the kernel's
connect timeout). So every endpoint is first reached here, with a timeout: connect, HELLO
(protocol version), DEVICE_COUNT. Only endpoints that answer go to llama.cpp. This module does
not load the native libraries.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from llmsession.errors import ModelLoadError
from llmsession.native.machine import within_cores

# The pinned ggml-rpc.h / ggml-rpc.cpp (protocol 7.0.0).
PROTO_MAJOR = 7
PROTO_MINOR = 0
CMD_HELLO = 14
CMD_DEVICE_COUNT = 15
CONN_CAPS_SIZE = 24
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
DEFAULT_PORT = 50052  # ggml-rpc-server's


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ServerInfo:
    """What a server answered to the preflight."""

    endpoint: Endpoint
    version: tuple[int, int, int]
    devices: int


def parse_endpoint(text: str) -> Endpoint:
    """``host:port`` as llama.cpp reads it (the host is what precedes the first colon)."""
    if not isinstance(text, str):
        raise TypeError(f"an RPC endpoint is a 'host:port' string, got {type(text).__name__}")
    host, colon, port = text.partition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RPC endpoint {text!r}: expected 'host:port' with a port in 1..65535")
    return Endpoint(host, int(port))


def parse_endpoints(texts: object) -> list[Endpoint]:
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise TypeError("rpc_servers is a list of 'host:port' strings")
    endpoints = [parse_endpoint(text) for text in texts]
    if not endpoints:
        raise ValueError("rpc_servers is empty")
    if len(endpoints) > MAX_SERVERS:
        raise ValueError(f"rpc_servers: at most {MAX_SERVERS} servers (GGML_RPC_MAX_SERVERS)")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError("rpc_servers names one server twice (a server takes one client at a time)")
    return endpoints


def checked_servers(texts: Sequence[str], timeout: float) -> list[Endpoint]:
    """A model's ``rpc_servers`` (none is fine) and ``worker_timeout``, which bounds reaching
    them as well as its worker: checked before anything starts."""
    if not timeout > 0:
        raise ValueError(f"worker_timeout must be positive, got {timeout!r}")
    return parse_endpoints(texts) if texts else []


def preflight_all(endpoints: Sequence[Endpoint], timeout: float) -> list[str]:
    """Each endpoint preflighted (``preflight``); their "host:port", to hand llama.cpp."""
    return [str(preflight(endpoint, timeout).endpoint) for endpoint in endpoints]


def _receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def _command(sock: socket.socket, command: int, payload: bytes, answer_size: int) -> bytes:
    """| cmd (1 byte) | size (8 bytes) | payload |, answered by | size (8 bytes) | answer |."""
    sock.sendall(struct.pack("<BQ", command, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _receive(sock, 8))
    if size != answer_size:
        raise ConnectionError(f"unexpected answer size {size} to command {command}")
    return _receive(sock, size)


def preflight(endpoint: Endpoint, timeout: float) -> ServerInfo:
    """Reach ``endpoint`` within ``timeout`` seconds and check it speaks this build's protocol;
    a ``ModelLoadError`` naming it otherwise. The connection is closed again: a server serves one
    client at a time, and the next is llama.cpp."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            hello = _command(sock, CMD_HELLO, bytes(CONN_CAPS_SIZE), 4 + CONN_CAPS_SIZE)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != PROTO_MAJOR or minor > PROTO_MINOR:
                raise ModelLoadError(
                    f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}; this build "
                    f"speaks {PROTO_MAJOR}.{PROTO_MINOR} (run the same llama.cpp version there: "
                    "`llmsession rpc-server`)"
                )
            (devices,) = struct.unpack("<I", _command(sock, CMD_DEVICE_COUNT, b"", 4))
    except TimeoutError as error:
        raise ModelLoadError(
            f"RPC server {endpoint} did not answer within {timeout:g} s (busy with another "
            "client, stopped, or unreachable)"
        ) from error
    except OSError as error:
        raise ModelLoadError(f"RPC server {endpoint} cannot be reached: {error}") from error
    if devices < 1:
        raise ModelLoadError(f"RPC server {endpoint} offers no device")
    return ServerInfo(endpoint, (major, minor, patch), devices)


def server_binary() -> Path:
    """The ``ggml-rpc-server`` built with the libraries (``llmsession setup``)."""
    from llama_cffi import lib_dir

    return lib_dir().parent / "bin" / "ggml-rpc-server"


def server_command(port: int, host: str = "127.0.0.1", threads: int | None = None) -> list[str]:
    """The command that serves this machine's CPU to a model on another host. The server trusts
    every client: bind it to an address only your network reaches."""
    binary = server_binary()
    if not binary.exists():
        raise FileNotFoundError(f"{binary} not found: run `llmsession setup` to build it")
    command = [str(binary), "-H", host, "-p", str(port)]
    return command + (["-t", str(within_cores(threads))] if threads else [])  # (it runs here)


START_TRIES = 3  # (``local_servers``: a server whose port was taken starts again elsewhere)


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (read from Linux's
    ``/proc``; where it cannot be read, taken on trust)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
        for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
            for line in table.read_text().splitlines()[1:] if table.exists() else ():
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # (0A: LISTEN)
                    inodes.add(f"socket:[{fields[9]}]")
    except (OSError, IndexError, ValueError):
        return True
    for fd in fds:
        with suppress(OSError):
            if os.readlink(fd) in inodes:
                return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# Run first in the server's process, then replaced by the server (``exec``): killed with this
# process, however it ends (Linux's parent-death signal outlives ``exec``), or gone at once if it
# already has. A thread that ``local_servers`` started them from must outlive them.
# (Python ignores SIGPIPE and SIGXFSZ, which an exec keeps: the server gets them back, so it
# ends on a client gone mid-send as it would started alone.)
_TIED = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or os._exit(1); "
    "[signal.signal(s, signal.SIG_DFL) for s in (signal.SIGPIPE, signal.SIGXFSZ)]; "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def tied(command: list[str]) -> list[str]:
    """``command`` run so that it ends with this process (a server ``local_servers`` started
    outlived a caller killed before its ``finally``: a test's timeout, a benchmark's Ctrl-C)."""
    if not sys.executable:  # (an embedded interpreter: no Python to run it with)
        return command
    return [sys.executable, "-c", _TIED, str(os.getpid()), *command]


@contextmanager
def local_servers(n: int, threads: int | None = None) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """``n`` RPC servers on this machine's loopback (tests, benchmarks): their endpoints and
    processes, each answering the preflight before this yields; all killed on exit. A free
    port may be taken before its server binds it (another process picked it too): a server
    that exits so is started again on another port, and one counts as up only once it is the
    one listening on its port (another's answer there is not its own)."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(slot: int | None = None) -> None:
        port = free_port()
        process = subprocess.Popen(
            tied(server_command(port, threads=threads)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if slot is None:
            started.append((f"127.0.0.1:{port}", process))
        else:
            started[slot] = (f"127.0.0.1:{port}", process)

    try:
        for _ in range(n):
            start()
        for slot in range(n):
            deadline, starts = time.monotonic() + 30, 1
            while True:
                endpoint, process = started[slot]
                with suppress(ModelLoadError):
                    preflight(parse_endpoint(endpoint), 1.0)
                    if process.poll() is None and listens(process.pid, parse_endpoint(endpoint).port):
                        break
                if process.poll() is not None and starts < START_TRIES:  # (its port was taken)
                    process.wait()
                    start(slot)
                    starts += 1
                elif process.poll() is not None or time.monotonic() > deadline:
                    raise ModelLoadError(f"the RPC server on {endpoint} did not come up ({process.poll()})")
                time.sleep(0.05)
        yield started
    finally:
        for _, process in started:
            process.send_signal(signal.SIGCONT)  # a stopped one would not die
            process.kill()
            process.wait()
