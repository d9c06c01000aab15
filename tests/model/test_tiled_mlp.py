"""The tiled MLP (finetuner.model.tiled_mlp, ``training.tiled_mlp``) on the CPU.

- The same loss and gradients: a tiny Llama with LoRA on every linear layer, dense in float64 (the
  only difference tiling may make, the order of the sums that add the chunks' shares of a LoRA
  weight's gradient, is then ~1e-15 relative, far below the tolerances) and on a bitsandbytes
  4-bit base in fp32 (bitsandbytes' CPU dequantization gives wrong values in float64), with a
  tolerance of fp32 reordering noise; with dropout, against the same chunks run without checkpoints (tiling draws one
  mask per chunk, so another mask than the untiled MLP): the recompute must replay the forward's
  masks, or the gradients are not those of the loss.
- The memory it saves, counted byte by byte: what autograd saves for backward (the storages
  packed by ``saved_tensors_hooks``), with and without tiling, against the memory model's layer
  terms (exact); and with gradient checkpointing the peak of the bytes created in backward
  against the model's bounds.
- The recipe key, its runtime resolution and a short training run.
"""

from __future__ import annotations

import pytest

from finetuner.config.recipe import Recipe
from finetuner.errors import UserError

BATCH, SEQ = 2, 24
CHUNK = 7  # 48 tokens: six chunks of 7 and one of 6


def _model(recipe_dict, overrides, chunk: int):
    """The trainer's model (prepare_for_training) with random LoRA B (peft starts it at zero, which
    would leave every lora_A gradient zero); float64 unless the base is quantized (fp32)."""
    import torch

    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.loading import load_base_model, prepare_for_training

    r = Recipe.from_dict(recipe_dict, ["device=cpu", *overrides])
    torch.manual_seed(0)
    model = prepare_for_training(load_base_model(r, resolve_runtime(r)), r, chunk)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return (model if r.method == "qlora" else model.double()).train()


