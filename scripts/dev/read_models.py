"""Read the models finetuner names or ships from themselves, once, into the package.

Every preset (``finetuner/model/presets/*.json``) and the shipped demo model (``data/demo_model``) is built on
the meta device with the installed transformers and listed (:func:`finetuner.model.reading.read_model`: the inventory and the first layer's trace);
the lists go to ``finetuner/model/inventories.json``, which :func:`finetuner.model.reading.read_inventory`
answers from, so ``finetuner plan`` on a preset needs neither torch nor transformers. Run it after adding a preset
or moving the transformers pin; ``tests/model/test_inventory.py`` fails while the file differs from what the
installed transformers builds.

    python -m scripts.dev.read_models
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "data" / "demo_model"


def shipped_configs() -> dict[str, dict[str, Any]]:
    """The configs read: each preset by its name, the demo model as ``data/demo_model``."""
    from finetuner.model.shapes import PRESET_DIR

    out = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(PRESET_DIR.glob("*.json"))}
    out["data/demo_model"] = json.loads((DEMO_MODEL / "config.json").read_text(encoding="utf-8"))
    return out


def read_all() -> dict[str, Any]:
    from finetuner.model.reading import config_key, read_model

    models = {}
    for name, cfg in shipped_configs().items():
        key = config_key(cfg)  # the config as a user's load_config gives it, before transformers reads it
        models[key] = {"name": name, "inventory": read_model(cfg).to_dict()}
    return {"transformers": version("transformers"), "models": dict(sorted(models.items(), key=lambda kv: kv[1]["name"]))}


def main() -> None:
    from finetuner.fileio import atomic_write_json
    from finetuner.model.reading import PACKAGED

    data = read_all()
    atomic_write_json(PACKAGED, data)
    print(f"{PACKAGED.relative_to(REPO)}: {len(data['models'])} models read with transformers {data['transformers']}")


if __name__ == "__main__":
    main()
