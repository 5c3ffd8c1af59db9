"""``llmsession setup`` and ``llmsession models``: what a user who installed the package runs.

``setup`` builds the pinned llama.cpp for this machine's CPU (its features are read at build
time: a prebuilt library for another CPU can fault) and fetches the default model, into the cache
(``--prefix`` or ``$LLMSESSION_CACHE``, else ``~/.cache/llmsession``); once done, running it again
is instant.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from llmsession.commands import paths
from llmsession.commands.argtypes import directory

SETUP_COMMAND = "llmsession setup"


def setup(args: argparse.Namespace) -> int:
    if args.prefix is not None:
        os.environ["LLMSESSION_CACHE"] = str(args.prefix)
    from . import setup_llama, setup_models  # after the prefix is set: they read the cache root

    status = setup_models.main([] if args.models else ["--only", "smollm2"])  # first: the build's
    if status != 0:  # smoke test decodes with the model when it is there
        return status
    return setup_llama.main(["--force"] if args.force else [])


def find_model(name: str | None) -> Path:
    """The model a ``--model PATH|NAME`` argument means (the default model without one); else
    FileNotFoundError saying why and how to get one."""
    path = paths.resolve_model(name) if name else paths.default_model_path()
    try:
        if path.exists():
            return path
    except OSError as error:  # (a folder it may not search, a name too long: not a traceback)
        raise FileNotFoundError(f"the model {str(path)!r:.300} cannot be read: {error.strerror}") from None
    several = [m.name for m in paths.model_candidates(str(name))] if name else []
    which = (
        f"the model {name!r} is not a file or a cached model"
        if name
        else f"the default model {path} is missing"
    )
    if len(several) > 1:
        which = f"{name!r} could mean {', '.join(several)}: say which"
    raise FileNotFoundError(
        f"{which}; fetch it with `{SETUP_COMMAND}`, or pass --model PATH (`llmsession models` lists them)"
    )


def models(args: argparse.Namespace) -> int:
    """The models in the cache, with their sizes; with ``--url``, a running server's."""
    url = getattr(args, "url", None)  # (``doctor`` lists the cache's through here too)
    if url is not None:
        from llmsession.commands.served_models import served

        return served(url, args.api_key)
    found = paths.cached_models()
    print(f"models in {paths.models_dir()}:" + ("" if found else f" none (run `{SETUP_COMMAND}`)"))
    for model in found:
        print(f"  {model.name:45}  {model.stat().st_size / (1 << 20):8.1f} MiB")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    setup_parser = commands.add_parser("setup", help="build llama.cpp for this machine and fetch the model")
    setup_parser.add_argument("--models", action="store_true", help="also fetch the test models (Gemma 3)")
    setup_parser.add_argument(
        "--prefix", type=directory, metavar="DIR", help="cache root (as $LLMSESSION_CACHE)"
    )
    setup_parser.add_argument("--force", action="store_true", help="rebuild llama.cpp even if it is built")
    models_parser = commands.add_parser("models", help="list the models in the cache, or a server's")
    models_parser.add_argument(
        "--url", metavar="URL", help="a running `llmsession serve`: its models and what it holds"
    )
    models_parser.add_argument("--api-key", metavar="KEY", help="the server's API key")
