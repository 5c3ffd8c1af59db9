"""``llmsession serve``: the OpenAI-compatible server (``llmsession.serve``) on uvicorn.

Starlette and uvicorn are imported only when the command runs, so the rest of the command line
(and ``import llmsession``) never loads them. Binds 127.0.0.1 unless told otherwise. On SIGTERM
or Ctrl-C uvicorn stops accepting and lets streams finish for ``--shutdown-timeout`` seconds,
then cancels them; the model is closed (its spill folder removed) and the command exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmsession.commands import installer
from llmsession.commands.argtypes import directory, port, positive_int, seconds
from llmsession.commands.doctor import error
from llmsession.commands.serve_access import add_access_arguments, join_key_files
from llmsession.config import MemoryConfig, ModelConfig, SessionConfig
from llmsession.errors import LlmSessionError
from llmsession.options import DRAFTS, KV_LAYOUTS, KV_TYPES

if TYPE_CHECKING:
    import uvicorn

    from llmsession.engine.budget import MemoryReport


def serve(args: argparse.Namespace) -> int:
    from llmsession.commands.serve_cluster import check_cluster_arguments

    join_key_files(args)
    wrong = check_cluster_arguments(args)
    if wrong is not None:
        error(wrong)
        return 2
    from llmsession.commands.serve_models import several

    if several(args) and args.replicas is not None:
        error("--replicas serves one model: not several (--model NAME=PATH, --models-dir)")
        return 2
    try:
        model_path = None if several(args) else installer.find_model(args.model[0] if args.model else None)
    except FileNotFoundError as e:
        error(str(e))
        return 2
    try:
        import uvicorn

        from llmsession.serve.app import VOLATILE_LINES, create_app
        from llmsession.serve.origins import is_loopback
    except ModuleNotFoundError as e:
        error(f"`llmsession serve` needs {e.name}: pip install 'llmsession[serve]'")
        return 2
    from llmsession.api.model import Model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        config, memory = cli_configs(args)
        settings = app_settings(args, VOLATILE_LINES)
        settings["allowed_hosts"] = allowed_hosts(args)  # (replicas see the clients' own headers)
        if not args.api_key and not is_loopback(args.host):
            print(f"warning: {args.host} is not a loopback address and there is no --api-key: whoever "
                  "reaches the port may use the server", flush=True)  # fmt: skip
        if model_path is None:
            from llmsession.commands.serve_models import create_models

            with create_models(args, config, memory) as models:
                app = create_app(models, **settings)
                where = f"http://{args.host}:{args.port}/v1"
                print(f"serving {', '.join(models.names)} at {where} (each loads when asked)", flush=True)
                run(uvicorn, app, args)
            return 0
        if args.replicas is not None:
            from llmsession.commands.serve_cluster import serve_replicas

            return serve_replicas(args, model_path, config, memory, settings)
        with Model(model_path, config=config, memory=memory) as model:
            model.session(config=settings["session"]).close()  # checked against the memory now
            app = create_app(model, **settings)
            print(f"serving {model_path.name} at http://{args.host}:{args.port}/v1", flush=True)
            print(memory_line(model.memory(), args.disk_cache_dir, model.flash_attention), flush=True)
            print(f"prompts: {model.renderer}", flush=True)
            run(uvicorn, app, args)
    except (LlmSessionError, ValueError, OSError) as e:  # (a --models-dir it may not read, say)
        error(str(e))
        return 1
    return 0


def run(uvicorn: Any, app: Any, args: argparse.Namespace) -> None:
    """``app`` on uvicorn until SIGTERM or Ctrl-C (streams given ``--shutdown-timeout``)."""
    from llmsession.commands.serve_http import bounded_protocol

    server = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout,
        http=bounded_protocol(),  # (a request's head in time and in size)
    )
    quiet_exit(uvicorn.Server)(server).run()


def app_settings(args: argparse.Namespace, default_volatile: tuple[str, ...]) -> dict[str, Any]:
    """``create_app``'s settings, as the command line gives them."""
    volatile = volatile_lines(args)
    return {
        "api_key": args.api_key,
        "operator_key": args.operator_key,
        "model_name": args.model_name,
        "max_body_bytes": args.max_body_bytes,
        "cors_origins": args.cors_origin or (),
        "draft": args.draft,
        "session": SessionConfig(context_size=args.context_size or None),
        "volatile_lines": default_volatile if volatile is None else volatile,
    }


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """The host names the server answers to besides IP addresses: bound to a loopback address,
    or without keys, its own, ``localhost`` and the loopback addresses, and ``--allowed-host``
    (a web page that rebinds its name to the server's address names another); None (any) for a
    server with keys bound elsewhere (a page has no key)."""
    from llmsession.serve.origins import LOOPBACK_NAMES, is_loopback

    if any(not name or "/" in name or name.strip() != name for name in args.allowed_host or ()):
        raise ValueError("--allowed-host takes a host name (and a port if need be), not a URL")
    if not is_loopback(args.host) and args.api_key:
        return None
    return [*LOOPBACK_NAMES, args.host, *(args.allowed_host or ())]


