"""``llmsession bench cluster``: many conversations through several replicas, one request router
against another, and a reference stack of llama-server replicas behind smg's cache-aware router.

Every stack gets ``--replicas`` replicas of one thread each, on this machine:

* ``conversation``: ``serve --replicas R`` with our router and a shared ``--disk-cache-dir``
  (conversations move with their state);
* ``power-of-two`` (Ray's default), ``consistent-hash`` (on the conversation's key) and
  ``prefix-affinity`` (Ray LLM's ``PrefixCacheAffinityRouter`` on the request's text, its
  defaults): Ray's own routers on the same deployment, without the shared folder, as a plain
  replica set runs;
* ``smg``: R llama-server processes behind ``smg launch --policy cache_aware`` (PyPI ``smg``, in
  an environment of its own: ``SMG_VENV``; skipped when it or llama-server is missing);
* ``removal``: ours again under Ray's autoscaling (``--min-replicas R-1``, a target no load
  reaches, ``--downscale-delay``), so Ray removes a replica while the conversations run; each
  conversation whose turn lands on another replica than its last is a move, and its decoded
  prompt tokens over the tokens the turn added says whether its state came along (target 1.1).

The load is ``bench serve``'s (``serve_load``): ``--conversations`` chats under one long system
prompt, ``--clients`` threads taking turns over them, each turn the whole history resent,
streamed, greedy. Per stack: each turn's time to first token and cached share; turns 2 and after
together (target for ours: cached share at least 0.95).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from llmsession.commands import paths
from llmsession.commands.argtypes import output_file, positive_int
from llmsession.commands.bench.common import machine, progress, publish, reference_env, table
from llmsession.commands.bench.serve_bench import log_tail, server_table
from llmsession.commands.bench.serve_load import drive, later_turns, warm_up

STACKS = ("conversation", "power-of-two", "consistent-hash", "prefix-affinity", "smg", "removal")
SERVE_MEMORY = ("--kv-tokens", "16384", "--max-live-sessions", "8")
SMG_VENV = paths.cache_root() / "smg"  # (its own environment: its grpcio is not Ray's)
LLAMA_SERVER_ARGS = ("-c", "16384", "-np", "4", "--jinja", "--cache-prompt", "--cache-ram", "4096")
CACHED_TARGET = 0.95
MOVE_TARGET = 1.1  # a moved conversation's decoded prompt tokens over the tokens its turn added
READY_TIMEOUT_S = 300.0


@dataclass
class Process:
    """One process of a stack: its command, port, and whether it is ready (given its URL)."""

    command: list[str]
    port: int
    ready: Callable[[str], bool] = field(default=lambda url: _answers(url + "/health"))


@dataclass
class Stack:
    """Processes to start in order, each once the one before is ready (the last answers the
    clients), and why the stack cannot run."""

    name: str
    processes: list[Process]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    missing: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.processes[-1].port}"


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=5).status_code == 200
    return False


def free_port() -> int:
    """A free port outside the ranges Ray's own processes take theirs from (the ephemeral ports
    from 32768, its workers' 10002-19999), so none of them takes it before the server binds it."""
    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


def ours(args: argparse.Namespace, router: str, shared: Path | None, *extra: str) -> Stack:
    port = free_port()
    command = [sys.executable, "-m", "llmsession", "serve", "--model", str(args.model), "--port", str(port)]
    command += ["--replicas", str(args.replicas), "--threads", "1", "--request-router", router]
    command += [*SERVE_MEMORY, *(["--disk-cache-dir", str(shared)] if shared is not None else []), *extra]
    return Stack(router, [Process(command, port)])


def removal(args: argparse.Namespace, shared: Path) -> Stack:
    scaling = ["--min-replicas", str(args.replicas - 1), "--max-replicas", str(args.replicas)]
    scaling += ["--target-ongoing-requests", "1000", "--downscale-delay", str(args.downscale_delay)]
    stack = ours(args, "conversation", shared, *scaling)
    stack.name = "removal"
    return stack


