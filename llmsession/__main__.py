"""``python -m llmsession`` runs the ``llmsession`` command."""

import sys

from .cli import main

sys.exit(main())
