"""Multi-process strategies, one module each, keyed by ``distributed.strategy``.

:class:`~finetuner.training.strategies.base.Strategy` is the interface
:class:`~finetuner.training.distributed.DistributedTrainer` calls; adding a strategy is one
module with one subclass, named in :data:`STRATEGIES`.
"""

from __future__ import annotations

from finetuner.training.strategies.base import Strategy
from finetuner.training.strategies.ddp import DDP
from finetuner.training.strategies.fsdp import FSDP
from finetuner.training.strategies.zero import Zero

#: every strategy class; each says which ``distributed.strategy`` values it runs (``names``)
STRATEGIES: tuple[type[Strategy], ...] = (DDP, Zero, FSDP)


def strategy_class(name: str) -> type[Strategy]:
    """The class that runs ``distributed.strategy: name``."""
    for cls in STRATEGIES:
        if name in cls.names:
            return cls
    raise KeyError(f"no strategy runs distributed.strategy '{name}'")


__all__ = ["STRATEGIES", "Strategy", "strategy_class"]
