"""The trainer (one process or several), its checkpoints, the multi-process launcher, and test faults."""
