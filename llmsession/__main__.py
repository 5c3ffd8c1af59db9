"""``python -m llmsession`` runs the ``llmsession`` command."""

import sys

from llmsession.commands.cli import main

sys.exit(main())
