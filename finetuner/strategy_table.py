"""The table of distributed strategies: each one's name, what it shards, what it can offload, how it is
launched and where its checkpoints keep their shards.

Torch-free and low in the package order, so that every reader takes a strategy from here instead of
naming it: the recipe's schema and its cross-section rules (:mod:`finetuner.config`), the memory model's
sharding (:mod:`finetuner.memory.sharding`), the plan's sentence for several cards
(:mod:`finetuner.planning.cards`), the launcher (:mod:`finetuner.training.launch`), the trainer's strategy
classes (:mod:`finetuner.training.strategies`), the checkpoints (:mod:`finetuner.training.checkpoint`) and the
run folder's resume check (:mod:`finetuner.runs.folder`). A new strategy is a row here plus its trainer class.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the engines that run a strategy: torch's DDP (also one plain process), DeepSpeed's ZeRO, torch's FSDP2
DDP_ENGINE, DEEPSPEED_ENGINE, FSDP_ENGINE = "ddp", "deepspeed", "fsdp"


@dataclass(frozen=True)
class StrategyRow:
    """One strategy. ``shards``: the kinds of state divided by the number of processes; ``offloads``: what it
    can move to CPU memory, in the memory model's terms (``none``, ``optimizer``, ``optimizer+params``);
    ``engine``: what runs it; ``launcher``: accelerate's ``distributed_type`` for it (None: DDP's, by device and
    process count); ``zero_stage``: DeepSpeed's ZeRO stage; ``checkpoint_dir``: the folder
    of a checkpoint that holds its per-process shards (None: the checkpoint holds whole state dicts);
    ``simplicity``: the tie-break between equally good strategies (lower: simpler); ``family``: how messages
    name its kind; ``words``: what it does, in a clause a newcomer reads (a plan's first sentence)."""

    name: str
    shards: frozenset[str]
    offloads: tuple[str, ...]
    engine: str
    launcher: str | None
    zero_stage: int | None
    checkpoint_dir: str | None
    simplicity: int
    family: str
    words: str

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether its checkpoints hold one shard per process (resumed only with the same strategy and count)."""
        return self.checkpoint_dir is not None


#: every strategy, in the order the recipe's schema lists them
TABLE: tuple[StrategyRow, ...] = (
    StrategyRow("ddp", shards=frozenset(), offloads=("none",), engine=DDP_ENGINE, launcher=None, zero_stage=None,
                checkpoint_dir=None, simplicity=0, family="DDP",
                words="DDP: each card holds the whole model and trains on its share of every step's rows"),
    StrategyRow("fsdp", shards=frozenset({"optimizer", "gradients", "parameters"}), offloads=("none", "optimizer+params"),
                engine=FSDP_ENGINE, launcher="FSDP", zero_stage=None, checkpoint_dir="fsdp", simplicity=4, family="FSDP",
                words="FSDP: the weights, gradients and optimizer states are sharded between the cards, each layer "
                      "gathered as it runs"),
    StrategyRow("zero1", shards=frozenset({"optimizer"}), offloads=("none", "optimizer"), engine=DEEPSPEED_ENGINE,
                launcher="DEEPSPEED", zero_stage=1, checkpoint_dir="deepspeed", simplicity=1, family="ZeRO",
                words="ZeRO-1: each card holds the whole model, the optimizer states are split between the cards"),
    StrategyRow("zero2", shards=frozenset({"optimizer", "gradients"}), offloads=("none", "optimizer"),
                engine=DEEPSPEED_ENGINE, launcher="DEEPSPEED", zero_stage=2, checkpoint_dir="deepspeed", simplicity=2,
                family="ZeRO", words="ZeRO-2: each card holds the whole model, the optimizer states and gradients are "
                                     "split between the cards"),
    StrategyRow("zero3", shards=frozenset({"optimizer", "gradients", "parameters"}),
                offloads=("none", "optimizer", "optimizer+params"), engine=DEEPSPEED_ENGINE, launcher="DEEPSPEED",
                zero_stage=3, checkpoint_dir="deepspeed", simplicity=3, family="ZeRO",
                words="ZeRO-3: the weights, gradients and optimizer states are split between the cards, each layer "
                      "gathered as it runs"),
)

#: the strategies' names, in the schema's order
NAMES: tuple[str, ...] = tuple(r.name for r in TABLE)
#: the strategy of a recipe that names none
DEFAULT = "ddp"
_BY_NAME = {r.name: r for r in TABLE}


def strategy_row(name: str) -> StrategyRow:
    """The row of strategy ``name`` (a KeyError for a name the table does not hold: the schema refuses those)."""
    return _BY_NAME[name]


def find_row(name: str) -> StrategyRow | None:
    """The row of ``name``, None for a name the table does not hold (a recipe of another version)."""
    return _BY_NAME.get(name)


def names_run_by(engine: str) -> tuple[str, ...]:
    """The strategies ``engine`` runs (a trainer strategy class serves these names)."""
    return tuple(r.name for r in TABLE if r.engine == engine)


def checkpoint_dir_of(engine: str) -> str | None:
    """The folder of a checkpoint that holds ``engine``'s per-process shards (None: it writes none)."""
    return next(r.checkpoint_dir for r in TABLE if r.engine == engine)


#: every strategy's folder of per-process shards in a checkpoint
SHARD_DIRS: tuple[str, ...] = tuple(sorted({r.checkpoint_dir for r in TABLE if r.checkpoint_dir}))
