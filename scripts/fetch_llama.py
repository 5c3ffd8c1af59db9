#!/usr/bin/env python3
"""Build the pinned llama.cpp into the cache: ``llmsession setup``'s first half, from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmsession.commands.setup_llama import main

if __name__ == "__main__":
    sys.exit(main())
