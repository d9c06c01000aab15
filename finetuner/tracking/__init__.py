"""Reporting a run to the trackers users already keep their runs in (``logging.report_to``): MLflow and Weights & Biases,
each through its own library (an optional extra: ``pip install 'finetuner[mlflow]'``, ``'finetuner[wandb]'``), fed from the
run's one event stream (:mod:`finetuner.runs.events`) by :mod:`finetuner.tracking.report`. TensorBoard is written by
the trainer itself."""
