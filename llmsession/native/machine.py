"""What this machine gives a process: its CPU's name and the cores it may run on. Pure of
llama.cpp: it reads the kernel's files."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, as the kernel gives it ("unknown" where it gives none)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity (a cpuset, ``taskset``), at most its
    cgroup's CPU quota (``docker --cpus``); ``os.cpu_count`` knows neither."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def default_threads() -> int:
    """One thread per usable core, at most 8: llama.cpp's threads spin at every graph node's
    barrier, so one more thread than cores makes each decode wait for a descheduled one (three
    threads on two cores took 3 s per SmolLM2 token instead of 5 ms)."""
    return min(usable_cores(), 8)


def within_cores(threads: int) -> int:
    """``threads`` cut to the cores this process may use: every native object decodes with at
    most that many (``runtime.loading.checked_threads`` warns a caller who asked for more)."""
    return max(1, min(threads, usable_cores()))
