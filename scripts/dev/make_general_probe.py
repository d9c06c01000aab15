"""Write ``data/general_probe.jsonl``: the general probe set, short questions with answers a script can check
(no judge model), written for this project.

An answer is right when it holds one of the accepted strings as a whole word (``contains``; case-insensitive
unless the row says ``"case": true``: chemical symbols, single letters, capitals asked for) or when the first
number in it is the accepted one (``numeric``).

Kinds: ``fact`` (well-known facts, checked by the answer containing one of the accepted strings), ``arithmetic``
(sums, differences and products drawn with a fixed seed, checked by the first number in the answer) and
``instruction`` (short instructions whose answer contains a given word). Each row::

    {"id": "fact-001", "kind": "fact", "question": "...", "answers": ["Paris"], "match": "contains"}

    python -m scripts.dev.make_general_probe
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "data" / "general_probe.jsonl"

FACTS = [
    ("What is the capital of France?", ["Paris"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("What is the capital of Italy?", ["Rome"]),
    ("What is the capital of Germany?", ["Berlin"]),
    ("What is the capital of Spain?", ["Madrid"]),
    ("What is the capital of the United Kingdom?", ["London"]),
    ("What is the capital of Canada?", ["Ottawa"]),
    ("What is the capital of Australia?", ["Canberra"]),
    ("What is the capital of Egypt?", ["Cairo"]),
    ("What is the capital of Russia?", ["Moscow"]),
    ("What is the capital of China?", ["Beijing"]),
    ("What is the capital of Greece?", ["Athens"]),
    ("How many days are there in a week?", ["seven", "7"]),
    ("How many months are there in a year?", ["twelve", "12"]),
    ("How many hours are there in a day?", ["24", "twenty-four", "twenty four"]),
    ("How many minutes are there in an hour?", ["60", "sixty"]),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("How many sides does a triangle have?", ["three", "3"]),
    ("How many continents are there?", ["seven", "7"]),
    ("What is the chemical symbol for water?", ["H2O"]),
    ("What is the chemical symbol for gold?", ["Au"]),
    ("What is the chemical symbol for sodium?", ["Na"]),
    ("What gas do plants take in from the air to make food?", ["carbon dioxide", "CO2"]),
    ("What gas do people need to breathe to live?", ["oxygen"]),
    ("What is the largest planet in our solar system?", ["Jupiter"]),
    ("Which planet is known as the Red Planet?", ["Mars"]),
    ("Which planet is closest to the Sun?", ["Mercury"]),
    ("What is the closest star to Earth?", ["Sun"]),
    ("What is the largest ocean on Earth?", ["Pacific"]),
    ("What is the tallest mountain on Earth?", ["Everest"]),
    ("What is the longest river in Africa?", ["Nile"]),
    ("At what temperature in degrees Celsius does water freeze?", ["0", "zero"]),
    ("At what temperature in degrees Celsius does water boil at sea level?", ["100", "hundred"]),
    ("What color is the sky on a clear day?", ["blue"]),
    ("What color are ripe bananas?", ["yellow"]),
    ("What do bees make?", ["honey"]),
    ("What is the opposite of hot?", ["cold"]),
    ("What is the opposite of up?", ["down"]),
    ("What is the opposite of day?", ["night"]),
    ("What is frozen water called?", ["ice"]),
    ("Which animal is known as the king of the jungle?", ["lion"]),
    ("What is the largest mammal?", ["blue whale", "whale"]),
    ("What is a baby cat called?", ["kitten"]),
    ("What is a baby dog called?", ["puppy"]),
    ("Who wrote Romeo and Juliet?", ["Shakespeare"]),
    ("Who painted the Mona Lisa?", ["Leonardo", "da Vinci"]),
    ("Who was the first person to walk on the Moon?", ["Armstrong"]),
    ("What language is mostly spoken in Brazil?", ["Portuguese"]),
    ("What language is mostly spoken in Mexico?", ["Spanish"]),
    ("What is the currency of Japan?", ["yen"]),
    ("What is the currency of the United States?", ["dollar"]),
    ("How many players does a football (soccer) team have on the field?", ["eleven", "11"]),
    ("What is the first letter of the English alphabet?", ["A"]),
    ("What is the square root of 81?", ["nine", "9"]),
    ("How many degrees are in a right angle?", ["90", "ninety"]),
    ("What is the main ingredient of guacamole?", ["avocado"]),
    ("Which organ pumps blood through the body?", ["heart"]),
    ("How many bones are in the adult human body?", ["206"]),
    ("What is the hardest natural material?", ["diamond"]),
    ("What is the boiling point of water in degrees Fahrenheit?", ["212"]),
]

INSTRUCTIONS = [
    ("Reply with only the word yes.", ["yes"]),
    ("Reply with only the word no.", ["no"]),
    ("Repeat this word exactly: banana", ["banana"]),
    ("Repeat this word exactly: lantern", ["lantern"]),
    ("Write the word apple in capital letters.", ["APPLE"]),
    ("Write the number five as a digit.", ["5"]),
    ("Name a color of the rainbow.", ["red", "orange", "yellow", "green", "blue", "indigo", "violet", "purple"]),
    ("Name a primary color.", ["red", "blue", "yellow"]),
    ("What comes after Monday?", ["Tuesday"]),
    ("What comes after March?", ["April"]),
    ("Spell the word cat backwards.", ["tac"]),
    ("Complete the sequence: 2, 4, 6, 8, ...", ["10", "ten"]),
    ("Complete the sequence: A, B, C, ...", ["D"]),
    ("Translate 'hello' into Spanish.", ["hola"]),
    ("Translate 'thank you' into French.", ["merci"]),
    ("Give a word that rhymes with cat.", ["hat", "bat", "mat", "rat", "sat", "fat", "pat", "chat", "flat", "that"]),
    ("Is the Earth flat or round? Answer in one word.", ["round"]),
    ("Is fire hot or cold? Answer in one word.", ["hot"]),
    ("Which is bigger, an elephant or a mouse?", ["elephant"]),
    ("Which is heavier, a kilogram of iron or a gram of feathers?", ["iron", "kilogram"]),
]


#: answers whose case is the point (a symbol, a letter, capitals asked for): matched case-sensitively
CASED = {"Au", "Na", "A", "D", "APPLE"}


def _row(rid: str, kind: str, question: str, answers: list[str], match: str = "contains") -> dict:
    row = {"id": rid, "kind": kind, "question": question, "answers": answers, "match": match}
    if set(answers) & CASED:
        row["case"] = True
    return row


def rows() -> list[dict]:
    out = [_row(f"fact-{i:03d}", "fact", q, a) for i, (q, a) in enumerate(FACTS, 1)]
    rng = random.Random(20261127)
    for i in range(1, 41):
        op = ("+", "-", "*")[i % 3]
        x, y = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else (rng.randint(10, 99), rng.randint(2, 49))
        value = {"+": x + y, "-": x - y, "*": x * y}[op]
        word = {"+": "plus", "-": "minus", "*": "times"}[op]
        out.append(_row(f"arithmetic-{i:03d}", "arithmetic", f"What is {x} {word} {y}?", [str(value)], "numeric"))
    out += [_row(f"instruction-{i:03d}", "instruction", q, a) for i, (q, a) in enumerate(INSTRUCTIONS, 1)]
    return out


def main() -> None:
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows()), encoding="utf-8")
    print(f"wrote {OUT} ({len(rows())} questions)")


if __name__ == "__main__":
    main()