def _batch():
    import torch

    ids = torch.randint(3, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def _loss_and_grads(model):
    import torch

    from finetuner.model.scoring import token_loss_sum

    model.zero_grad()
    torch.manual_seed(123)  # the dropout masks
    loss, _ = token_loss_sum(model, _batch(), 16)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _mlps(model):
    from finetuner.model.tiled_mlp import _is_mlp

    return [m for m in model.modules() if _is_mlp(m)]


def _chunks_without_checkpoints(model, chunk):
    """The reference for dropout: the same chunks, every tensor kept (no recompute)."""
    import torch

    for m in _mlps(model):
        plain = m.forward

        def forward(x, plain=plain):
            flat = x.reshape(-1, x.shape[-1])
            out = torch.cat([plain(piece) for piece in flat.split(chunk)])
            return out.view(*x.shape[:-1], out.shape[-1])

        m.forward = forward


def _assert_same(a, b):
    """Equal up to reordered sums: a sum of n terms reordered moves by at most ~n * eps * sum|terms|;
    here n <= 48 tokens, and the tolerance is 8 times 48 * eps of the largest entry of the tensor
    (float64: ~2e-14; fp32: ~5e-5 relative), which leaves room for sums of |terms| a few times
    their result. A wrong gradient (another dropout mask, a chunk missed) is off by >1e-2."""
    import torch

    (la, ga), (lb, gb) = a, b
    eps = torch.finfo(la.dtype).eps
    tol = 8 * BATCH * SEQ * eps
    torch.testing.assert_close(la, lb, rtol=tol, atol=0)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for name in ga:
        scale = ga[name].abs().max().item()
        assert scale > 0, f"{name}: no gradient reached it"
        torch.testing.assert_close(ga[name], gb[name], rtol=tol, atol=tol * scale, msg=name)


METHODS = {"lora": [], "qlora": ["method=qlora", "quantization.compute_dtype=fp32"]}


@pytest.mark.parametrize("gc", [False, True], ids=["no-checkpointing", "checkpointing"])
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_same_loss_and_gradients_without_dropout(recipe_dict, method, gc):
    overrides = [*METHODS[method], "lora.dropout=0", f"training.gradient_checkpointing={str(gc).lower()}"]
    plain = _model(recipe_dict, overrides, 0)
    tiled = _model(recipe_dict, overrides, CHUNK)
    assert not _mlps(plain)[0].__dict__.get("forward") and len(_mlps(tiled)) == 2
    _assert_same(_loss_and_grads(plain), _loss_and_grads(tiled))


@pytest.mark.parametrize("gc", [False, True], ids=["no-checkpointing", "checkpointing"])
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_dropout_masks_are_replayed_in_the_recompute(recipe_dict, method, gc):
    overrides = [*METHODS[method], "lora.dropout=0.3", f"training.gradient_checkpointing={str(gc).lower()}"]
    reference = _model(recipe_dict, overrides, 0)
    _chunks_without_checkpoints(reference, CHUNK)
    tiled = _model(recipe_dict, overrides, CHUNK)
    ref = _loss_and_grads(reference)
    _assert_same(ref, _loss_and_grads(tiled))
    # dropout is on: another draw gives another loss
    import torch

    model_loss = _loss_and_grads(_model(recipe_dict, overrides, 0))[0]
    assert not torch.equal(model_loss, ref[0])


def test_remove_restores_the_plain_forward_and_patching_twice_changes_the_chunk(recipe_dict):
    from finetuner.model.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp

    model = _model(recipe_dict, ["lora.dropout=0"], CHUNK)
    plain = _model(recipe_dict, ["lora.dropout=0"], 0)
    assert apply_tiled_mlp(model, 5) == 2 and all(m._finetuner_tiled_mlp_chunk == 5 for m in _mlps(model))
    assert remove_tiled_mlp(model) == 2 and all("forward" not in m.__dict__ for m in _mlps(model))
    _assert_same(_loss_and_grads(plain), _loss_and_grads(model))
    with pytest.raises(ValueError, match="at least 1"):
        apply_tiled_mlp(model, 0)


# ---------------------------------------------------------------------- memory
def _tiny(intermediate: int, dropout: float, gc: bool, chunk: int):
    """A 2-layer Llama (fp32) with LoRA on every linear layer, frozen base, tiled or not."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetuner.model.tiled_mlp import apply_tiled_mlp

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=dropout))
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if chunk:
        apply_tiled_mlp(model, chunk)
    return model.train()


def _settings(model, dropout: float, seq: int, chunk: int):
    from finetuner.memory.model import Settings
    from finetuner.model.shapes import shape_from_config

    shape = shape_from_config(model.config.to_dict())
    return shape, Settings(method="lora", weight_dtype="fp32", compute_dtype="fp32", lora_r=8, lora_dropout=dropout,
                           micro_batch=BATCH, seq_len=seq, platform="cpu", tiled_mlp=chunk)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_for_backward_drops_by_the_memory_models_mlp_terms(dropout):
    """Without checkpointing every layer keeps its MLP's tensors for backward; tiled, only the MLP's
    input (the chunks' checkpoints hold it) for all tokens. The drop, counted over the storages
    autograd saves, equals layers x (the model's untiled per-layer bytes - its tiled ones)."""
    import torch

    from finetuner.memory.model import activation_bytes

    ids = torch.randint(3, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    saved = {}
    for chunk in (0, CHUNK):
        model = _tiny(128, dropout, gc=False, chunk=chunk)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t, seen=seen, params=params):
            if t.untyped_storage()._cdata not in params:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()  # views: counted once
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids)
        saved[chunk] = sum(seen.values())
    shape, s = _settings(model, dropout, SEQ, CHUNK)
    plain, tiled = activation_bytes(shape, s.with_(tiled_mlp=0)), activation_bytes(shape, s)
    predicted = shape.num_layers * (plain.per_layer - tiled.per_layer)
    assert saved[0] - saved[CHUNK] == predicted, (saved, predicted)
    # what is left of the MLP: its input, once per layer (the residual dtype, fp32 here)
    assert any(n == "MLP input (held by the tiled chunks)" or n == "MLP input (kept for backward)" for n, _ in tiled.terms)
    # and in each layer's backward one chunk's worth of everything else the MLP saves comes back
    names = [n for n, _ in plain.terms]
    mlp = plain.terms[names.index("MLP norm: fp32 input") + 1:]
    assert tiled.mlp_chunk == pytest.approx(CHUNK * sum(b for n, b in mlp if n != "MLP input (kept for backward)"), abs=1)


def test_with_checkpointing_a_layers_backward_holds_one_chunk():
    """With checkpointing, the backward recomputes a layer at a time. The peak of the bytes created
    in backward drops by at least the memory model's saved MLP bytes of one layer less one chunk
    (what the recompute no longer holds) and by at most that plus the model's whole difference in
    the short-lived MLP gradients (which tiling also cuts to one chunk)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from finetuner.memory.model import activation_bytes

    seq, chunk, intermediate = 64, 8, 512  # the MLP is the largest part of a layer, as in a real model
    ids = torch.randint(3, 300, (BATCH, seq), generator=torch.Generator().manual_seed(0))

    class PeakOfNewStorages(TorchDispatchMode):
        """Bytes of the storages created under the mode that are alive, at their highest."""

        def __init__(self):
            super().__init__()
            self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
            self.now = self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key in [k for k, (ref, _) in self.alive.items() if ref.expired()]:
                self.now -= self.alive.pop(key)[1]
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.alive:
                    st = t.untyped_storage()
                    self.alive[st._cdata] = (StorageWeakRef(st), st.nbytes())
                    self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            return out

    peaks = {}
    for c in (0, chunk):
        model = _tiny(intermediate, 0.0, gc=True, chunk=c)
        loss = model(input_ids=ids, labels=ids).loss
        mode = PeakOfNewStorages()
        with mode:
            loss.backward()
        peaks[c] = mode.peak
    shape, s = _settings(model, 0.0, seq, chunk)
    plain, tiled = activation_bytes(shape, s.with_(tiled_mlp=0)), activation_bytes(shape, s)
    saved_drop = plain.per_layer - tiled.per_layer - tiled.mlp_chunk
    transient_drop = plain.transient - tiled.transient
    assert saved_drop > 0 and transient_drop > 0
    drop = peaks[0] - peaks[chunk]
    assert saved_drop <= drop <= saved_drop + transient_drop, (peaks, saved_drop, transient_drop)


# ---------------------------------------------------------------------- recipe, runtime, training
@pytest.mark.parametrize("value", ["sometimes", 2048, "2048"])
def test_recipe_key_accepts_auto_true_false_only(recipe_dict, value):
    for ok in ("auto", True, False):
        assert Recipe.from_dict({**recipe_dict, "training": {**recipe_dict["training"], "tiled_mlp": ok}}).training.tiled_mlp == ok
    with pytest.raises(UserError) as e:
        Recipe.from_dict({**recipe_dict, "training": {**recipe_dict["training"], "tiled_mlp": value}})
    assert "training.tiled_mlp" in e.value.message


def test_runtime_resolves_auto_from_checkpointing_and_the_sequence_length(recipe_dict):
    from finetuner.config.hardware import get_gpu
    from finetuner.config.runtime import Device, resolve, resolve_runtime
    from finetuner.memory.model import settings_from_recipe
    from finetuner.model.tiled_mlp import AUTO_MIN_SEQ_LEN, CHUNK_TOKENS

    def rt(*overrides):
        return resolve_runtime(Recipe.from_dict(recipe_dict, ["device=cpu", *overrides])).tiled_mlp

    assert CHUNK_TOKENS == 2048 and AUTO_MIN_SEQ_LEN == 16384
    long, short = f"data.max_seq_len={AUTO_MIN_SEQ_LEN}", f"data.max_seq_len={AUTO_MIN_SEQ_LEN - 1}"
    assert rt(long, "training.gradient_checkpointing=true") == CHUNK_TOKENS  # auto is the default
    assert rt(short, "training.gradient_checkpointing=true") == 0
    assert rt(long, "training.gradient_checkpointing=false") == 0
    assert rt(long, "training.gradient_checkpointing=auto") == 0  # not decided yet: the planner sets it first
    assert rt("training.tiled_mlp=true") == CHUNK_TOKENS and rt(long, "training.gradient_checkpointing=true", "training.tiled_mlp=false") == 0
    # the micro-batch does not count (the planner's choice of it must not switch tiling)
    assert rt(short, "training.gradient_checkpointing=true", "training.micro_batch_size=8") == 0
    # the same answer for a card the planner is asked about, and the memory model reads it
    r = Recipe.from_dict(recipe_dict, [long, "training.gradient_checkpointing=true"])
    assert resolve(r, Device.of(get_gpu("rtx4090"))).tiled_mlp == CHUNK_TOKENS
    assert settings_from_recipe(r, get_gpu("rtx4090"), "llama").tiled_mlp == CHUNK_TOKENS
    r = Recipe.from_dict(recipe_dict, [long, "training.gradient_checkpointing=true", "training.tiled_mlp=false"])
    assert settings_from_recipe(r, get_gpu("rtx4090"), "llama").tiled_mlp == 0


def test_a_tiled_run_trains_as_the_plain_one(recipe_dict, monkeypatch):
    """A few steps with checkpointing, tiled (chunks of 16 tokens: the demo's sequences are short)
    and not: the same losses up to fp32 noise (each LoRA gradient's chunk shares are added in
    another order: ~1e-7 relative, amplified a little by the steps; a wrong gradient moves the
    loss by orders of magnitude more), and the start event says what ran."""
    import finetuner
    from finetuner.model import tiled_mlp
    from finetuner.runs.events import read_events

    monkeypatch.setattr(tiled_mlp, "CHUNK_TOKENS", 16)
    losses, starts = {}, {}
    for tiled in (False, True):
        d = dict(recipe_dict, output_dir=str(recipe_dict["output_dir"]) + f"-{tiled}")
        res = finetuner.train(Recipe.from_dict(d, ["device=cpu", "training.max_steps=4", "training.gradient_checkpointing=true",
                                                   f"training.tiled_mlp={str(tiled).lower()}"]))
        losses[tiled] = res.losses
        starts[tiled] = next(e for e in read_events(res.run_dir / "events.jsonl") if e["event"] == "start")
    assert (starts[False]["tiled_mlp"], starts[True]["tiled_mlp"]) == (0, 16)
    assert len(losses[True]) == 4 and losses[True][-1] < losses[True][0]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=0)
