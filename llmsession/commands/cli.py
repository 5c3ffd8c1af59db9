"""The ``llmsession`` command: chat with a local model, check the installation, run the benchmark.

    llmsession chat [--model PATH] [--mmproj PATH] [--system TEXT] ...
    llmsession serve [--model PATH] [--host H] [--port P] [--api-key KEY] ...
    llmsession doctor [--rpc HOST:PORT ...]
    llmsession rpc-server [--port P] [--host H] [--threads N]
    llmsession bench ...

Chat reads one message per line, from a terminal or a pipe. Replies stream as they decode and
Ctrl-C cancels the reply (prefill included), not the program; Ctrl-C or Ctrl-D at the prompt quits.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from llmsession.api.model import Model
from llmsession.commands import installer, serve
from llmsession.commands.argtypes import port, positive_int, temperature
from llmsession.commands.doctor import doctor, error
from llmsession.errors import LlmSessionError
from llmsession.options import GenerationOptions
from llmsession.replies import Reply, ToolCall
from llmsession.runtime.session import Session
from llmsession.text.tools import checked_tools

MAX_ROUNDS = 8  # tool rounds after one message
HELP = """commands:
  /image PATH   attach an image to the next message (needs --mmproj)
  /json FILE    hold the next reply to the JSON schema in FILE
  /undo         drop the last exchange
  /reset        start over (keeps the system message)
  /stats        session totals
  /help         this help
