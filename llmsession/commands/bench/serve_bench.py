"""``llmsession bench serve``: our OpenAI-compatible server against llama-server and llama_cpp.server.

The same chats through the same client (``serve_load``): time to first token per turn, the share
of prompt tokens served from cache, wall time.

Each server runs as a subprocess on a free loopback port, one after another (they would share
the cores otherwise), waited for, warmed up by a request of its own, driven, then stopped; all
three run llmsession's llama.cpp build with the same threads:

* llmsession: ``python -m llmsession serve --threads T`` with ``SERVE_MEMORY`` (room for every
  chat's cells, every chat a live sequence: nothing parked for lack of room) unless ``--serve-args``;
* llama-server (``scripts/fetch_llama.py --bench`` builds it from the same sources), ``-t T`` and
  ``LLAMA_SERVER_ARGS`` unless ``--llama-server-args``: four slots, prompt caching and 8 GiB of
  RAM cache for idle slots' states (its defaults, spelled out), and a slot prompt similarity of
  0.95: at its default 0.1 any slot matches any chat through the shared system prompt, a request
  takes one without losing half its cells, and the RAM cache is never consulted (turns 2-4 then
  reused only the system prompt: 0.845 of prompt tokens, 0.966 at 0.95, and 2.9x the TTFT).
  Flash attention as it chooses (``-fa auto``: on for the CPU), as users run it;
  ``--cache-reuse`` (KV shifting of chunks) stays off: a resent history is a prefix;
* llama_cpp.server (llama-cpp-python 0.3.36 in ``--peer-python``, ``LLAMA_CPP_LIB_PATH`` on our
  lib/): ``--cache true --cache_type ram`` (a state saved after each reply, the one sharing the
  longest prefix restored), its best setting for resent histories: without it only its one
  context's last prompt is reused. ``--logits_all false``: its default (true) keeps the logits of
  every prompt position, and each saved state copies them (805 MB at ``--n_ctx 4096``, uncounted
  by the cache's size: 48 replies would take 39 GB); false leaves 100 MB a state, so
  ``--cache_size`` 512 MiB of states (twice what 12 chats' latest take) bounds it to about 3 GB.
  ``--flash_attn false`` as ours on the CPU (and its own default), ``--n_ctx 4096`` as ours. It
  serves one request at a time (``--interrupt_requests false``: by default a request arriving
  ends the one streaming) and reports no cached tokens ("-" in the table).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from llama_cffi import lib_dir

from llmsession.commands import paths
from llmsession.commands.argtypes import output_file, positive_int
from llmsession.commands.bench.common import machine, progress, publish, reference_env, table
from llmsession.commands.bench.serve_load import drive, later_turns, warm_up
from llmsession.native.machine import default_threads, within_cores

PEERS = ("llama-server", "llama-cpp-python")
SERVE_MEMORY = ("--kv-tokens", "16384", "--max-live-sessions", "12")
LLAMA_SERVER_ARGS = ("-np", "4", "--jinja", "--cache-prompt", "--cache-ram", "8192", "-sps", "0.95")
# Issue 28's targets, on turns 2 and after: ours over each peer's mean TTFT, at most; ours cached.
TARGETS = {"llama-server": 0.8, "llama-cpp-python": 0.2}
CACHED_TARGET = 0.9
READY_TIMEOUT_S = 180.0


@dataclass
class Contender:
    """A server to start: its command, environment, the path that answers 200 once it is ready,
    and why it cannot run (then it is reported as skipped)."""

    name: str
    command: list[str]
    port: int
    ready: str = "/health"
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    missing: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ours(args: argparse.Namespace) -> Contender:
    port = free_port()
    memory = shlex.split(args.serve_args) if args.serve_args is not None else list(SERVE_MEMORY)
    command = [sys.executable, "-m", "llmsession", "serve", "--model", str(args.model), "--port", str(port)]
    return Contender("llmsession", [*command, "--threads", str(args.threads), *memory], port)


def llama_server(args: argparse.Namespace) -> Contender:
    port, exe = free_port(), args.llama_server
    command = [str(exe), "-m", str(args.model), "--port", str(port), "-t", str(within_cores(args.threads))]
    given = args.llama_server_args
    command += shlex.split(given) if given is not None else list(LLAMA_SERVER_ARGS)
    env = reference_env()  # (llmsession's libraries)
    missing = None if exe.is_file() else f"{exe} not found: run python scripts/fetch_llama.py --bench"
    return Contender("llama-server", command, port, env=env, missing=missing)


def llama_cpp_server(args: argparse.Namespace) -> Contender:
    port, threads = free_port(), str(within_cores(args.threads))
    command = [args.peer_python, "-m", "llama_cpp.server", "--model", str(args.model), "--port", str(port)]
    command += ["--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "4096"]
    command += ["--flash_attn", "false", "--logits_all", "false", "--interrupt_requests", "false"]
    command += ["--verbose", "false"]
    command += ["--cache", "true", "--cache_type", "ram", "--cache_size", str(512 << 20)]
    env = os.environ | {"LLAMA_CPP_LIB_PATH": os.environ.get("LLAMA_CPP_LIB_PATH") or str(lib_dir())}
    try:
        probe = subprocess.run(
            [args.peer_python, "-c", "import llama_cpp.server.app"], capture_output=True, env=env
        )
        importable = probe.returncode == 0
    except OSError:
        importable = False
    missing = None if importable else (
        f"llama_cpp.server is not importable by {args.peer_python} (see --peer-python; "
        "pip install 'llama-cpp-python[server]==0.3.36' there)"
    )  # fmt: skip
    return Contender("llama-cpp-python", command, port, "/v1/models", env, missing)


def log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (it and anything it started), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)


@contextlib.contextmanager
def launched(contender: Contender, log: Path) -> Iterator[str]:
    """The server running, ready to answer: its base URL. Stopped on every way out."""
    url = f"http://127.0.0.1:{contender.port}"
    with log.open("wb") as out:
        process = subprocess.Popen(
            contender.command, stdout=out, stderr=subprocess.STDOUT, env=contender.env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{contender.name} exited ({process.returncode}):\n{log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + contender.ready, timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{contender.name} not ready after {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.25)
        yield url
    finally:
        stop(process)


def measure(contender: Contender, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One server's run, or why there is none (skipped: it is missing; error: it failed)."""
    if contender.missing:
        return {"skipped": contender.missing}
    log = logs / f"{contender.name}.log"
    try:
        with launched(contender, log) as url:
            warm_up(url)
            run = drive(url, args.conversations, args.turns, args.clients, args.max_tokens)
    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as error:
        return {"error": f"{type(error).__name__}: {error}", "log": log_tail(log, 40)}
    return {"command": shlex.join(contender.command)} | run | {"later": later_turns(run)}


