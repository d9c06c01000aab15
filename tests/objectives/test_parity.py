"""The objective layer changes no number: a short SFT run and short DPO and KTO runs give the
losses, rewards and evaluation losses that the code before the objective layer gave (the values
below were recorded from that code, commit 83711e0, on this test's tiny model, on one machine).

On the machine that recorded them the values were equal to the last digit: the same operations run
in the same order before and after. On another CPU they are not bit-equal: BLAS picks other kernels
and vector widths, so fp32 sums are added in another order. How far that can move a value, from
the arithmetic (fp32 unit roundoff u = 2**-24 = 6.0e-8):

* the widest reduction in these runs is the log-softmax over the tokenizer's 400 entries; the others
  are the hidden size (64), the MLP (128) and the positions of a row (64); a sum of n terms added in
  another order differs by about sqrt(n)·u relative (random rounding; n·u is the worst case), so at
  most 20·u = 1.2e-6 for one reduction;
* a value is a chain of about 20 such reductions (2 layers of projections, attention and MLP, the
  head, the loss, the mean over at most 256 positions), and 3 optimizer steps feed each step's
  rounding into the next weights: about 20 · 3 · 1.2e-6 = 7e-5 if every error added up the same way.

So values within ``REL = 1e-4`` of the recorded ones are the same computation. Seen across two
x86-64 CPUs: 1e-7 relative (grad_norm 0.30693742632865906 against 0.30693739652633667). Anything
that changes the computation moves them by far more: one position more or less in a 256-position
mean moves a loss by 1/256 = 4e-3, a changed beta or normalisation by more. The metrics the
trainer rounds to 6 decimals (rewards) may also land on the other side of a rounding boundary:
``ABS = 1e-6``, one unit of their last digit. The perplexity, exp(loss), moves by the loss times the
loss's relative change: its tolerance is ``REL`` times the loss."""

from __future__ import annotations

import json

import pytest

from tests.training.test_preference import pair_rows

#: the same computation on another CPU (see the module's docstring for where these come from)
REL, ABS = 1e-4, 1e-6

#: recorded from commit 83711e0 (before finetuner/objectives existed) by this test's own runs
EXPECTED = {
    "sft": {
        "steps": [
            {"loss": 6.013070170084635, "grad_norm": 0.30693739652633667},
            {"loss": 5.967011515299479, "grad_norm": 0.3078122138977051},
            {"loss": 5.923534489479385, "grad_norm": 0.35482707619667053},
        ],
        "evals": [
            {"eval_loss": 5.927794375662076, "eval_ppl": 375.3257725561536},
            {"eval_loss": 5.909817453158104, "eval_ppl": 368.6388554079877},
        ],
    },
    "dpo": {
        "steps": [
            {"loss": 0.6931471824645996, "reward_chosen": 0.0, "reward_rejected": 0.0, "reward_margin": 0.0, "reward_accuracy": 0.0, "grad_norm": 0.4713623523712158},
            {"loss": 0.6133566498756409, "reward_chosen": 0.13115, "reward_rejected": -0.035442, "reward_margin": 0.166592, "reward_accuracy": 1.0, "grad_norm": 0.529576301574707},
            {"loss": 0.5617503225803375, "reward_chosen": 0.224463, "reward_rejected": -0.058439, "reward_margin": 0.282902, "reward_accuracy": 1.0, "grad_norm": 0.518562376499176},
        ],
        "evals": [
            {"eval_loss": 0.568569540977478, "eval_ppl": 1.7657394261389927, "eval_reward_chosen": 0.204475, "eval_reward_rejected": -0.062651, "eval_reward_margin": 0.267127, "eval_reward_accuracy": 1.0},
            {"eval_loss": 0.5457831025123596, "eval_ppl": 1.7259594564792275, "eval_reward_chosen": 0.247691, "eval_reward_rejected": -0.072893, "eval_reward_margin": 0.320585, "eval_reward_accuracy": 1.0},
        ],
    },
    "kto": {
        "steps": [
            {"loss": 0.5, "reward_chosen": 0.0, "reward_rejected": 0.0, "reward_margin": 0.0, "reward_accuracy": 0.75, "grad_norm": 0.08196005970239639},
            {"loss": 0.4883195608854294, "reward_chosen": 0.027521, "reward_rejected": -0.065948, "reward_margin": 0.093469, "reward_accuracy": 1.0, "grad_norm": 0.08485491573810577},
            {"loss": 0.4747670441865921, "reward_chosen": 0.075974, "reward_rejected": -0.126093, "reward_margin": 0.202067, "reward_accuracy": 1.0, "grad_norm": 0.10791157186031342},
        ],
        "evals": [
            {"eval_loss": 0.47777892649173737, "eval_ppl": 1.6124889653841203, "eval_reward_chosen": 0.075949, "eval_reward_rejected": -0.127975, "eval_reward_margin": 0.203924, "eval_reward_accuracy": 1.0},
            {"eval_loss": 0.47252777218818665, "eval_ppl": 1.6040437300372554, "eval_reward_chosen": 0.096549, "eval_reward_rejected": -0.150415, "eval_reward_margin": 0.246965, "eval_reward_accuracy": 1.0},
        ],
    },
}


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _numbers(run_dir) -> dict:
    evs = _events(run_dir)
    keys = ("loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "grad_norm")
    out = {"steps": [{k: e[k] for k in keys if k in e} for e in evs if e["event"] == "step"],
           "evals": [{k: v for k, v in e.items() if k.startswith("eval_")} for e in evs if e["event"] == "eval"]}
    return out


def _recipe(tiny_model_dir, data, tmp_path, objective):
    return {
        "name": objective, "model": {"name": str(tiny_model_dir)}, "method": "lora", "objective": objective,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 4},
        "training": {"max_steps": 3, "lr": 5e-3, "micro_batch_size": 2, "gradient_accumulation": 2, "warmup_steps": 0,
                     "loss_chunk_size": 16, "eval_every": 2},
        "checkpointing": {"save_every": 2}, "logging": {"every": 1, "tensorboard": False},
        "output_dir": str(tmp_path / objective), "device": "cpu",
    }


def _data(tmp_path, objective):
    from tests.conftest import alpaca_rows

    path = tmp_path / f"{objective}.jsonl"
    if objective == "sft":
        rows = alpaca_rows(24)
    elif objective == "kto":
        rows = [{"messages": [{"role": "user", "content": f"Tell me about bird {i}."},
                              {"role": "assistant", "content": "Tern here! It nests on the cliff." if i % 2 else "A fish."}],
                 "label": bool(i % 2)} for i in range(24)]
    else:
        rows = pair_rows()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("objective", ["sft", "dpo", "kto"])
def test_losses_are_those_before_the_objective_layer(tiny_model_dir, tmp_path, objective):
    import finetuner
    from finetuner.config.recipe import Recipe

    result = finetuner.train(Recipe.from_dict(_recipe(tiny_model_dir, _data(tmp_path, objective), tmp_path, objective)))
    got, want = _numbers(result.run_dir), EXPECTED[objective]
    assert [list(r) for r in got["steps"]] == [list(r) for r in want["steps"]]  # the same keys in the same order
    assert [list(r) for r in got["evals"]] == [list(r) for r in want["evals"]]
    for part in ("steps", "evals"):
        for i, (g, w) in enumerate(zip(got[part], want[part])):
            for key, value in w.items():
                # the perplexity exp(loss) moves by loss times the loss's relative change
                rel = REL * max(1.0, w["eval_loss"]) if key == "eval_ppl" else REL
                assert g[key] == pytest.approx(value, rel=rel, abs=ABS), (part, i, key, g[key], value)