def cli_configs(args: argparse.Namespace) -> tuple[ModelConfig, MemoryConfig]:
    """The ``Model`` configs the command line gives (the rest: the library's defaults); a wrong
    value is the configs' own ``TypeError`` or ``ValueError``."""
    names = ["mmproj_path", "threads", "stateless_sessions", "kv_type"]
    settings = {name: value for name in names if (value := getattr(args, name)) is not None}
    if args.flash_attention != "auto":
        settings["flash_attention"] = args.flash_attention == "on"
    memory_names = ["kv_tokens", "max_live_sessions", "kv_layout", "host_cache_bytes", "disk_cache_dir"]
    memory = {name: value for name in memory_names if (value := getattr(args, name)) is not None}
    return ModelConfig(**settings, **prompt_settings(args)), MemoryConfig(**memory)


def prompt_settings(args: argparse.Namespace) -> dict[str, Any]:
    """How prompts are rendered (``ModelConfig`` fields), as ``add_prompt_arguments`` asked."""
    settings: dict[str, Any] = {}
    if args.jinja != "auto":
        settings["use_jinja"] = args.jinja == "on"
    if args.chat_template is not None:
        settings["chat_template"] = args.chat_template
    if args.chat_template_file is not None:
        settings["chat_template"] = args.chat_template_file
    return settings


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """How prompts are rendered (``text.renderer``), as llama-server's flags of those names."""
    add = parser.add_argument
    add(
        "--jinja",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: the chat template through jinja when it renders, else llama.cpp's built-in templates",
    )
    template = parser.add_mutually_exclusive_group()
    template.add_argument(
        "--chat-template",
        metavar="NAME",
        help="a llama.cpp built-in template instead of the file's (chatml, gemma, llama3, ...)",
    )
    template.add_argument(
        "--chat-template-file", type=Path, metavar="FILE", help="a jinja chat template instead of the file's"
    )


def memory_line(report: MemoryReport, disk: Path | None, flash_attention: bool | None) -> str:
    """The memory settings a server starts with, so an operator sees what its budget is."""
    spill = f"then on disk in {disk}" if disk is not None else "then dropped (no --disk-cache-dir)"
    flash = {None: "llama.cpp's choice", True: "on", False: "off"}[flash_attention]
    cells = (
        f"{report.session_cells} KV cells of its own for each of up to {report.max_live_sessions} live "
        "sessions"
        if report.kv_layout == "per_session"
        else f"{report.kv_tokens} KV cells shared by up to {report.max_live_sessions} live sessions"
    )
    return (
        f"memory: {cells} (about {report.kv_bytes / 2**20:.0f} MiB; {report.kv_sizing}); "
        f"parked states up to {report.host_cache_bytes / 2**20:.0f} MiB in RAM, {spill}; "
        f"flash attention {flash}"
    )


