"""The public-API fuzzer (issue 13): a hypothesis state machine driving three sessions on one
real model through ``respond``, partial and cancelled streams, transcript edits (valid and
invalid), cache clears, images, bad options and bad contents, and context overflow.

llama.cpp can abort the process, so ``tests/test_fuzz.py`` runs this file as a subprocess and
requires exit status 0. Run it by hand::

    .venv/bin/python tests/fuzz_worker.py                 # the fast, derandomized CI profile
    .venv/bin/python tests/fuzz_worker.py --minutes 5     # seeded runs until the time is up
    .venv/bin/python tests/fuzz_worker.py --seed 123 --runs 1   # replay one long-profile run

The machine is ``fuzz_machine.py``, its oracle ``fuzz_oracle.py``, its inputs ``fuzz_inputs.py``.
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fuzz_env import STATS, Env, set_env
from fuzz_machine import SessionFuzzer
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import run_state_machine_as_test
from test_reuse import short_prompt_noise, tolerance_for

from llmsession import Image, Model
from llmsession.commands import paths

COMMON = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": list(HealthCheck),
}
FAST = settings(max_examples=9, stateful_step_count=12, derandomize=True, **COMMON)  # type: ignore[arg-type]
LONG = settings(max_examples=4, stateful_step_count=30, derandomize=False, **COMMON)  # type: ignore[arg-type]


def run_long(minutes: float, base_seed: int, runs: int | None) -> None:
    deadline = time.monotonic() + 60 * minutes
    run = 0
    while (runs is None and time.monotonic() < deadline) or (runs is not None and run < runs):
        run_seed = base_seed + run
        started, examples, steps = time.monotonic(), STATS.examples, STATS.steps

        def factory() -> SessionFuzzer:  # seeded, not the class: @seed would stay on it
            return SessionFuzzer()

        print(
            f"run {run}: seed {run_seed} (replay: tests/fuzz_worker.py --seed {run_seed} --runs 1)",
            flush=True,
        )
        seeded = hypothesis_seed(run_seed)(factory)
        run_state_machine_as_test(seeded, settings=LONG)  # type: ignore[arg-type]  # a factory is fine
        print(
            f"run {run}: {STATS.examples - examples} examples, {STATS.steps - steps} steps, "
            f"{time.monotonic() - started:.1f} s",
            flush=True,
        )
        run += 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=paths.default_model_path())
    parser.add_argument("--fixtures", type=Path, default=paths.fixtures_dir())
    parser.add_argument("--minutes", type=float, default=0.0, help="seeded runs until the time is up")
    parser.add_argument("--seed", type=int, default=None, help="the first run's seed (long profile)")
    parser.add_argument("--runs", type=int, default=None, help="this many long-profile runs")
    parser.add_argument("--log", type=Path, default=None, help="append every step here (for crashes)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    parser.add_argument(
        "--noise", type=float, default=None, help="use this split noise (all prompt sizes), do not measure it"
    )
    parser.add_argument(
        "--short-noise",
        type=float,
        default=None,
        help="the ~300-token split noise, measured by the caller on the same file, build and threads",
    )
    args = parser.parse_args(argv)
    faulthandler.enable()
    started = time.monotonic()
    log = args.log.open("a", encoding="utf-8") if args.log else None
    image_paths = {name: args.fixtures / f"image-{name}.png" for name in ("red", "blue")}
    # A tight budget (two live sequences of 1,024 cells of their own, room for a few parked
    # states) so every step also moves sessions between live, parked and cold under the
    # differential checks.
    budget = {"kv_tokens": 2048, "max_live_sessions": 2, "host_cache_bytes": 24 << 20}
    mmproj = args.fixtures / "mmproj-tiny.gguf"
    with Model(args.model, mmproj_path=mmproj, threads=args.threads, **budget) as model:
        given = args.noise if args.noise is not None else args.short_noise
        noise = short_prompt_noise(model) if given is None else given
        set_env(
            Env(
                model=model,
                noise=noise,
                images={name: Image(path) for name, path in image_paths.items()},
                image_paths=image_paths,
                log=log,
                long_noise=args.noise,
            )
        )
        print(
            f"model loaded, split noise {noise:.4f}, tolerance {tolerance_for(noise):.4f} "
            f"({time.monotonic() - started:.1f} s)",
            flush=True,
        )
        try:
            if args.minutes > 0 or args.seed is not None or args.runs is not None:
                base = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
                run_long(args.minutes, base, args.runs)
            else:
                run_state_machine_as_test(SessionFuzzer, settings=FAST)
        finally:
            print(f"fuzzer: {STATS.summary()}\n  total {time.monotonic() - started:.1f} s", flush=True)
            print(f"  {model.memory()}", flush=True)
            if log is not None:
                log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
