"""``llmsession bench agents``: coding agents' conversations on our server and on llama-server.

The Claude-Code-shaped conversation on ``/v1/messages`` and the Codex-shaped one on
``/v1/responses`` (``agents_load``: a ~4K-token system prompt, 8 tools, 10 turns, the whole
transcript resent each turn, Claude Code's billing line new each request) on each server, one
server at a time, same model, same threads: per turn, the time to the first token and the prompt
tokens decoded against what the turn adds. Target (issue 41): turns 2-10 mean time to first token
at most half llama-server's. ``claude-code+titles`` is the same conversation with a title request
under its session id before each turn (as Claude Code sends them): a side request must not cost
the conversation its cache. The ``/replayed`` shapes send the script's replies back instead of
the server's (``agents_load.scripted``), so that both servers are sent the same prompts (left to
their own replies, they call tools differently and their turns add different tokens);
``3x claude-code/replayed`` runs three such conversations at once, a turn of each in turn, on a
server that keeps one live.

* llmsession: ``serve --threads T`` and ``SERVE_ARGS`` (one conversation's context of 8,192);
* llama-server (``scripts/fetch_llama.py --bench`` builds it from the same sources): ``-t T``
  and ``LLAMA_SERVER_ARGS``: one slot of 8,192, ``--jinja``, prompt caching (its default,
  spelled out), flash attention as it chooses (on, for the CPU). It rewrites Claude Code's
  billing hash to ``fffff`` itself, so both servers read resent turns from their cache.

Each request opens a connection of its own (``serve_load.http_client``): llama-server closes a
kept-alive connection after a request whose prompt took tens of seconds, and the client's next
request on it then fails.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from llmsession.commands import paths
from llmsession.commands.argtypes import output_file, positive_int
from llmsession.commands.bench import agents_load, agents_wire
from llmsession.commands.bench.common import machine, progress, publish, table
from llmsession.commands.bench.serve_bench import Contender, launched, llama_server, log_tail, ours
from llmsession.commands.bench.serve_load import http_client
from llmsession.native.machine import default_threads

SERVE_ARGS = (
    "--kv-tokens",
    "8192",
    "--max-live-sessions",
    "1",
    "--context-size",
    "8192",
    "--api-key",
    "sk-bench",
)
LLAMA_SERVER_ARGS = ("-c", "8192", "-np", "1", "--jinja", "--cache-prompt", "--api-key", "sk-bench")
Drive = Callable[[httpx.Client, str, int, int, str], list[agents_wire.Turn]]
SHAPES: dict[str, Drive] = {
    "claude-code": agents_load.claude_code,
    "claude-code+titles": functools.partial(agents_load.claude_code, titles=True),  # (side requests)
    "codex": agents_load.codex,
    # The same conversations with the script's replies sent back: every server the same prompts.
    "claude-code/replayed": functools.partial(agents_load.claude_code, replay=True),
    "codex/replayed": functools.partial(agents_load.codex, replay=True),
    # Three Claude-Code-shaped conversations at once (one system prompt), a turn of each in turn.
    "3x claude-code/replayed": functools.partial(agents_load.claude_code, replay=True, conversations=3),
}
TARGET = 0.5  # ours over llama-server's turns-2+ mean TTFT, at most


def measure(contender: Contender, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Both conversations on one server, or why there are none."""
    if contender.missing:
        return {"skipped": contender.missing}
    log = logs / f"{contender.name}.log"
    out: dict[str, Any] = {"command": shlex.join(contender.command)}
    try:
        with launched(contender, log) as url, http_client() as client:
            for shape, drive in SHAPES.items():
                try:
                    out[shape] = agents_wire.summary(
                        drive(client, url, args.turns, args.max_tokens, "sk-bench")
                    )
                except (RuntimeError, httpx.HTTPError, ValueError, KeyError) as error:
                    out[shape] = {"error": f"{type(error).__name__}: {error}"}
    except (RuntimeError, OSError) as error:
        return {"error": f"{type(error).__name__}: {error}", "log": log_tail(log, 40)}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": date, "machine": machine(args.threads), "model": args.model.name}
    results |= {"turns": args.turns, "max_tokens": args.max_tokens, "servers": {}}
    args.serve_args = shlex.join(SERVE_ARGS) if args.serve_args is None else args.serve_args
    args.llama_server_args = (
        shlex.join(LLAMA_SERVER_ARGS) if args.llama_server_args is None else args.llama_server_args
    )
    makers = {"llmsession": ours, "llama-server": llama_server}
    with tempfile.TemporaryDirectory(prefix="llmsession-bench-agents-") as logs:
        for name in ("llmsession", *(["llama-server"] if args.llama_server_peer else [])):
            contender = makers[name](args)
            progress(f"{contender.name}: {', '.join(SHAPES)}, {args.turns} turns each", started)
            results["servers"][name] = measure(contender, args, Path(logs))
    results["ratios"] = ratios(results["servers"])
    progress("done", started)
    return results


