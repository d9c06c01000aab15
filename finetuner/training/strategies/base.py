"""What a multi-process strategy decides, as one interface: :class:`Strategy`.

:class:`~finetuner.training.distributed.DistributedTrainer` runs the step, the checkpoints and
the end of a run the same way whichever strategy runs; at each point where they differ it asks
its strategy (one object, made by :func:`finetuner.training.strategies.for_recipe`):

- :meth:`Strategy.join`: anything the engine needs once the process group exists;
- :meth:`Strategy.base_placement`: where this rank loads the base model;
- :meth:`Strategy.wrap`: wrap the step's loss module (and replace the optimizer, scheduler or
  loss scaler when the engine owns them); returns what the forward pass goes through;
- :meth:`Strategy.whole_forward`: around an evaluation's forward passes;
- :meth:`Strategy.gradient_sync`, :meth:`Strategy.backward`, :meth:`Strategy.sync_gradients`,
  :meth:`Strategy.optimizer_step`: one step;
- :meth:`Strategy.after_back_off`: whether the run may continue after the ranks backed off an
  out-of-memory step together;
- :meth:`Strategy.gathered`, :meth:`Strategy.write_shards`, :meth:`Strategy.read_parts`,
  :meth:`Strategy.load_shards`: saving and resuming;
- :meth:`Strategy.close`: release the engine before the rank leaves the process group.

The defaults here are those of a replicated model (every rank holds all of it); a strategy
overrides what differs.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Iterator, Protocol


class RankTrainer(Protocol):
    """What a strategy uses of the trainer of its rank (``DistributedTrainer`` is one): the strategies
    are imported by that trainer, so they name what they need here instead of importing it back."""

    ctx: Any  # the rank's RankContext: rank, world size, CUDA or not
    rank: int
    world_size: int
    recipe: Any
    rt: Any
    run_dir: Path
    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    max_steps: int

    def trainable_params(self, refresh: bool = False) -> list: ...

    def predicted_note(self) -> str: ...


class Strategy(ABC):
    """How one rank of a ``distributed.strategy`` run wraps, steps, synchronises, saves and loads."""

    #: the ``distributed.strategy`` values this class runs
    names: ClassVar[tuple[str, ...]] = ()
    #: whether rank 0 holds the whole trained model after the run (it can generate the samples)
    whole_model_on_rank0: ClassVar[bool] = True

    def __init__(self, trainer: RankTrainer):
        self.trainer = trainer

    @classmethod
    def join(cls, cuda: bool) -> None:
        """Called on every rank once the process group exists."""

    # ---------------------------------------------------------------- wrapping
    def base_placement(self) -> str | None:
        """Where this rank loads the base model (:func:`~finetuner.model.loading.load_base_model`'s
        ``place``); None: every rank loads the whole model onto its device."""
        return None

    @abstractmethod
    def wrap(self, step_loss):
        """Wrap ``step_loss`` (the module the forward pass goes through); returns the wrapped module."""

    @abstractmethod
    def describe(self) -> str:
        """What runs the model, for the ``distributed`` event."""

    def event_fields(self) -> dict[str, Any]:
        """What else the ``distributed`` event says about this strategy."""
        return {}

    def whole_forward(self):
        """The context of a forward pass that calls the model's parts directly (evaluation), not
        through the wrapped module: whatever the strategy must gather for it."""
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- one step
    def gradient_sync(self, last: bool):
        """The context of one backward pass (``last``: the step's last pass on this rank)."""
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        t = self.trainer
        (t.scaler.scale(loss) if t.scaler is not None else loss).backward()

    def sync_gradients(self) -> None:
        """After the step's passes all fit on every rank: make the ranks' gradients agree."""

    def optimizer_step(self) -> float | None:
        """Step the optimizer and the schedule; returns the gradient norm before clipping (or None)."""
        from finetuner.training.optimizer import optimizer_step

        t = self.trainer
        return optimizer_step(t.optimizer, t.scheduler, t.trainable_params(), t.recipe.training.max_grad_norm, t.scaler)

    def after_back_off(self, step: int, micro_before: int, message: str) -> None:
        """The ranks backed off an out-of-memory error in ``step`` together (the recipe holds the
        new values); raise to end the run when this strategy cannot go on with them."""

    # ---------------------------------------------------------------- saving and resuming
    @contextlib.contextmanager
    def gathered(self) -> Iterator[dict[str, Any] | None]:
        """Around a save, on every rank: yields the trained weights to save (a state dict, on rank 0)
        when the model's own are not whole on rank 0, else None (save the model's)."""
        yield None

    @property
    def saves_optimizer(self) -> bool:
        """Whether rank 0 writes ``optimizer.pt`` (False when the states are sharded and each rank writes its own)."""
        return True

    #: whether resuming this strategy's checkpoints unpickles them (its engine's own formats): such
    #: checkpoints are sealed when written and checked before they are read (:mod:`finetuner.training.seal`)
    unpickles_checkpoints: bool = False

    def write_shards(self, tmp: Path) -> None:
        """Every rank: write this rank's share of a checkpoint into the staging folder ``tmp``."""

    def read_parts(self, ckpt: Path) -> dict[str, Any]:
        """This rank's parts of ``ckpt`` (raises ``CheckpointUnreadable``)."""
        from finetuner.training import checkpoint as ckpt_io

        t = self.trainer
        return ckpt_io.read_checkpoint(ckpt, rank=t.rank, world_size=t.world_size)

    def load_shards(self, ckpt: Path, parts: dict[str, Any]) -> None:
        """Before the common parts are applied: load this rank's share of ``ckpt``."""

    def close(self) -> None:
        """Release the engine (its hooks, buffers, optimizer) before the rank leaves the process group."""


def check_same_world(ckpt: Path, parts: dict[str, Any], world_size: int, why: str) -> None:
    """A sharded checkpoint resumes only with the number of processes that saved it."""
    from finetuner.errors import UserError

    saved_by = parts["state"].get("world_size")
    if saved_by != world_size:
        raise UserError(
            f"{ckpt} was saved by {saved_by} processes; this run has {world_size}.",
            hint=f"{why}: resume with the same --gpus, or --no-resume.",
        )
