"""The label of a token no loss is taken on: one value, shared by the data that writes it and the model and
objectives that read it.

A torch-free bottom module so that the model's scoring (:mod:`finetuner.model.scoring`), which sits below the
data layer, and the rollout read the same value the data pipeline writes without importing data.
"""

from __future__ import annotations

#: the label of a token no loss is taken on (torch's cross-entropy ignore_index)
IGNORE_INDEX = -100
