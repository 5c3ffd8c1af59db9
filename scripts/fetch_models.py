#!/usr/bin/env python3
"""Fetch the models into the cache: ``llmsession setup --models``'s second half, from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmsession.commands.setup_models import main

if __name__ == "__main__":
    sys.exit(main())