def ratios(servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ours_, peer = servers.get("llmsession", {}), servers.get("llama-server", {})
    found = {}
    for shape in SHAPES:
        mine, theirs = ours_.get(shape, {}), peer.get(shape, {})
        if mine.get("later_ttft_mean_s") and theirs.get("later_ttft_mean_s"):
            ratio = mine["later_ttft_mean_s"] / theirs["later_ttft_mean_s"]
            found[shape] = {"ttft_ratio": ratio, "target": TARGET, "met": ratio <= TARGET}
    return found


def _turn_label(turn: dict[str, Any], turns: list[dict[str, Any]]) -> str:
    """A turn's number, with its conversation's letter where there are several (2a, 2b, ...)."""
    several = any(t.get("conversation") for t in turns)
    return f"{turn['turn']}{chr(ord('a') + turn.get('conversation', 0)) if several else ''}"


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\n{results['date']}: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, llama.cpp", end="")
    print(f" {m['llama_cpp_commit']}; {results['model']}, {results['turns']} turns,", end="")
    print(f" {results['max_tokens']} tokens a reply")
    for name, server in results["servers"].items():
        if "command" not in server:
            why = "skipped" if "skipped" in server else "failed"
            print(f"\n{name}: {why}: {server.get('skipped') or server['error']}")
            continue
        for shape in SHAPES:
            found = server[shape]
            if "error" in found:
                print(f"\n{name}, {shape}: failed: {found['error']}")
                continue
            header = ["turn", "TTFT ms", "total ms", "prompt", "decoded", "new", "reused", "calls"]
            rows = [
                [_turn_label(t, found["turns"]), f"{t['ttft_s'] * 1e3:.0f}", f"{t['total_s'] * 1e3:.0f}",
                 str(t["prompt_tokens"]), str(t["decoded_tokens"]),
                 "-" if t["new_tokens"] is None else str(t["new_tokens"]),
                 str(t["cached_tokens"]), str(t["tool_calls"])]
                for t in found["turns"]
            ]  # fmt: skip
            mean = found["later_ttft_mean_s"]
            rows.append(
                [
                    "2+",
                    f"{mean * 1e3:.0f}",
                    "",
                    "",
                    str(found["later_decoded"]),
                    str(found["later_new"]),
                    "",
                    "",
                ]
            )
            table(f"{name}, {shape}", header, rows)
    for shape, r in results["ratios"].items():
        verdict = "met" if r["met"] else "missed"
        ratio = f"{r['ttft_ratio']:.3f} (target <= {r['target']}: {verdict})"
        print(f"{shape}: turns 2+, mean TTFT llmsession / llama-server: {ratio}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench agents", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=positive_int, default=10)
    parser.add_argument("--max-tokens", type=positive_int, default=48, help="per reply (a call takes ~30)")
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--threads", type=positive_int, default=default_threads(), help="both servers'")
    parser.add_argument("--llama-server", type=Path, default=paths.llama_dir() / "bin" / "llama-server")
    parser.add_argument(
        "--no-llama-server", dest="llama_server_peer", action="store_false", help="ours alone"
    )
    parser.add_argument(
        "--serve-args", help=f"llmsession serve's arguments (default: {shlex.join(SERVE_ARGS)})"
    )
    parser.add_argument(
        "--llama-server-args", help=f"its arguments (default: {shlex.join(LLAMA_SERVER_ARGS)})"
    )
    parser.add_argument("--json", type=output_file, help="write every number here")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2")
    results = run(args)
    publish(results, report, args.json)
    mine = results["servers"]["llmsession"]
    return 1 if "error" in mine or any("error" in mine.get(shape, {}) for shape in SHAPES) else 0
