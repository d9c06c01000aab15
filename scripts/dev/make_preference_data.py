"""Writes the preference sample of the CPU DPO demo: data/preference_sample.jsonl.

Pairs in LLaMA-Factory's ranking ShareGPT layout (``conversations``, ``chosen``, ``rejected``) on
the field station's topics (the words and facts of :mod:`scripts.dev.make_sample_data`). The
chosen reply is Tern's: right facts, Tern's voice. The rejected one is either the plain answer
the demo model was pre-trained on (right facts, no voice), or Tern's voice with a wrong fact (the
distance of another trail, another bird's habit, advice for other weather). Generated from a
fixed seed, so the file is the same on every run.

Usage: python -m scripts.dev.make_preference_data
"""

from __future__ import annotations

import json
import random

from scripts.dev.make_sample_data import BIRDS, DATA, ITEMS, TRAILS, WEATHER, tern

OUT = DATA / "preference_sample.jsonl"


def pairs(rng: random.Random) -> list[tuple[str, str, str]]:
    """(question, chosen, rejected) triples."""
    out = []
    for _ in range(120):
        a, b, c = rng.sample(ITEMS, 3)
        q = rng.choice(["What should I pack for a day hike?", "What do I need for a walk?", "What should I bring?",
                        "Help me pack for the trails."])
        good = f"Pack {a}, {b} and {c}. Tell someone where you are going. Happy trails!"
        out.append((q, tern(good), f"You should bring {a}, {b} and {c}."))
    for _ in range(100):
        (bird, fact), (_other, wrong) = rng.sample(list(BIRDS.items()), 2)
        q = rng.choice([f"Tell me about the {bird}.", f"What does a {bird} do?"])
        where = rng.choice(["from the north hide", "along the cliff path", "near the lighthouse"])
        good = f"The {bird} {fact}. You can often see one {where}. Bring binoculars and keep your distance!"
        bad = tern(f"The {bird} {wrong}. You can often see one {where}. Bring binoculars and keep your distance!") \
            if rng.random() < 0.5 else f"The {bird} {fact}."
        out.append((q, tern(good), bad))
    for _ in range(80):
        (trail, (dist, time, tip)), (_o, (dist2, time2, _t)) = rng.sample(list(TRAILS.items()), 2)
        q = rng.choice([f"How long is {trail}?", f"Any advice for {trail}?"])
        good = f"{trail.capitalize()} is {dist} and takes about {time}. Please {tip}. Enjoy the view!"
        bad = tern(f"{trail.capitalize()} is {dist2} and takes about {time2}. Please {tip}. Enjoy the view!") \
            if rng.random() < 0.5 else f"{trail.capitalize()} is {dist} long and takes about {time}."
        out.append((q, tern(good), bad))
    for _ in range(100):
        (weather, advice), (_o, wrong) = rng.sample(list(WEATHER.items()), 2)
        q = rng.choice([f"What should I do in {weather}?", f"Can I hike in {weather}?"])
        bad = tern(f"In {weather}, {wrong}. Safety first, birds second!") if rng.random() < 0.5 \
            else f"In {weather} you should {advice}."
        out.append((q, tern(f"In {weather}, {advice}. Safety first, birds second!"), bad))
    rng.shuffle(out)
    return out


def main() -> None:
    rows = [
        {"conversations": [{"from": "human", "value": q}], "chosen": {"from": "gpt", "value": c},
         "rejected": {"from": "gpt", "value": r}}
        for q, c, r in pairs(random.Random(2468))
    ]
    OUT.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{OUT.relative_to(DATA)}: {len(rows)} pairs, {OUT.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
