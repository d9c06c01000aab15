"""The Gradio web UI (``finetuner ui``); a thin front on the ``finetuner`` Python API.

:mod:`ui.app` (the entry point: ``build_app``, ``launch``) → :mod:`ui.layout` (the page and its
wiring) → :mod:`ui.handlers` (what each control does, no browser needed) → :mod:`ui.views`
(finetuner's objects as text, tables and charts), with :mod:`ui.recipe_text` (the recipe in the
editor), :mod:`ui.errors` (errors as text on the page), :mod:`ui.chat_pool` (the chat process),
:mod:`ui.estimate` (the Plan tab's memory figure), :mod:`ui.warm` (the imports the launch leaves to the
background), :mod:`ui.paths` and :mod:`ui.style`.
"""

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # never call out (version check, telemetry), whatever the environment says