Ctrl-C cancels a reply; Ctrl-C or Ctrl-D at the prompt quits."""


@dataclass
class Totals:
    """What the session has cost so far, for ``/stats``."""

    turns: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    decoded_prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def add(self, reply: Reply, seconds: float) -> None:
        usage = reply.usage
        self.turns += 1
        self.prompt_tokens += usage.prompt_tokens
        self.reused_tokens += usage.reused_tokens
        self.decoded_prompt_tokens += usage.decoded_prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.seconds += seconds

    def __str__(self) -> str:
        return (
            f"turns {self.turns} | prompt tokens {self.prompt_tokens} (reused {self.reused_tokens}, "
            f"decoded {self.decoded_prompt_tokens}) | completion tokens {self.completion_tokens} | "
            f"total {self.seconds:.2f}s"
        )


class Chat:
    """The chat loop's state: the session, images waiting for the next message, and totals."""

    def __init__(self, session: Session, options: GenerationOptions, has_projector: bool) -> None:
        self.session = session
        self.options = options
        self.after_results = replace(options, tool_choice="auto")  # (a forced call, then the answer)
        self.has_projector = has_projector
        self.images: list[Any] = []
        self.schema: dict[str, Any] | None = None  # for the next reply only
        self.totals = Totals()
        self.out: TextIO = sys.stdout
        self.dim = sys.stdout.isatty()

    def note(self, text: str) -> None:
        """A line that is not part of a reply: dim on a terminal, plain in a pipe or file."""
        print(f"\x1b[2m{text}\x1b[0m" if self.dim else text, file=self.out, flush=True)

    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/image":
            self.attach(arg)
        elif name == "/json":
            self.constrain(arg)
        elif name == "/undo":
            self.undo()
        elif name == "/reset":
            self.session.messages[:] = [m for m in self.session.messages[:1] if m["role"] == "system"]
            self.session.clear_cached_context()
            self.images.clear()
            self.totals = Totals()
            self.note("[reset]")
        elif name == "/stats":
            self.note(str(self.totals))
            self.note(str(self.session.model.memory()))
        elif name == "/help":
            print(HELP, file=self.out)
        else:
            error(f"unknown command {name}; /help lists them")

    def attach(self, path: str) -> None:
        if not self.has_projector:
            error("images need a projector: start the chat with --mmproj PATH")
            return
        if not path:
            error("usage: /image PATH")
            return
        if "\0" in path:
            error("an image path cannot contain a NUL character")
            return
        from llmsession.text.images import Image  # loads PIL: only when an image is used

        self.images.append(Image(path))
        self.note(f"[image {path} attached to the next message]")

    def constrain(self, path: str) -> None:
        if not path:
            error("usage: /json SCHEMA_FILE")
            return
        try:
            schema = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError) as problem:  # (nested too deep for json)
            error(f"cannot read a JSON schema from {path}: {problem or type(problem).__name__}")
            return
        self.session.model.constraint(GenerationOptions(json_schema=schema))  # GrammarError now
        self.schema = schema
        self.note(f"[the next reply follows the schema in {path}]")

    def undo(self) -> None:
        """Drop the last user message and everything after it; the cache keeps the common prefix."""
        messages = self.session.messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            error("nothing to undo")
            return
        del messages[users[-1] :]
        self.note("[undone]")

    def send(self, text: str) -> None:
        """Stream one reply, and the rounds of tool results it asks for."""
        (images, self.images), (schema, self.schema) = (self.images, []), (self.schema, None)
        content: Any = [*images, text] if images else text  # (sent or refused, they do not carry over)
        options = (
            replace(self.options, json_schema=schema, tools=None, tool_choice="auto")
            if schema
            else self.options
        )
        reply = self.reply_to(content, options)
        for _ in range(MAX_ROUNDS):  # as long as the replies call tools, or until input ends
            if reply is None or not reply.tool_calls:
                return
            results = self.results_of(reply.tool_calls)
            if results is None:
                print(file=self.out)
                return
            reply = self.reply_to(results, self.after_results)
        if reply is not None and reply.tool_calls:
            self.note(f"[stopped after {MAX_ROUNDS} rounds of tool calls]")

    def reply_to(self, content: Any, options: GenerationOptions) -> Reply | None:
        """Stream one reply; SIGINT cancels it through the abort flag rather than an exception."""
        began = time.perf_counter()
        stream = self.session.stream(content, options)
        previous = signal.signal(signal.SIGINT, lambda *_: stream.cancel())
        try:
            for snapshot in stream:
                self.out.write(snapshot.delta)
                self.out.flush()
        finally:
            signal.signal(signal.SIGINT, previous)
            stream.close()
        if stream.reply is not None:
            self.report(stream.reply, options, began)
        return stream.reply

    def results_of(self, calls: Sequence[ToolCall]) -> list[Any] | None:
        """Each call printed and its result read (a line); None once input ends."""
        results: list[Any] = []
        for call in calls:
            self.note(f"[call {call.name}({call.arguments}), id {call.id}]")
            try:
                result = input(f"result of {call.name}> " if sys.stdin.isatty() else "")
            except EOFError:
                return None
            results.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return results

    def report(self, reply: Reply, options: GenerationOptions, began: float) -> None:
        """The line after a reply: how it ended, and what it cost."""
        self.out.write("\n" if reply.text and not reply.text.endswith("\n") else "")
        if reply.finish_reason == "cancelled":
            self.note("[cancelled]")
        elif options.json_schema is not None:
            complete = reply.finish_reason == "complete"
            self.note("[valid JSON for the schema]" if complete else "[cut short: the JSON is incomplete]")
        seconds = time.perf_counter() - began
        self.totals.add(reply, seconds)
        usage, timings = reply.usage, reply.timings
        self.note(
            f"[prompt {usage.prompt_tokens} tokens: reused {usage.reused_tokens}, "
            f"decoded {usage.decoded_prompt_tokens} | first token {timings.time_to_first_token_s:.2f}s | "
            f"{usage.completion_tokens} tokens, {timings.generation_tokens_per_s:.1f} tok/s]"
        )

    def run(self) -> int:
        """Read and handle lines until end of input; a bad line is reported and the chat goes on."""
        interactive = sys.stdin.isatty()
        if interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (line editing and history for input())
        if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable bytes become surrogates, not an error
            sys.stdin.reconfigure(errors="surrogateescape")
        while True:
            try:
                line = input("> " if interactive else "").strip()
            except (EOFError, KeyboardInterrupt):
                if interactive:
                    print(file=self.out)
                return 0
            except UnicodeDecodeError:  # a stdin that could not be told to escape bad bytes
                error(f"{not_decodable()}; line skipped")
                continue
            if not line:
                continue
            try:
                self.handle(line)
            except (LlmSessionError, ValueError, TypeError) as e:  # this line failed, not the chat
                error(str(e))
            except KeyboardInterrupt:  # between turns, before the reply's own handler
                self.note("[cancelled]")

    def handle(self, line: str) -> None:
        if any("\ud800" <= c <= "\udfff" for c in line):  # escaped bytes (or lone surrogates)
            raise ValueError(f"{not_decodable()}; line skipped")
        if line.startswith("/"):
            self.command(line)
        else:
            self.send(line)


def not_decodable() -> str:
    """What is wrong with a line of bytes that stdin's encoding cannot decode."""
    encoding = getattr(sys.stdin, "encoding", None) or "utf-8"
    return f"input is not valid {codecs.lookup(encoding).name.upper()}"


