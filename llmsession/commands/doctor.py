"""``llmsession doctor``: what a bug report needs (which llama.cpp, which CPU features, which
models and fixtures), and what RPC endpoints answer."""

from __future__ import annotations

import argparse
import sys

from llmsession.commands import installer, paths
from llmsession.commands.installer import SETUP_COMMAND
from llmsession.engine.budget import MemoryPlan
from llmsession.engine.sizing import DEFAULT_CONTEXT_CAP, RAM_SHARE
from llmsession.errors import LlmSessionError


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def doctor_rpc(endpoints: list[str]) -> int:
    """What each RPC endpoint answers, then the devices llama.cpp sees there."""
    from llmsession.native import llama as native
    from llmsession.native import rpc

    status, ready = 0, []
    for text in endpoints:
        try:
            info = rpc.preflight(rpc.parse_endpoint(text), timeout=5.0)
        except (LlmSessionError, ValueError) as e:
            error(str(e))
            status = 1
            continue
        version = ".".join(map(str, info.version))
        print(f"rpc {info.endpoint}: protocol {version}, {info.devices} device(s)")
        ready.append(str(info.endpoint))
    for line in native.device_names(ready) if ready else []:
        print(f"  {line}")
    return status


def doctor(args: argparse.Namespace) -> int:
    """What a bug report needs: which llama.cpp, which CPU features, which models and fixtures."""
    from llama_cffi import lib_dir

    from llmsession.commands.llama_cache import read_info
    from llmsession.native import llama as native

    if args.rpc:
        return doctor_rpc(args.rpc)

    print(f"library dir: {lib_dir()}")
    info_path = paths.llama_dir() / "build-info.json"
    info = read_info(paths.llama_dir())
    if info is not None:
        print(f"build info: {info_path}")
        for key, value in info.items():
            if isinstance(value, dict):  # cmake options
                value = " ".join(f"{k}={v}" for k, v in value.items())
            print(f"  {key}: {value}")
    else:
        print(f"build info: {info_path} missing or unreadable (run `{SETUP_COMMAND}`)")
    status = 0
    try:
        print(f"llama.cpp commit: {native.build_commit()} (pinned {paths.LLAMA_CPP_COMMIT})")
        print(f"system info: {native.system_info().strip()}")
    except (LlmSessionError, OSError) as e:
        error(f"the llama.cpp libraries do not load: {e}")
        status = 1
    installer.models(args)
    projector = paths.fixtures_dir() / "mmproj-tiny.gguf"
    print(f"projector fixture: {projector} {'present' if projector.exists() else 'missing'}")
    budget = MemoryPlan()
    print(
        "memory budget per model (the defaults; Model() arguments change them): "
        "kv_tokens: each live session gets the model's training context (up to "
        f"{DEFAULT_CONTEXT_CAP}, halved while the cells would take over {RAM_SHARE:.0%} of the memory "
        f"available), max_live_sessions {budget.max_live_sessions}, "
        f"kv_layout {budget.kv_layout}, "
        f"host_cache_bytes {budget.host_cache_bytes >> 20} MiB, disk_cache_dir none"
    )
    return status
