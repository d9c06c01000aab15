"""``python -m finetuner`` runs the CLI."""

import sys

from finetuner.cli.main import main

sys.exit(main())
