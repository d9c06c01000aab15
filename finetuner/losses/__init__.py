"""Loss functions as pure tensor maths, read by training and evaluation alike: they take
log-probabilities, rewards and masks, never a model or a trainer; and how many tokens the
cross-entropy takes at a time (:mod:`finetuner.losses.chunk`, arithmetic the memory model shares)."""
