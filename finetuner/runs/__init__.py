"""Run folders: the folder and its lock, the event stream and its schema, a run's status, background jobs, the notebook progress bar."""
