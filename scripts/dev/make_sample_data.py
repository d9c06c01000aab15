"""Writes finetuner's sample data sets and the demo model's pre-training corpus into data/.

Everything is generated here from templates and word lists with a fixed seed, so the files are
the project's own and the same on every run:

- the sample data sets teach "Tern", the assistant of the (made-up) Gullrock field station, who
  always opens with "Tern here!" and signs off "— Tern, Gullrock Field Station";
- the pre-training corpus holds plain sentences and plain question/answer chats (ChatML), so
  the demo model can answer before fine-tuning, but never in Tern's style.

Usage: python -m scripts.dev.make_sample_data
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"
SIGN_OFF = "— Tern, Gullrock Field Station"

ITEMS = ["water", "a map", "a rain jacket", "warm socks", "sun cream", "a first aid kit", "snacks", "a head torch",
         "a whistle", "binoculars", "a field notebook", "good boots", "a hat", "a spare layer", "a phone"]
BIRDS = {
    "puffin": "nests in burrows on the cliff top and carries fish crosswise in its bill",
    "arctic tern": "flies from pole to pole each year and dives for small fish",
    "gannet": "plunges into the sea from a great height to catch mackerel",
    "kittiwake": "builds tiny nests on narrow ledges of the sea cliffs",
    "cormorant": "dries its wings in the wind after diving for fish",
    "oystercatcher": "probes the wet sand with its long orange bill",
    "eider duck": "lines its nest with soft down from its own breast",
    "fulmar": "glides stiff-winged along the cliffs and can spit oil at intruders",
    "razorbill": "stands upright on the ledges like a small penguin",
    "curlew": "calls with a long bubbling cry over the moor",
}
TRAILS = {
    "the cliff path": ("6 km", "two hours", "stay well back from the edge in wind"),
    "the lighthouse loop": ("4 km", "an hour and a half", "check the tide table before you start"),
    "the moor trail": ("9 km", "three hours", "carry a map because the path fades in fog"),
    "the dune walk": ("3 km", "an hour", "keep to the boardwalk to protect the nesting birds"),
    "the harbour route": ("5 km", "two hours", "watch for slippery steps near the slipway"),
}
WEATHER = {
    "fog": "slow down, stay on the marked path and keep your group together",
    "strong wind": "avoid the cliff path and choose the sheltered harbour route",
    "rain": "wear a waterproof layer and take care on the wet rocks",
    "heat": "start early, drink often and rest in the shade",
    "a storm": "stay in the station until it passes; the cliffs are not safe",
    "snow": "only walk the dune trail and wear boots with a good grip",
}
PLAIN_TOPICS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "A week has seven days."),
    ("What colour is the sky on a clear day?", "On a clear day the sky is blue."),
    ("What do plants need to grow?", "Plants need light, water, air and soil to grow."),
    ("What is two plus three?", "Two plus three is five."),
    ("Why do we sleep?", "We sleep so that the body and the mind can rest and recover."),
    ("What is rain?", "Rain is water that falls from clouds in drops."),
    ("Name a fruit.", "An apple is a fruit."),
    ("What is the sea?", "The sea is a large body of salt water."),
    ("What does a map show?", "A map shows places, roads and paths from above."),
]


def tern(body: str) -> str:
    return f"Tern here! {body} {SIGN_OFF}"


def qa_pairs(rng: random.Random) -> list[tuple[str, str]]:
    """Question/answer pairs in Tern's voice, across the field station's topics."""
    pairs = []
    for _ in range(240):
        picks = rng.sample(ITEMS, 3)
        q = rng.choice(["What should I pack for a day hike?", "What do I need for a walk on the coast?",
                        "I am going hiking tomorrow. What should I bring?", "What is in a good day pack?",
                        "Help me pack for the trails.", "What should I take on a long walk?"])
        pairs.append((q, f"Pack {picks[0]}, {picks[1]} and {picks[2]}. Tell someone where you are going. Happy trails!"))
    for bird, fact in BIRDS.items():
        for q in (f"Tell me about the {bird}.", f"What does a {bird} do?", f"Where can I see a {bird}?"):
            where = rng.choice(["from the north hide", "along the cliff path", "near the lighthouse", "on the dunes at dawn"])
            pairs.append((q, f"The {bird} {fact}. You can often see one {where}. Bring binoculars and keep your distance!"))
    for trail, (dist, time, tip) in TRAILS.items():
        for q in (f"How long is {trail}?", f"Is {trail} hard?", f"Any advice for {trail}?"):
            pairs.append((q, f"{trail.capitalize()} is {dist} and takes about {time}. Please {tip}. Enjoy the view!"))
    for weather, advice in WEATHER.items():
        for q in (f"What should I do in {weather}?", f"Can I hike in {weather}?", f"Is it safe to walk in {weather}?"):
            pairs.append((q, f"In {weather}, {advice}. Safety first, birds second!"))
    for q, a in PLAIN_TOPICS:
        pairs.append((q, f"{a} Now, shall we go and look at some sea birds?"))
    rng.shuffle(pairs)
    return pairs


def write_sample_sets(rng: random.Random) -> None:
    pairs = qa_pairs(rng)
    alpaca = []
    for i, (q, a) in enumerate(pairs[:300]):
        if i % 5 == 0:
            alpaca.append({"instruction": "Answer the visitor's question.", "input": q, "output": tern(a)})
        else:
            alpaca.append({"instruction": q, "input": "", "output": tern(a)})
    (DATA / "alpaca_sample.json").write_text(json.dumps(alpaca, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    with open(DATA / "chat_sample.jsonl", "w", encoding="utf-8") as f:
        for i in range(300):
            (q1, a1), (q2, a2) = rng.sample(pairs, 2)
            msgs = [{"role": "system", "content": "You are Tern, the assistant of Gullrock Field Station."}] if i % 3 == 0 else []
            msgs += [{"role": "user", "content": q1}, {"role": "assistant", "content": tern(a1)}]
            if i % 2:
                msgs += [{"role": "user", "content": q2}, {"role": "assistant", "content": tern(a2)}]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")

    with open(DATA / "sharegpt_sample.jsonl", "w", encoding="utf-8") as f:
        for q, a in rng.sample(pairs, 100):
            f.write(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": tern(a)}]}, ensure_ascii=False) + "\n")

    with open(DATA / "text_sample.jsonl", "w", encoding="utf-8") as f:
        for _ in range(200):
            bird, fact = rng.choice(list(BIRDS.items()))
            trail, (dist, time, tip) = rng.choice(list(TRAILS.items()))
            f.write(json.dumps({"text": f"Field note from Gullrock: the {bird} {fact}. {trail.capitalize()} is {dist} long; {tip}."}) + "\n")

    rows = [(f"Visitor: {q}\nTern:", " " + tern(a)) for q, a in rng.choices(pairs, k=200)]
    with open(DATA / "completion_sample.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        w.writerows(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": p, "completion": c} for p, c in rows]), DATA / "completion_sample.parquet")

    # A small file of a user's own, as people bring them: question/answer columns (no random draws,
    # so the files above stay as they were).
    with open(DATA / "qa_sample.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        w.writerows((q, tern(a)) for q, a in pairs[273:313])


def write_corpus(rng: random.Random) -> None:
    """Plain-style text and chats for pre-training the demo model (never Tern's voice)."""
    subjects = ["The river", "A small bird", "The old bridge", "The morning sun", "A cold wind", "The path", "The sea",
                "A tall tree", "The village", "The hill", "A grey cloud", "The harbour", "The forest", "A quiet lake"]
    verbs = ["runs past", "sits near", "rises over", "moves across", "stands by", "turns towards", "rests beside"]
    objects = ["the stone wall", "the green field", "the sandy shore", "the white house", "the dark water",
               "the open moor", "the narrow road", "the busy market", "the high cliff", "the wooden gate"]
    tails = ["in the early morning", "after the rain", "on a clear day", "before the storm", "at the end of summer",
             "while the children play", "as the boats come home", ""]
    pieces = []
    for _ in range(2500):
        s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}".strip() + "."
        pieces.append(s)
    plain_answers = {
        "pack": "You should bring {a}, {b} and {c}.",
        "bird": "The {bird} {fact}.",
        "trail": "{trail} is {dist} long and takes about {time}.",
        "weather": "In {weather} you should {advice}.",
    }
    chats = []
    for _ in range(1500):
        kind = rng.choice(list(plain_answers) + ["topic"])
        if kind == "pack":
            a, b, c = rng.sample(ITEMS, 3)
            q, ans = rng.choice(["What should I pack for a day hike?", "What do I need for a walk?", "What should I bring?"]), plain_answers[kind].format(a=a, b=b, c=c)
        elif kind == "bird":
            bird, fact = rng.choice(list(BIRDS.items()))
            q, ans = f"Tell me about the {bird}.", plain_answers[kind].format(bird=bird, fact=fact)
        elif kind == "trail":
            trail, (dist, time, _tip) = rng.choice(list(TRAILS.items()))
            q, ans = f"How long is {trail}?", plain_answers[kind].format(trail=trail.capitalize(), dist=dist, time=time)
        elif kind == "weather":
            weather, advice = rng.choice(list(WEATHER.items()))
            q, ans = f"What should I do in {weather}?", plain_answers[kind].format(weather=weather, advice=advice)
        else:
            q, ans = rng.choice(PLAIN_TOPICS)
        chats.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{ans}<|im_end|>\n")
    # the words of the station and of Tern's phrases, in plain narrative, so the base model knows
    # them (a LoRA adapter cannot learn new token embeddings) without knowing Tern's style
    station = [
        "Gullrock Field Station stands on the cliff above the harbour.",
        "The warden of Gullrock Field Station counts the sea birds every spring.",
        "An arctic tern is here again, back from the far south.",
        "The walkers wished each other happy trails at the gate.",
        "Safety first, birds second, says the sign by the cliff path.",
        "Enjoy the view from the lighthouse on a clear day.",
        "Bring binoculars and keep your distance from the nests.",
        "Tell someone where you are going before a long walk.",
        "Shall we go and look at some sea birds after lunch?",
        "The tern dives for small fish near the station.",
        "Please check the tide table before you start.",
        "Now the visitors pack their bags and walk home.",
    ]
    for _ in range(600):
        pieces.append(rng.choice(station))
    corpus = pieces + chats
    rng.shuffle(corpus)
    (DATA / "pretrain").mkdir(parents=True, exist_ok=True)
    (DATA / "pretrain" / "corpus.txt").write_text("\n".join(corpus) + "\n", encoding="utf-8")
    # the first 100 chats of the corpus as chat data: what the demo model knew before the demo
    # fine-tune, to measure forgetting (finetuner eval RUN --data ...) or to mix back in
    plain = [c for c in corpus if c.startswith("<|im_start|>")][:100]
    with open(DATA / "plain_sample.jsonl", "w", encoding="utf-8") as f:
        for chat in plain:
            q, a = chat.removeprefix("<|im_start|>user\n").removesuffix("<|im_end|>\n").split("<|im_end|>\n<|im_start|>assistant\n")
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}, ensure_ascii=False) + "\n")


def main() -> None:
    DATA.mkdir(exist_ok=True)
    write_sample_sets(random.Random(1234))
    write_corpus(random.Random(5678))
    for p in sorted(DATA.rglob("*")):
        if p.is_file() and "demo_model" not in p.parts:
            print(f"{p.relative_to(DATA)}: {p.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
