"""Write ``data/replay_prompts.jsonl``: general prompts whose answers by the base model itself are mixed into a
fine-tune's training rows (``data.replay``, :mod:`finetuner.data.replay`), written for this project.

Everyday requests of the kinds a chat model answers (short explanations, advice, rewriting, lists, small sums in
words), none of them a question of the general probe set (``data/general_probe.jsonl``: the measurement must not
train on its own questions; ``tests/data/test_replay.py`` checks that no prompt shares a question with it). Each row::

    {"id": "replay-001", "prompt": "..."}

    python -m scripts.dev.make_replay_prompts
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "data" / "replay_prompts.jsonl"

EXPLAIN = ["a rainbow", "a budget", "compound interest", "a thunderstorm", "recycling", "a vaccine", "photosynthesis",
           "a search engine", "a library card", "inflation", "a volcano", "a password manager", "jet lag", "a tide",
           "an index fund", "a food chain", "a solar panel", "a fever", "a podcast", "a spreadsheet"]
ADVICE = ["sleeping better", "learning a new language", "saving money each month", "staying focused while studying",
          "keeping houseplants alive", "preparing for a job interview", "writing a clear email", "starting to run",
          "cooking rice", "packing a suitcase", "reducing stress", "making a presentation", "keeping a kitchen clean",
          "remembering names", "choosing a good book", "drinking more water", "organising a desk",
          "taking better photos", "planning a small party", "learning to type faster"]
REWRITE = ["the meeting is moved to friday because the room is booked", "i cant find my keys can you help",
           "thanks for the gift it was really kind", "please send the report by tomorrow morning",
           "the shop opens at nine and closes at five", "we are happy to announce a new member of the team",
           "the train was late so i missed the start", "could you water the plants while i am away",
           "the new phone has a better camera and a bigger battery", "remember to bring a pen to the exam"]
LISTS = ["fruits that are high in vitamin C", "things to check before a long drive", "ways to reuse a glass jar",
         "board games for a family evening", "indoor exercises that need no equipment", "questions to ask a new doctor",
         "items for a first-aid kit", "habits of good listeners", "snacks for a long walk", "tips for a rainy day at home"]
WORDS = [("twelve", "nine"), ("forty", "seventeen"), ("one hundred", "thirty-five"), ("eight", "six"), ("fifty", "fifty"),
         ("twenty-one", "four"), ("sixty", "fifteen"), ("three", "eleven"), ("ninety", "ten"), ("seven", "seven")]


def rows() -> list[dict[str, str]]:
    prompts = [f"Explain in two sentences what {x} is." for x in EXPLAIN]
    prompts += [f"Give me three tips for {x}." for x in ADVICE]
    prompts += [f"Rewrite this as a polite, well-punctuated sentence: \"{x}\"" for x in REWRITE]
    prompts += [f"List four {x}." for x in LISTS]
    prompts += [f"Add {a} and {b}, and write the result in words." for a, b in WORDS]
    return [{"id": f"replay-{i + 1:03d}", "prompt": p} for i, p in enumerate(prompts)]


def main() -> None:
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows()), encoding="utf-8")
    print(f"{OUT}: {len(rows())} prompts")


if __name__ == "__main__":
    main()