def ratios(servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ours over each peer's turns-2+ mean TTFT, against the targets; our cached share's too."""
    base = servers.get("llmsession", {}).get("later")
    if base is None:
        return {}
    found: dict[str, Any] = {}
    share = base["cached_share"]
    found["cached_share"] = {
        "value": share,
        "target": CACHED_TARGET,
        "met": share is not None and share >= CACHED_TARGET,
    }
    for name, target in TARGETS.items():
        if "later" in servers.get(name, {}):
            ratio = base["ttft_mean_s"] / servers[name]["later"]["ttft_mean_s"]
            found[name] = {"ttft_ratio": ratio, "target": target, "met": ratio <= target}
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": date, "machine": machine(args.threads), "model": args.model.name}
    results |= {key: getattr(args, key) for key in ("conversations", "turns", "clients", "max_tokens")}
    makers = {"llmsession": ours, "llama-server": llama_server, "llama-cpp-python": llama_cpp_server}
    results["servers"] = {}
    with tempfile.TemporaryDirectory(prefix="llmsession-bench-serve-") as logs:
        for name in ("llmsession", *args.peers):
            contender = makers[name](args)  # (its free port found just before it starts)
            progress(f"{contender.name}: {args.conversations} chats x {args.turns} turns", started)
            results["servers"][contender.name] = measure(contender, args, Path(logs))
    results["ratios"] = ratios(results["servers"])
    progress("done", started)
    return results


def cell(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def server_table(name: str, server: dict[str, Any]) -> None:
    """A server's turns: TTFT over the turn's requests, its prompts' size and cached share."""
    if "turns" not in server:
        why = server.get("skipped") or server["error"]
        print(f"\n{name}: {'skipped' if 'skipped' in server else 'failed'}: {why}")
        return
    header = ["turn", "requests", "TTFT mean ms", "median ms", "max ms", "prompt tokens", "cached share"]
    rows = [
        [str(t["turn"]), str(t["requests"]), ms(t["ttft_mean_s"]), ms(t["ttft_median_s"]),
         ms(t["ttft_max_s"]), cell(t["prompt_tokens_mean"], ".0f"), cell(t["cached_share"], ".3f")]
        for t in server["turns"]
    ]  # fmt: skip
    later = server["later"]
    rows.append(["2+", "", ms(later["ttft_mean_s"]), "", "", "", cell(later["cached_share"], ".3f")])
    table(f"{name}: wall {server['wall_s']:.1f} s ({server['command']})", header, rows)


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\n{results['date']}: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, llama.cpp", end="")
    print(f" {m['llama_cpp_commit']}; {results['model']}, {results['conversations']} chats x", end="")
    print(f" {results['turns']} turns, {results['clients']} clients, {results['max_tokens']} tokens a reply")
    for name, server in results["servers"].items():
        server_table(name, server)
    found = results["ratios"]
    if found:
        share = found["cached_share"]
        verdict = "met" if share["met"] else "missed"
        print(f"\nturns 2+, llmsession's cached share: {cell(share['value'], '.3f')}", end="")
        print(f" (target >= {share['target']}: {verdict})")
    for name in TARGETS:
        if name in found:
            r = found[name]
            verdict = "met" if r["met"] else "missed"
            print(f"turns 2+, mean TTFT llmsession / {name}: {r['ttft_ratio']:.3f}", end="")
            print(f" (target <= {r['target']}: {verdict})")


def peers(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip() and name.strip() != "none"]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)} (known: {', '.join(PEERS)})")
    return names


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=positive_int, default=12)
    parser.add_argument("--turns", type=positive_int, default=4, help="per chat (at least 2)")
    parser.add_argument(
        "--clients", type=positive_int, default=3, help="concurrent clients, each its share of the chats"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=24, help="per reply")
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--threads", type=positive_int, default=default_threads(), help="every server's")
    parser.add_argument("--peers", type=peers, default=list(PEERS), help="comma-separated, or none")
    parser.add_argument(
        "--peer-python", default=sys.executable, help="a Python that imports llama_cpp.server"
    )
    parser.add_argument("--llama-server", type=Path, default=paths.llama_dir() / "bin" / "llama-server")
    parser.add_argument(
        "--serve-args", help=f"llmsession serve's memory arguments (default: {shlex.join(SERVE_MEMORY)})"
    )
    parser.add_argument(
        "--llama-server-args", help=f"its arguments (default: {shlex.join(LLAMA_SERVER_ARGS)})"
    )
    parser.add_argument("--json", type=output_file, help="write every number here")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.clients > args.conversations:
        parser.error("--turns must be at least 2, and --clients at most --conversations")
    results = run(args)
    publish(results, report, args.json)
    return 1 if "error" in results["servers"]["llmsession"] else 0  # (a peer's failure is reported)
