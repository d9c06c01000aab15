"""Reporting a run to the trackers users already keep their runs in (``logging.report_to``): MLflow, Weights & Biases and
Trackio, each through its own library (an optional extra: ``pip install 'finetuner[mlflow]'``, ``'finetuner[wandb]'``,
``'finetuner[trackio]'``), fed from the
run's one event stream (:mod:`finetuner.runs.events`) by :mod:`finetuner.tracking.report`. TensorBoard is written by
the trainer itself."""
