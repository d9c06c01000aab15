"""The reward of recipes/demo_grpo_cpu.yaml, with TRL's signature: a function of the prompts and the
completions (and of any other column of the data, by name) that returns one number per completion.

The demo model answers "What should I pack?" with a list of three things, drawn from what it saw in
pre-training (boots, a map, water, a head torch, ... and sometimes a whistle). This reward asks for the
whistle: 1.0 when the answer mentions one, else 0.0. A reader can check it by eye in the samples the
run logs, and `finetuner eval runs/demo_grpo_cpu` counts it on held-out prompts for the base and the tune.
"""


def mentions_whistle(prompts, completions, **columns):
    return [1.0 if "whistle" in (c if isinstance(c, str) else c[-1]["content"]).lower() else 0.0 for c in completions]
