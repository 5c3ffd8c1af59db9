"""``llmsession serve`` with several models: ``--model NAME=PATH`` (repeatable) or
``--models-dir DIR``, each request answered by the model its ``model`` field names, loaded on
demand (``llmsession.Models``), bounded by ``--max-loaded-models`` and ``--memory-limit``,
unloaded after ``--idle-unload`` seconds idle."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmsession.api.modelfiles import ModelFile
from llmsession.api.models import Models
from llmsession.commands import installer, paths
from llmsession.commands.argtypes import positive_int, seconds
from llmsession.config import MemoryConfig, ModelConfig


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--models-dir",
        type=Path,
        metavar="DIR",
        help="serve every .gguf in DIR by its name (a projector beside it: NAME.mmproj.gguf or "
        "mmproj-NAME.gguf), each loaded when a request names it",
    )
    add(
        "--max-loaded-models",
        type=positive_int,
        metavar="N",
        help="with several models: at most N loaded at once, the least recently used idle one "
        "unloaded first (default: no bound but --memory-limit)",
    )
    add(
        "--memory-limit",
        type=positive_int,
        metavar="BYTES",
        help="with several models: what loaded models may hold in all (weights, KV cells, host "
        "cache); a load past it unloads idle models first, else is a 503",
    )
    add(
        "--idle-unload",
        type=seconds,
        metavar="S",
        help="with several models: unload a model S seconds after its last request (its named "
        "conversations parked; a request's keep_alive replaces it, an operator's where there are "
        "--operator-keys; default: never)",
    )


def several(args: argparse.Namespace) -> bool:
    """Whether the command line names several models (or one by ``NAME=PATH``)."""
    given = args.model or []
    return args.models_dir is not None or len(given) > 1 or any(named(value)[0] for value in given)


def named(value: str) -> tuple[str | None, str]:
    """A ``--model`` value's name (``NAME=PATH``) and where the model is; a path that exists as
    given is a path, whatever it holds."""
    name, sep, where = value.partition("=")
    if sep and Models.is_name(name) and not paths.exists(Path(value).expanduser()):
        return name, where
    return None, value


def model_files(args: argparse.Namespace) -> dict[str, ModelFile]:
    """The models the command line names; ``ValueError`` or ``FileNotFoundError`` saying what
    is wrong."""
    if args.mmproj_path is not None:
        raise ValueError(
            "with several models, a projector lies beside its model (--models-dir), not --mmproj"
        )
    if args.model_name is not None:
        raise ValueError("with several models, each is named by NAME=PATH or its file: not --model-name")
    files: dict[str, ModelFile] = {}
    if args.models_dir is not None:
        files.update(Models.files_in(args.models_dir))
    for value in args.model or []:
        given, where = named(value)
        path = installer.find_model(where)
        name = given or path.stem
        if not Models.is_name(name):
            raise ValueError(f"{path.name!r} needs a model name: --model NAME={where}")
        if name in files:
            raise ValueError(f"two models named {name!r}")
        files[name] = ModelFile(path)
    return files


def create_models(args: argparse.Namespace, config: ModelConfig, memory: MemoryConfig) -> Models:
    """The ``Models`` the command line asks for (none loaded yet)."""
    return Models(
        model_files(args),
        max_loaded=args.max_loaded_models,
        memory_limit=args.memory_limit,
        idle_unload=args.idle_unload,
        config=config,
        memory=memory,
    )
