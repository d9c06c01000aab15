"""The rows a run holds out, as its pipeline loads them (normalised examples with their ``_where``), in the order
its split holds them out: ``data.val_path``'s rows, else the ``data.val_size`` rows the split draws from the data
(:func:`finetuner.data.split.held_out_positions`, the permutation ``datasets``' ``train_test_split`` makes).

The split is drawn over the rows that tokenized; the positions name the same rows here only when every row that
loads also tokenized (no row skipped at encoding, none dropped for having nothing to learn):
:func:`held_out_examples` takes ``tokenized``, the run's count, and gives None when they differ."""

from __future__ import annotations

from typing import Any

from finetuner.config.sections import DataSection
from finetuner.data.split import held_out_checked, held_out_positions


def held_out_examples(cfg: DataSection, seed: int, tokenized: int | None = None) -> list[dict[str, Any]] | None:
    """The supervised examples a run of ``cfg`` (and ``seed``) holds out (module doc); ``tokenized``: how many rows
    the run's split was drawn over (its training and held-out examples), None when not known. None when the rows
    loaded here are not those (see the module doc); [] when it holds nothing out."""
    from finetuner.data.pipeline import DataStats, load_examples

    quiet = cfg.model_copy(update={"on_bad_row": "skip"})  # what the run refused, it refused already
    if cfg.val_path:
        return load_examples(cfg.val_path, quiet, DataStats())
    if not cfg.val_size:
        return []
    examples = load_examples(cfg.path, quiet, DataStats())
    if tokenized is not None and tokenized != len(examples):
        return None
    n_val = held_out_checked(cfg.val_size, len(examples))
    return [examples[i] for i in held_out_positions(len(examples), n_val, seed)]
