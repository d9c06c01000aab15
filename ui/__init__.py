"""The Gradio web UI (``finetuner ui``); a thin front on the ``finetuner`` Python API."""
