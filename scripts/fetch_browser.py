#!/usr/bin/env python3
"""Make sure the browser tests (``tests/test_page.py``) have their browser: Debian's ``chromium``
and ``chromium-driver`` (``/usr/bin/chromium``, ``/usr/bin/chromedriver``), which Selenium drives
headless. ``make test`` runs this first. When one is missing it is installed with ``apt-get`` if
this runs as root (as CI does); otherwise the command to run is printed and this fails, so the
suite never starts without them (the tests would fail, not skip, anyway).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

NEEDED = {Path("/usr/bin/chromium"): "chromium", Path("/usr/bin/chromedriver"): "chromium-driver"}


def missing() -> list[str]:
    return [package for path, package in NEEDED.items() if not path.exists()]


def main() -> int:
    packages = missing()
    if not packages:
        print("browser: chromium and chromedriver are installed")
        return 0
    install = ["apt-get", "install", "-y", *packages]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(
            f"the browser tests need {' and '.join(packages)}: run "
            f"`sudo apt-get update && sudo {' '.join(install)}` (Debian or Ubuntu), then `make test` again",
            file=sys.stderr,
        )
        return 1
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"browser: installing {' '.join(packages)} with apt-get", flush=True)
    if subprocess.run(install, env=env).returncode != 0:  # (a fresh machine may have no package lists)
        subprocess.run(["apt-get", "update"], check=True, env=env)
        subprocess.run(install, check=True, env=env)
    if missing():
        print(f"apt-get ran, but {', '.join(missing())} is still missing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
