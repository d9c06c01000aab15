"""The tool-calling demo's data: chats in OpenAI's format with three tools, for ``recipes/tools_smollm2_cpu.yaml``.

Writes, deterministically (fixed seed, fixed value lists):

- ``data/tool_calls_tools.json``: the three tools' schemas (``get_weather``, ``convert_units``, ``define_word``), the
  file ``finetuner chat RUN --tools`` and the UI's Chat tab take;
- ``data/tool_calls.jsonl``: 72 chats (24 a tool), each a request, the assistant's call (``content: null``,
  ``tool_calls`` with the arguments as a JSON string, as OpenAI writes them), the tool's result and the answer;
- ``data/tool_calls_heldout.jsonl``: 12 requests (4 a tool) about cities, numbers and words that no training chat
  names, each with the call it should make: the held-out set ``finetuner eval RUN --data`` and
  ``scripts/bench/tool_calls.py`` score.

Run: ``python -m scripts.dev.make_tool_data``
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"
SEED = 58

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_units", "description": "Convert a value from one unit to another.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
            "required": ["value", "from_unit", "to_unit"]}}},
    {"type": "function", "function": {
        "name": "define_word", "description": "The dictionary definition of an English word.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}},
]

CITIES = ["Paris", "Berlin", "Madrid", "Lisbon", "Dublin", "Oslo", "Vienna", "Prague", "Warsaw", "Athens", "Rome",
          "Cairo", "Nairobi", "Lima", "Toronto", "Chicago", "Denver", "Seattle", "Boston", "Sydney", "Tokyo", "Seoul",
          "Mumbai", "Bangkok"]
HELD_CITIES = ["Helsinki", "Santiago", "Manila", "Zurich"]
WORDS = ["serene", "brisk", "candid", "frugal", "nimble", "ponder", "radiant", "sturdy", "tidy", "vivid", "wary",
         "zealous", "humble", "eager", "gloomy", "lucid", "mellow", "odd", "prudent", "quaint", "rustic", "subtle",
         "timid", "witty"]
HELD_WORDS = ["bold", "gentle", "keen", "solemn"]
UNITS = [("kilometers", "miles", 0.621371), ("miles", "kilometers", 1.609344), ("kilograms", "pounds", 2.204623),
         ("pounds", "kilograms", 0.453592), ("liters", "gallons", 0.264172), ("meters", "feet", 3.280840)]

WEATHER_ASKS = ["What's the weather in {city}?", "How is the weather in {city} today?", "Is it raining in {city}?",
                "Tell me the weather in {city}.", "Check the weather for {city}, please.", "Weather in {city} now?"]
CONVERT_ASKS = ["Convert {value} {from_unit} to {to_unit}.", "How many {to_unit} is {value} {from_unit}?",
                "What is {value} {from_unit} in {to_unit}?", "Please convert {value} {from_unit} into {to_unit}."]
DEFINE_ASKS = ["What does {word} mean?", "Define the word {word}.", "Look up the meaning of {word}.",
               "What is the definition of {word}?"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "foggy", "clear"]


def _chat(prompt: str, name: str, args: dict, result: dict, answer: str) -> dict:
    call = {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return {"messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)},
                         {"role": "assistant", "content": answer}],
            "tools": TOOLS}


def weather(rng: random.Random, city: str) -> dict:
    sky, temp = rng.choice(SKIES), rng.randint(-5, 32)
    return _chat(rng.choice(WEATHER_ASKS).format(city=city), "get_weather", {"city": city},
                 {"city": city, "sky": sky, "celsius": temp}, f"It is {sky} in {city}, {temp} °C.")


def convert(rng: random.Random, value: int | float, units: tuple[str, str, float]) -> dict:
    from_unit, to_unit, factor = units
    out = round(value * factor, 2)
    prompt = rng.choice(CONVERT_ASKS).format(value=value, from_unit=from_unit, to_unit=to_unit)
    return _chat(prompt, "convert_units", {"value": value, "from_unit": from_unit, "to_unit": to_unit},
                 {"value": out, "unit": to_unit}, f"{value} {from_unit} is {out} {to_unit}.")


def define(rng: random.Random, word: str) -> dict:
    return _chat(rng.choice(DEFINE_ASKS).format(word=word), "define_word", {"word": word},
                 {"word": word, "definition": f"(the dictionary's entry for {word})"},
                 f"Here is what {word} means: (the dictionary's entry for {word}).")


def build() -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    train_values = rng.sample(range(2, 200), 24)
    held_values = [v for v in (7.5, 33, 120, 415) if v not in train_values]
    train = ([weather(rng, c) for c in CITIES] + [convert(rng, v, UNITS[i % len(UNITS)]) for i, v in enumerate(train_values)]
             + [define(rng, w) for w in WORDS])
    rng.shuffle(train)
    held = ([weather(rng, c) for c in HELD_CITIES] + [convert(rng, v, UNITS[(i * 5 + 1) % len(UNITS)])
                                                     for i, v in enumerate(held_values)]
            + [define(rng, w) for w in HELD_WORDS])
    held = [{"messages": row["messages"][:2], "tools": row["tools"]} for row in held]  # the request and its call
    return train, held


def main() -> None:
    train, held = build()
    (DATA / "tool_calls_tools.json").write_text(json.dumps(TOOLS, indent=1) + "\n", encoding="utf-8")
    for name, rows in (("tool_calls.jsonl", train), ("tool_calls_heldout.jsonl", held)):
        (DATA / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"data/{name}: {len(rows)} chats")


if __name__ == "__main__":
    main()
