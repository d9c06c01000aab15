"""The run's final folder (the adapter, or the full model, with its tokenizer and processor): written beside the
run's checkpoints under a temporary name, then published in one rename, so that a reader never finds half of it.
``trainer``: the run's :class:`~finetuner.training.trainer.Trainer` (not imported here: it imports this module).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from finetuner.fileio import give_back, hold, publish_dir
from finetuner.quiet import quieted
from finetuner.training import checkpoint as ckpt_io
from finetuner.training.guards import disk_full_guard


def save_final(trainer, weights: dict[str, Any] | None = None, name: str = "adapter") -> Path:
    """The ``trainer``'s adapter (or full model) and tokenizer as a ``save_pretrained`` folder ``name`` in the run, atomically;
    ``weights``: the trained weights to save when the model's own are sharded (a state dict)."""
    final = trainer.run_dir / name
    tmp = trainer.run_dir / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    with disk_full_guard(trainer.run_dir, trainer.model, trainer.recipe, tmp, weights_only=True), trainer.phase("save"):  # its message once the space is given back
        try:
            tmp.mkdir()
            hold(name)  # a test's pause (HOLD@adapter): the folder made, nothing in it yet
            with quieted():  # transformers' "Writing model shards" bar
                ckpt_io.save_weights(trainer.model, tmp, weights)
                trainer.tokenizer.chat_template = trainer.data.chat_template
                trainer.tokenizer.save_pretrained(tmp)
                if trainer.processor is not None:  # a picture run: the processor (image settings, template) goes along
                    trainer.processor.save_pretrained(tmp)
        except BaseException as e:
            give_back(tmp, e)  # the space of the half-written adapter
            raise
    if final.exists():
        old = trainer.run_dir / f".old-{name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        publish_dir(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        publish_dir(tmp, final)
    return final
