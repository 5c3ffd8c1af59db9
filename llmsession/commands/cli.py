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
import json
import os
import sys
from pathlib import Path
from typing import Any

from llmsession.api.model import Model
from llmsession.commands import installer, serve
from llmsession.commands.argtypes import port, positive_int, temperature
from llmsession.commands.doctor import doctor, error
from llmsession.commands.terminal_chat import Chat
from llmsession.config import MemoryConfig, ModelConfig
from llmsession.errors import LlmSessionError
from llmsession.options import GenerationOptions
from llmsession.text.tools import checked_tools


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
        # One conversation: one live sequence holding all the cells (its context, else the default).
        config = ModelConfig(mmproj_path=args.mmproj, threads=args.threads, **serve.prompt_settings(args))
        memory = MemoryConfig(max_live_sessions=1, kv_tokens=args.context_size)
        with Model(model_path, config=config, memory=memory) as model:
            session = model.session(system=args.system, context_size=args.context_size)
            if sys.stdin.isatty():
                print(f"{model_path.name}: /help lists the commands, Ctrl-D quits", flush=True)
            return Chat(model, session, options, has_projector=args.mmproj is not None).run()
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
    add(
        "--context-size",
        type=positive_int,
        metavar="N",
        help="context tokens (default: the model's training context, up to 32768, as memory allows)",
    )
    add(
        "--temperature", type=temperature, default=0.8, metavar="T", help="0 is greedy (default: %(default)s)"
    )
    add("--max-tokens", type=positive_int, default=512, metavar="N", help="per reply (default: %(default)s)")
    add("--threads", type=positive_int, metavar="N", help="CPU threads (default: up to 8)")
    serve.add_prompt_arguments(chat_parser)
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
