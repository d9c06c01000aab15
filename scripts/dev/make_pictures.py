"""Writes the picture demo's data: plain shapes on a light background, and the chats about them.

``data/pictures/img/train-NNN.png`` (48 pictures) and ``heldout-NNN.png`` (12 more, other places and sizes): a
circle, a square or a triangle in red, green, blue or yellow, 48 x 48 pixels. ``data/pictures/shapes.jsonl`` asks
"What is in the picture?" of each training picture and answers in the demo's house style, "A red circle.";
``shapes_heldout.jsonl`` the same of the held-out pictures (never trained on). ``recipes/demo_vlm_cpu.yaml`` trains
``data/demo_vlm`` (``scripts/dev/build_demo_vlm.py``, which names a colour or a shape but never saw this
question) on them. Deterministic (fixed seeds)::

    python -m scripts.dev.make_pictures
"""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "data" / "pictures"
SIZE = 48
COLOURS = {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 119, 180), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What is in the picture?"


def draw(shape: str, colour: str, rng: random.Random):
    """One picture: ``shape`` in ``colour`` at a random place and size."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    d = ImageDraw.Draw(im)
    r = rng.randint(10, 18)
    cx, cy = rng.randint(r + 2, SIZE - r - 2), rng.randint(r + 2, SIZE - r - 2)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return im


def pictures(n: int, seed: int) -> list[tuple[object, str, str]]:
    """``n`` pictures cycling through every shape and colour: (image, shape, colour) each."""
    rng = random.Random(seed)
    combos = [(s, c) for s in SHAPES for c in COLOURS]
    return [(draw(s, c, rng), s, c) for s, c in (combos[i % len(combos)] for i in range(n))]


def answer(shape: str, colour: str) -> str:
    return f"A {colour} {shape}."


def main() -> None:
    (OUT / "img").mkdir(parents=True, exist_ok=True)
    for split, n, seed, file in (("train", 48, 1, "shapes.jsonl"), ("heldout", 12, 2, "shapes_heldout.jsonl")):
        rows = []
        for i, (im, shape, colour) in enumerate(pictures(n, seed)):
            rel = f"img/{split}-{i:03d}.png"
            im.save(OUT / rel, optimize=True)
            rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": rel},
                                                                   {"type": "text", "text": QUESTION}]},
                                      {"role": "assistant", "content": answer(shape, colour)}]})
        (OUT / file).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{OUT / file}: {len(rows)} chats")


if __name__ == "__main__":
    main()
