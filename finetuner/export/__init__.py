"""Exports of a run: the merged transformers folder."""
