"""finetuner's version, in a module of its own so code that records it imports nothing else."""

__version__ = "0.1.0"