def chat(args: argparse.Namespace) -> int:
    try:
        model_path = installer.find_model(args.model)
    except FileNotFoundError as e:
        error(str(e))
        return 2
    try:
        tools = read_tools(args.tools) if args.tools else None
        named = args.tool_choice not in ("auto", "required", "none")
        choice = {"type": "function", "function": {"name": args.tool_choice}} if named else args.tool_choice
        if tools is None and args.tool_choice not in ("auto", "none"):
            raise ValueError("--tool-choice needs --tools")
        checked_tools(tools, choice)  # (a tool it names must be one of them)
        options = GenerationOptions(
            max_tokens=args.max_tokens, temperature=args.temperature, tools=tools, tool_choice=choice
        )
        # One conversation: one live sequence, which may hold the whole budget.
        with Model(model_path, mmproj_path=args.mmproj, threads=args.threads, max_live_sessions=1) as model:
            session = model.session(system=args.system, context_size=args.context_size)
            if sys.stdin.isatty():
                print(f"{model_path.name}: /help lists the commands, Ctrl-D quits", flush=True)
            return Chat(session, options, has_projector=args.mmproj is not None).run()
    except (LlmSessionError, ValueError) as e:
        error(str(e))
        return 1


def read_tools(path: Path) -> tuple[Any, ...]:
    """The tools in a JSON file, checked now (ValueError naming the problem)."""
    try:
        specs = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as problem:
        raise ValueError(f"cannot read tools from {path}: {problem or type(problem).__name__}") from None
    if not isinstance(specs, list):
        raise ValueError(f"{path}: tools must be a JSON list of function specs")
    checked_tools(specs)
    return tuple(specs)


def rpc_server(args: argparse.Namespace) -> int:
    """Serve this machine's CPU to a model loaded on another host (``Model(rpc_servers=...)``)."""
    from llmsession.native import rpc

    try:
        command = rpc.server_command(args.port, args.host, args.threads)
    except FileNotFoundError as e:
        error(str(e))
        return 1
    print(f"serving on {args.host}:{args.port}: {' '.join(command)}", flush=True)
    os.execv(command[0], command)


def bench(argv: list[str]) -> int:
    """Hand the arguments to the session benchmark; imported only here, it may not be installed."""
    try:
        from llmsession.commands.bench.main import main as bench_main
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.bench":
            raise
        error("`llmsession bench` is not available in this installation")
        return 2
    return bench_main(argv)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llmsession", description="Multi-turn chat with local GGUF models.")
    commands = top.add_subparsers(
        dest="command", required=True, metavar="{chat,serve,setup,models,doctor,rpc-server,bench}"
    )
    chat_parser = commands.add_parser("chat", help="chat with a model in the terminal")
    add = chat_parser.add_argument
    add(
        "--model", metavar="PATH|NAME", help="GGUF file or cached model name (default: SmolLM2-135M-Instruct)"
    )
    add("--mmproj", type=Path, metavar="PATH", help="multimodal projector GGUF, enables /image")
    add("--system", metavar="TEXT", help="system message")
    add(
        "--tools",
        type=Path,
        metavar="FILE",
        help="a JSON list of OpenAI function specs: calls are printed, you type each result",
    )
    add(
        "--tool-choice",
        default="auto",
        metavar="auto|required|none|NAME",
        help="whether a message's reply calls (a tool's name: that one); replies to results: auto",
    )
    add("--context-size", type=positive_int, default=4096, metavar="N", help="context tokens (default: 4096)")
    add(
        "--temperature", type=temperature, default=0.8, metavar="T", help="0 is greedy (default: %(default)s)"
    )
    add("--max-tokens", type=positive_int, default=512, metavar="N", help="per reply (default: %(default)s)")
    add("--threads", type=positive_int, metavar="N", help="CPU threads (default: up to 8)")
    serve.add_command(commands)
    installer.add_commands(commands)
    doctor_parser = commands.add_parser(
        "doctor", help="show the llama.cpp build, CPU features and cached models"
    )
    doctor_parser.add_argument(
        "--rpc", action="append", metavar="HOST:PORT", help="instead, check an RPC server (repeatable)"
    )
    server = commands.add_parser("rpc-server", help="serve this machine's CPU to a model on another host")
    server.add_argument("--port", type=port, default=50052, help="TCP port (default: %(default)s)")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: %(default)s; the server trusts every client)",
    )
    server.add_argument(
        "--threads", type=positive_int, metavar="N", help="CPU threads (default: the server's)"
    )
    commands.add_parser("bench", help="benchmark sessions (arguments go to the benchmark)", add_help=False)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark's own parser
        return bench(argv[1:])
    args = parser().parse_args(argv)
    try:
        run = {"chat": chat, "setup": installer.setup, "models": installer.models, "doctor": doctor}
        run["rpc-server"], run["serve"] = rpc_server, serve.serve
        return run[args.command](args)
    except KeyboardInterrupt:  # while loading the model, say
        return 130


if __name__ == "__main__":
    sys.exit(main())