def quiet_exit(base: type[uvicorn.Server]) -> type[uvicorn.Server]:
    """uvicorn's server, except that a SIGTERM or SIGINT it shut down for is not raised again
    once it returns: uvicorn does, which killed the process before the model was closed (its
    spill folder left behind) and made the exit status 143."""

    class Server(base):  # type: ignore[valid-type,misc]  # (a class made at run time)
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            signals = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None
    return text


def volatile_lines(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The volatile lines the command names (an empty one: none), or None for the default."""
    given: list[str] | None = args.volatile_line
    return None if given is None else tuple(line for line in given if line)


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add = parser.add_argument
    add(
        "--model",
        action="append",
        metavar="PATH|NAME|NAME=PATH",
        help="GGUF file or cached model name (default: SmolLM2-135M-Instruct); repeatable, or "
        "NAME=PATH: several models, each request answered by the one its `model` names",
    )
    add("--mmproj", dest="mmproj_path", type=Path, metavar="PATH", help="multimodal projector: image input")
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=port, default=8080, help="TCP port (default: %(default)s)")
    add_access_arguments(parser)
    add("--model-name", metavar="NAME", help="the model's id in the API (default: the file's stem)")
    add("--threads", type=positive_int, metavar="N", help="CPU threads (default: up to 8)")
    add(
        "--context-size",
        type=positive_int,
        metavar="N",
        help="positions per conversation (default: the model's training context, as sized)",
    )
    add_memory_arguments(parser)
    add_prompt_arguments(parser)
    add_http_arguments(parser)
    from llmsession.commands.serve_cluster import add_cluster_arguments
    from llmsession.commands.serve_models import add_models_arguments

    add_models_arguments(parser)
    add_cluster_arguments(parser)


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """What requests may hold, and how the server stops."""
    add = parser.add_argument
    add(
        "--max-body-bytes",
        type=positive_int,
        default=8 << 20,
        metavar="N",
        help="largest request body (default: %(default)s)",
    )
    add(
        "--volatile-line",
        action="append",
        type=regex,
        metavar="REGEX",
        help="system-prompt text that changes every request, removed where it matches before "
        "rendering (repeatable; default: Claude Code's x-anthropic-billing-header line; "
        "--volatile-line '' removes none)",
    )
    add(
        "--shutdown-timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="on SIGTERM, how long streams may finish (default: %(default)s)",
    )


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """How the server holds its conversations: cells, sequences, parking, drafts."""
    add = parser.add_argument
    add(
        "--kv-tokens",
        type=positive_int,
        metavar="N",
        help="KV cells of live conversations (default: each live conversation gets the model's "
        "training context, up to 32768, as memory allows)",
    )
    add("--max-live-sessions", type=positive_int, metavar="N", help="sequences decoding at once (default: 4)")
    add(
        "--kv-layout",
        choices=KV_LAYOUTS,
        help="per_session: each live conversation attends over kv-tokens / max-live-sessions cells of its "
        "own (default); shared: one pool, a conversation may hold all of it, every decode attends over all",
    )
    add("--host-cache-bytes", type=positive_int, metavar="N", help="RAM for parked conversations (1 GiB)")
    add("--disk-cache-dir", type=directory, metavar="DIR", help="spill parked conversations here")
    add(
        "--kv-type",
        choices=KV_TYPES,
        help="the KV cells' type: q8_0 holds twice the tokens in the same memory (default: f16)",
    )
    add(
        "--flash-attention",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: on the CPU with f16 cells, what a probe of the model found faster here; else llama.cpp's",
    )
    add(
        "--draft",
        choices=DRAFTS,
        help="drafted tokens for every request: prompt_lookup verifies what followed the reply's last "
        "tokens in the transcript (faster where replies copy their prompt; off by default)",
    )
    add(
        "--stateless-sessions",
        type=positive_int,
        metavar="N",
        help="conversations kept for returning clients (default: 64, or 4 per live session)",
    )
