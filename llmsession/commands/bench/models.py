"""``llmsession bench models``: two models alternating requests under a budget that holds one.

Two conversations, one per model (SmolLM2 and Gemma 3 by default), each with a long system
prompt, take turns: smol's turn 1, gemma's turn 1, smol's turn 2, ... so every request finds
the other model loaded and must load its own. Each turn is streamed; its time to first token
counts the load. Three servers, one at a time, same model files and threads:

* llmsession, conversations named (``x-session-id``): ``serve --models-dir DIR
  --max-loaded-models 1``. An unloading model parks its named conversations; a later turn is
  read from that state.
* llmsession, conversations unnamed: the same server, the same requests without the header: a
  plain reload, each turn's prompt decoded again.
* llama-server's router (``--models-dir DIR --models-max 1``, ``scripts/fetch_llama.py --bench``
  builds it from the same sources): a child process per model, its prompt cache gone with it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from llmsession.commands import paths
from llmsession.commands.argtypes import output_file, positive_int
from llmsession.commands.bench.common import machine, progress, publish, reference_env, table
from llmsession.commands.bench.serve_bench import Contender, free_port, launched, log_tail
from llmsession.commands.bench.serve_load import http_client
from llmsession.native.machine import default_threads, within_cores

KEY = "sk-bench"
MEMORY = ("--kv-tokens", "4096", "--max-live-sessions", "1", "--context-size", "4096")
LLAMA_SERVER_ARGS = ("-c", "4096", "-np", "1", "--jinja", "--cache-prompt", "--api-key", KEY)
RULE = "Answer in one short sentence, plainly, and never repeat the question. "
QUESTIONS = ("Name a colour.", "Why that one?", "Name another.", "And a fruit?", "Which is sweeter?")


def system_prompt(model: str, sentences: int) -> str:
    return f"You are assistant {model}. " + " ".join(f"Rule {i}: {RULE}" for i in range(sentences))


def turn(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """One streamed chat turn: its time to first token, text, and prompt tokens decoded."""
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                said = choice.get("delta", {}).get("content") or ""
                if said and first is None:
                    first = time.perf_counter() - sent
                text.append(said)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:  # (llama-server says it in its timings)
        cached = timings.get("cache_n", 0)
    total = time.perf_counter() - sent
    return {"ttft_s": first if first is not None else total, "total_s": total, "text": "".join(text),
            "prompt_tokens": prompt, "decoded_tokens": prompt - cached}  # fmt: skip


def converse(url: str, args: argparse.Namespace, named: bool) -> list[dict[str, Any]]:
    """The two conversations, turn by turn, alternating models."""
    histories = {m: [{"role": "system", "content": system_prompt(m, args.rules)}] for m in ("smol", "gemma")}
    turns = []
    with http_client() as client:
        for index in range(args.rounds):
            for model, history in histories.items():
                history.append({"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]})
                headers = {"Authorization": f"Bearer {KEY}"}
                if named:
                    headers["x-session-id"] = f"bench-{model}"
                body = {"model": model, "messages": history, "max_tokens": args.max_tokens, "temperature": 0}
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                found = turn(client, url, body, headers)
                history.append({"role": "assistant", "content": found.pop("text")})
                turns.append({"model": model, "turn": index + 1, **found})
    return turns


def summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    later = [t for t in turns if t["turn"] > 1]
    return {
        "turns": turns,
        "later_ttft_mean_s": statistics.fmean(t["ttft_s"] for t in later) if later else None,
        "later_decoded": sum(t["decoded_tokens"] for t in later),
        "later_prompt": sum(t["prompt_tokens"] for t in later),
    }


def contenders(args: argparse.Namespace, folder: Path) -> Iterator[tuple[str, Contender, bool]]:
    port = free_port()
    ours = [sys.executable, "-m", "llmsession", "serve", "--models-dir", str(folder), "--port", str(port)]
    ours += ["--max-loaded-models", "1", "--threads", str(args.threads), "--api-key", KEY, *MEMORY]
    for named in (True, False):
        yield f"llmsession ({'named' if named else 'unnamed'})", Contender("llmsession", ours, port), named
    if not args.llama_server_peer:
        return
    port, exe = free_port(), args.llama_server
    command = [str(exe), "--models-dir", str(folder), "--models-max", "1", "--port", str(port)]
    command += ["-t", str(within_cores(args.threads)), *LLAMA_SERVER_ARGS]
    env = reference_env()  # (llmsession's libraries)
    missing = None if exe.is_file() else f"{exe} not found: run python scripts/fetch_llama.py --bench"
    yield "llama-server router", Contender("llama-server", command, port, env=env, missing=missing), False


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results: dict[str, Any] = {"date": date, "machine": machine(args.threads), "rounds": args.rounds}
    results |= {"models": {"smol": args.smol.name, "gemma": args.gemma.name}, "servers": {}}
    with tempfile.TemporaryDirectory(prefix="llmsession-bench-models-") as work:
        folder = Path(work) / "models"
        folder.mkdir()
        (folder / "smol.gguf").symlink_to(args.smol.resolve())
        (folder / "gemma.gguf").symlink_to(args.gemma.resolve())
        for name, contender, named in contenders(args, folder):
            progress(f"{name}: {args.rounds} rounds of two models", started)
            if contender.missing:
                results["servers"][name] = {"skipped": contender.missing}
                continue
            log = Path(work) / f"{name.split()[0]}-{named}.log"
            try:
                with launched(contender, log) as url:
                    turns = converse(url, args, named)
                results["servers"][name] = {"command": shlex.join(contender.command), **summary(turns)}
            except (RuntimeError, OSError, httpx.HTTPError, ValueError) as error:
                results["servers"][name] = {"error": f"{type(error).__name__}: {error}", "log": log_tail(log)}
    results["ratios"] = ratios(results["servers"])
    progress("done", started)
    return results


def ratios(servers: dict[str, dict[str, Any]]) -> dict[str, float]:
    mine = servers.get("llmsession (named)", {}).get("later_ttft_mean_s")
    found = {}
    for other in ("llmsession (unnamed)", "llama-server router"):
        theirs = servers.get(other, {}).get("later_ttft_mean_s")
        if mine and theirs:
            found[other] = mine / theirs
    return found


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\n{results['date']}: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, llama.cpp", end="")
    print(f" {m['llama_cpp_commit']}; {results['models']['smol']} and {results['models']['gemma']}")
    for name, server in results["servers"].items():
        if "turns" not in server:
            print(f"\n{name}: {server.get('skipped') or server.get('error')}\n{server.get('log', '')}")
            continue
        rows = [
            [t["model"], str(t["turn"]), f"{t['ttft_s'] * 1e3:.0f}", f"{t['total_s'] * 1e3:.0f}",
             str(t["prompt_tokens"]), str(t["decoded_tokens"])]
            for t in server["turns"]
        ]  # fmt: skip
        mean = server["later_ttft_mean_s"]
        rows.append(
            ["", "2+", f"{mean * 1e3:.0f}", "", str(server["later_prompt"]), str(server["later_decoded"])]
        )
        table(name, ["model", "turn", "TTFT ms", "total ms", "prompt", "decoded"], rows)
    for other, ratio in results["ratios"].items():
        print(f"turns 2+, mean TTFT after a switch, llmsession (named) / {other}: {ratio:.3f}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmsession bench models", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=4, help="turns of each conversation")
    parser.add_argument("--rules", type=positive_int, default=60, help="system prompt length (rules)")
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="per reply")
    parser.add_argument("--smol", type=Path, default=paths.default_model_path())
    parser.add_argument("--gemma", type=Path, default=paths.gemma3_model_path())
    parser.add_argument("--threads", type=positive_int, default=default_threads(), help="every server's")
    parser.add_argument("--llama-server", type=Path, default=paths.llama_dir() / "bin" / "llama-server")
    parser.add_argument("--no-llama-server", dest="llama_server_peer", action="store_false")
    parser.add_argument("--json", type=output_file, help="write every number here")
    args = parser.parse_args(argv)
    results = run(args)
    publish(results, report, args.json)
    return 1 if any("error" in s for s in results["servers"].values()) else 0