def smg(args: argparse.Namespace) -> Stack:
    """R llama-servers (one thread each, all named as the clients ask) behind smg's cache-aware
    policy, started once every llama-server is ready and ready once it sees them all healthy."""
    exe, router = args.llama_server, Path(args.smg)
    processes = []
    for _ in range(args.replicas):
        port = free_port()
        command = [str(exe), "-m", str(args.model), "--port", str(port), "-t", "1", *LLAMA_SERVER_ARGS]
        processes.append(Process([*command, "--alias", "bench"], port))
    port, metrics = free_port(), free_port()
    workers = [f"http://127.0.0.1:{p.port}" for p in processes]
    command = [str(router), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
    command += [
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics),
    ]
    command += [
        "--worker-startup-check-interval",
        "1",
        "--shutdown-grace-period-secs",
        "5",
        "--log-level",
        "warn",
    ]
    processes.append(Process(command, port, lambda url: _healthy_workers(url) == args.replicas))
    env = reference_env()  # (llmsession's libraries)
    missing = None
    if not exe.is_file():
        missing = f"{exe} not found: run python scripts/fetch_llama.py --bench"
    elif not router.is_file():
        missing = f"{router} not found: python -m venv {SMG_VENV} && {SMG_VENV}/bin/pip install smg==1.13"
    return Stack("smg", processes, env, missing)


def _healthy_workers(url: str) -> int:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
        return sum(1 for worker in workers if worker.get("is_healthy"))
    return 0


