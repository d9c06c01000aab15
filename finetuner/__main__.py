"""``python -m finetuner`` runs the CLI."""

import sys

from finetuner.cli import main

sys.exit(main())
