"""The command line: `finetuner run`, `plan`, `estimate`, `gpus`, `ui`, `chat`, `eval`, `merge` (entry point: :func:`finetuner.cli.main.main`)."""