def stop(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process (a cluster command stops Ray itself), then its group's SIGKILL."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)


@contextlib.contextmanager
def launched(stack: Stack, logs: Path) -> Iterator[str]:
    """The stack's processes running and ready: the clients' base URL. Stopped on every way
    out, the last started first."""
    started: list[subprocess.Popen[bytes]] = []
    log = logs / f"{stack.name}.log"
    try:
        for process in stack.processes:
            with log.open("ab") as out:
                started.append(
                    subprocess.Popen(
                        process.command,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=stack.env,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not process.ready(f"http://127.0.0.1:{process.port}"):
                for running in started:
                    if running.poll() is not None:
                        raise RuntimeError(f"{stack.name} exited ({running.returncode}):\n{log_tail(log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{stack.name} not ready after {READY_TIMEOUT_S:.0f} s:\n{log_tail(log)}"
                    )
                time.sleep(0.5)
        yield stack.url
    finally:
        for running in reversed(started):
            stop(running, 90.0)


def moves(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each turn that landed on another replica than its conversation's previous turn: the
    tokens it added, the prompt tokens it decoded, their ratio."""
    found = []
    by_conversation: dict[int, list[dict[str, Any]]] = {}
    for request in requests:
        by_conversation.setdefault(request["conversation"], []).append(request)
    for turns in by_conversation.values():
        turns.sort(key=lambda r: r["turn"])
        for before, after in itertools.pairwise(turns):
            if before["replica"] == after["replica"] or None in (before["replica"], after["replica"]):
                continue
            added = after["prompt_tokens"] - before["prompt_tokens"] - before["completion_tokens"]
            decoded = after["prompt_tokens"] - after["cached_tokens"]
            found.append({
                "conversation": after["conversation"], "turn": after["turn"], "sent_s": after["sent_s"],
                "from": before["replica"], "to": after["replica"], "added": added, "decoded": decoded,
                "ratio": decoded / added if added > 0 else None,
            })  # fmt: skip
    return found


def measure(stack: Stack, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One stack's run, or why there is none."""
    if stack.missing:
        return {"skipped": stack.missing}
    try:
        with launched(stack, logs) as url:
            warm_up(url)
            run = drive(url, args.conversations, args.turns, args.clients, args.max_tokens)
    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as error:
        return {"error": f"{type(error).__name__}: {error}", "log": log_tail(logs / f"{stack.name}.log", 40)}
    result = {"command": " && ".join(shlex.join(p.command) for p in stack.processes)} | run
    result["later"] = later_turns(run)
    result["replicas_used"] = len({r["replica"] for r in run["requests"] if r["replica"] is not None})
    result["moves"] = moves(run["requests"])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": date, "machine": machine(1), "model": args.model.name}
    keys = ("replicas", "conversations", "turns", "clients", "max_tokens", "downscale_delay")
    results |= {key: getattr(args, key) for key in keys}
    results["stacks"] = {}
    with tempfile.TemporaryDirectory(prefix="llmsession-bench-cluster-") as folder:
        logs = Path(folder)
        for name in args.stacks:
            shared = logs / f"{name}-shared"
            if name == "smg":
                stack = smg(args)
            elif name == "removal":
                stack = removal(args, shared)
            else:
                stack = ours(args, name, shared if name == "conversation" else None)
            progress(f"{name}: {args.conversations} chats x {args.turns} turns on {args.replicas}", started)
            results["stacks"][name] = measure(stack, args, logs)
    progress("done", started)
    return results


def report(results: dict[str, Any]) -> None:
    m, r = results["machine"], results
    print(f"\n{r['date']}: {m['cpu']}, {m['cores']} cores, llama.cpp {m['llama_cpp_commit']};", end="")
    print(f" {r['model']}, {r['replicas']} replicas of 1 thread, {r['conversations']} chats x", end="")
    print(f" {r['turns']} turns over {r['clients']} clients, {r['max_tokens']} tokens a reply")
    rows = []
    for name, stack in results["stacks"].items():
        server_table(name, stack)
        if "later" in stack:
            later = stack["later"]
            share = later["cached_share"]
            rows.append([name, f"{later['ttft_mean_s'] * 1e3:.0f}", "-" if share is None else f"{share:.3f}",
                         str(stack["replicas_used"]), str(len(stack["moves"]))])  # fmt: skip
    table("turns 2+", ["stack", "TTFT mean ms", "cached share", "replicas", "moves"], rows)
    ours = results["stacks"].get("conversation", {}).get("later")
    if ours is not None and ours["cached_share"] is not None:
        share = ours["cached_share"]
        verdict = "met" if share >= CACHED_TARGET else "missed"
        print(f"\nours, turns 2+ cached share {share:.3f} (target >= {CACHED_TARGET}: {verdict})")
    moved = results["stacks"].get("removal", {}).get("moves")
    if moved is not None:
        ratios = [m["ratio"] for m in moved if m["ratio"] is not None]
        if not ratios:
            print("removal: no conversation moved (was a replica removed? see --downscale-delay)")
        else:
            verdict = "met" if max(ratios) <= MOVE_TARGET else "missed"
            mean = sum(ratios) / len(ratios)
            print(f"removal: {len(ratios)} moved turns, decoded / added tokens mean {mean:.2f},", end="")
            print(f" max {max(ratios):.2f} (target <= {MOVE_TARGET}: {verdict})")


def stacks(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(STACKS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown stack {', '.join(unknown)} (known: {', '.join(STACKS)})")
    return names


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=positive_int, default=3)
    parser.add_argument("--conversations", type=positive_int, default=24)
    parser.add_argument("--turns", type=positive_int, default=6, help="per chat (at least 2)")
    parser.add_argument("--clients", type=positive_int, default=6)
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="per reply")
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--stacks", type=stacks, default=list(STACKS), help="comma-separated")
    parser.add_argument(
        "--downscale-delay",
        type=float,
        default=30.0,
        help="the removal run's: seconds before Ray removes one",
    )
    parser.add_argument("--llama-server", type=Path, default=paths.llama_dir() / "bin" / "llama-server")
    parser.add_argument("--smg", type=Path, default=SMG_VENV / "bin" / "smg", help="smg's command")
    parser.add_argument("--json", type=output_file, help="write every number here")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.clients > args.conversations or args.replicas < 2:
        parser.error("--turns and --replicas must be at least 2, and --clients at most --conversations")
    publish(run(args), report, args.json)
    return 0
