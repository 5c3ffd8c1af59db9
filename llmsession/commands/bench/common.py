"""What every ``llmsession bench`` scenario shares: arguments, the machine's description, the
llama-cpp-python worker, tables, progress lines and the JSON output."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from llama_cffi import lib_dir

from llmsession.api.model import local_model
from llmsession.commands import paths
from llmsession.commands.argtypes import output_file, positive_int
from llmsession.native.llama import build_commit
from llmsession.native.machine import cpu_name, within_cores
from llmsession.native.sampler import Sampler
from llmsession.options import GenerationOptions

if TYPE_CHECKING:
    from llmsession.api.model import Model
    from llmsession.native.constraints import Constraint

PEER_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_peer.py"  # (in the repository)


def run_worker(python: str, config: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python in a worker process (its own venv is fine) on llmsession's llama.cpp build;
    ``{"skipped": why}`` when it cannot run."""
    lib = os.environ.get("LLAMA_CPP_LIB_PATH") or str(lib_dir())
    env = os.environ | {"LLAMA_CPP_LIB_PATH": lib}
    if not PEER_SCRIPT.exists():
        return {"skipped": f"{PEER_SCRIPT} is missing (it lives in the repository, not the package)"}
    if subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, env=env).returncode != 0:
        return {"skipped": f"llama_cpp is not importable by {python} (see --peer-python)"}
    cmd = [python, str(PEER_SCRIPT)]
    out = subprocess.run(cmd, input=json.dumps(config), capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"skipped": f"the peer worker failed ({out.returncode}): {out.stderr.strip()[-500:]}"}
    peer: dict[str, Any] = json.loads(out.stdout)
    return peer


def machine(threads: int) -> dict[str, Any]:
    """The machine a benchmark ran on, with the threads every side decoded with (``threads`` cut
    to the usable cores, as the library and the references cut them)."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": within_cores(threads),
        "llama_cpp_commit": build_commit(),
    }


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Right-aligned columns, each as wide as its widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """What every ``llmsession bench`` scenario takes: the model, threads, the peer, --json."""
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--threads", type=positive_int, default=None, help="default: llmsession's default")
    parser.add_argument("--peer", choices=["llama-cpp-python"], help="also run the scenario through it")
    parser.add_argument("--peer-python", default=sys.executable, help="a Python that imports the peer")
    parser.add_argument("--json", type=output_file, help="write every number here")
    parser.add_argument(
        "--llama-bench", type=Path, default=default_llama_bench(), help="its binary (references)"
    )


def publish(results: dict[str, Any], report: Callable[[dict[str, Any]], None], path: Path | None) -> int:
    """Print the tables; with ``--json``, write every number too."""
    report(results)
    if path is not None:
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nwrote {path}")
    return 0


def progress(step: str, started: float) -> None:
    """A line on stderr per step: a run takes minutes, and a busy machine makes it longer."""
    print(f"[{time.perf_counter() - started:6.1f}s] {step}", file=sys.stderr, flush=True)


def default_llama_bench() -> Path:
    return paths.llama_dir() / "bin" / "llama-bench"  # where fetch_llama.py --bench puts it


def flash_attn_option(flash_attention: bool | None) -> str:
    """llama-bench's ``-fa`` value for a model's flash-attention choice."""
    return {None: "auto", True: "on", False: "off"}[flash_attention]


def reference_env() -> dict[str, str]:
    """The environment a llama.cpp tool runs in: its rpath is its own folder, so the libraries
    llmsession loads (``LLMSESSION_LIB_DIR`` included) come first on its library path."""
    search = [str(lib_dir()), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    return os.environ | {"LD_LIBRARY_PATH": os.pathsep.join(search)}


def reference(exe: Path, model_path: Path, threads: int, *options: str) -> dict[str, str]:
    """Run one of llama.cpp's own benchmarks (llama-bench, llama-batched-bench) on llmsession's
    very libraries (``LLMSESSION_LIB_DIR`` included): its output and command, or an error."""
    if not exe.exists():
        return {"error": f"{exe.name} not found at {exe}: run python scripts/fetch_llama.py --bench"}
    env = reference_env()
    cmd = [str(exe), "-m", str(model_path), "-t", str(within_cores(threads)), *options]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": f"{exe.name} failed ({out.returncode}): {out.stderr.strip()[-500:]}"}
    return {"stdout": out.stdout, "command": " ".join(cmd)}


def llama_bench(exe: Path, model_path: Path, threads: int, *options: str) -> dict[str, Any]:
    """One llama-bench run: its tokens/s samples, one list per test it ran."""
    run = reference(exe, model_path, threads, *options, "-o", "json")
    if "error" in run:
        return run
    rows = json.loads(run["stdout"])
    samples = [[float(x) for x in row["samples_ts"]] for row in rows]
    return {
        "samples_ts": samples[0],
        "tests": samples,
        "build_commit": rows[0]["build_commit"],
        "command": run["command"],
    }


def batched_bench(exe: Path, model_path: Path, threads: int, *options: str) -> dict[str, Any]:
    """One llama-batched-bench run (N sequences prefilled, then generating in one batch per
    step: llama.cpp's continuous batching): a row per N."""
    run = reference(exe, model_path, threads, *options, "--output-format", "jsonl")
    if "error" in run:
        return run
    rows = [json.loads(line) for line in run["stdout"].splitlines() if line.startswith("{")]
    return {"rows": rows, "command": run["command"]}


def mask_cost(model: Model, constraint: Constraint, text: str) -> float:
    """Milliseconds per token to compute ``constraint``'s mask and apply it to a logits row,
    walking its matcher along ``text``'s tokens: what a constrained step adds to the decode."""
    n_vocab = local_model(model).native.n_vocab
    guide = constraint.sampler(Sampler.from_options(GenerationOptions(), n_vocab=n_vocab, last_n=0), n_vocab)
    logits, spent = np.zeros(n_vocab, np.float32), 0.0
    tokens = model.tokenize(text, add_special=False)
    for token in tokens:
        began = time.perf_counter()
        guide.restrict(logits)
        spent += time.perf_counter() - began
        if not guide.matcher.consume_token(token):
            break
    guide.close()
    return 1000 * spent / max(1, len(tokens))
