#!/usr/bin/env python3
"""`make bench`: run llmsession's benchmarks (the code lives in llmsession/bench.py).

python scripts/bench_sessions.py --json bench-sessions.json [--plot ttft.png] [--peer llama-cpp-python]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmsession.commands.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
