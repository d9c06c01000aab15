"""What each linear layer of a decoder layer does, read from the model transformers builds.

The memory model's activation terms (:mod:`finetuner.memory.model`) describe a decoder layer as an attention
block (q, k, v and o projections, or one fused qkv) and a feed-forward block (gate, up and down; a fused
gate_up; or up and down with no gate), or, in a mixture of experts, routed experts (fused 3-D expert tensors),
a router and optional shared experts. Families give these layers their own names (GPT-2's ``attn.c_attn``,
Falcon's ``self_attention.query_key_value``, OPT's ``fc1``/``fc2``, BERT's ``attention.self.query``). This
module finds each linear layer's role in an :class:`~finetuner.model.inventory.Inventory`: which block by its
path (an attention block's path has ``att`` in it), which role inside the block by its widths and, where
the widths cannot tell (q, k, v and o of equal width), by the names families use (:data:`ATTENTION_NAMES`).
Linears the memory model's terms do not name are kept with a role of their own: an attention block's extras (an
output gate, latent attention's low-rank projections, an indexer's projections: role = their path), routers,
and ``frozen`` ones (a Linear subclass with a forward and settings of its own). Which linears LoRA's
``all-linear`` trains is decided here too (:func:`all_linear_paths`), for the memory model and the trainer alike.
A layer whose linears do not all find a role is refused in one line that names them.

No torch here: the inventory is read (and cached) by :mod:`finetuner.model.inventory`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from finetuner.model.inventory import Inventory, LayerKind, LayerLinear

#: the last part of an attention linear's path, lower case, by role (a wrapper's trailing ``linear`` dropped:
#: Moshi's ``self_attn.q_proj.linear``)
ATTENTION_NAMES = {
    "q_proj": {"q_proj", "query", "wq", "project_q", "q", "q_lin", "query_key"},
    "k_proj": {"k_proj", "key", "wk", "project_k", "k", "k_lin"},
    "v_proj": {"v_proj", "value", "wv", "project_v", "v", "v_lin"},
    "qkv_proj": {"qkv_proj", "query_key_value", "c_attn", "wqkv", "qkv", "w_pack"},
    "o_proj": {"o_proj", "out_proj", "dense", "c_proj", "attention_out", "wo", "o", "out_lin"},
}
#: the gate of a gated MLP where its two input linears have the same widths (Llama's gate_proj, LFM2's w1,
#: CPM-Ant's w_0, xLSTM's proj_up_gate); the other one is the up projection
GATE_NAMES = {"gate_proj", "w1", "w_0", "gate", "wi_0", "fc1_g", "proj_up_gate"}
#: latent attention's queries (DeepSeek's q_b_proj; A.X K2's q_gate_proj, queries and an output gate fused) and a
#: low-rank output's second half (DeepSeek-V4's o_b_proj), where the block has no q_proj / o_proj
LATENT_NAMES = {"q_b_proj": "q_proj", "q_gate_proj": "q_proj", "o_b_proj": "o_proj"}
#: modules inside an attention block whose linears are its extras whatever their names
AUXILIARY_NAMES = {"indexer", "compressor"}
#: the down projection, where widths cannot tell it (an MLP as wide as the hidden size)
DOWN_NAMES = {"down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h", "w_out", "layer_2", "wo", "fc_out"}
#: modules that hold a linear-attention block (Qwen3.5's and Qwen3-Next's Gated DeltaNet, ``linear_attn``: its
#: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj, or the fused in_proj_qkvz and in_proj_ba), a token mixer
#: with no q/k/v/o of its own; its linears' role is their path (role ``linear:<path>``)
LINEAR_ATTENTION_NAMES = {"linear_attn"}
#: linears (or modules holding them) that sit on the decoder layer itself, beside its attention and MLP: Gemma 3n/4's
#: per-layer input (per_layer_input_gate reads the hidden state, per_layer_projection returns to it), Gemma 3n's
#: AltUp (``altup``: its router and coefficients), LAuReL (``laurel``: a low-rank residual) and Qwen4-Exp's hyper-connections
#: (``attn_hyper_connection``, ``mlp_hyper_connection``: a residual stream of several copies of the hidden state, mixed
#: down into each block's input and the block's output injected back; no part of the attention or MLP they wrap);
#: role ``beside:<path>``
BESIDE_NAMES = {"per_layer_input_gate", "per_layer_projection", "altup", "laurel", "attn_hyper_connection",
                "mlp_hyper_connection"}
#: a mixture of experts' router and the gate of its shared experts, when they are torch Linear layers
ROUTER_NAMES = {"router", "gate", "shared_expert_gate", "shared_experts_gate"}
#: module names that hold a mixture of experts' shared experts (every token goes through them)
SHARED_NAMES = {"shared_expert", "shared_experts", "shared_mlp"}
#: the most parameters a layer may hold in no linear layer, norm, expert tensor or router, as a share of its own
#: (a learned activation's scale, attention sinks, expert biases); more is a layer the memory model does not see
#: (a state-space layer's A and D, XLNet's 3-D attention weights)
OTHER_SHARE = 0.05
#: config keys that say how many experts each token is routed to, in the spellings families use
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "experts_per_token", "moe_k",
              "num_experts_per_token", "top_k_experts")


#: the linear layers of a state-space mixer (Mamba's in_proj, x_proj, dt_proj and out_proj; Mamba-2's in_proj and
#: out_proj) and of LFM2's short convolution (in_proj, out_proj): role ``mixer``. Its convolution, A_log, D and
#: dt_bias are no linear layers: the inventory counts them as the layer's other parameters, frozen under LoRA as peft
#: leaves them; the scan's saved states are the layer's trace's (:func:`finetuner.memory.activations.traced_excess`)
MIXER_NAMES = {"in_proj", "x_proj", "dt_proj", "out_proj",
               # RecurrentGemma's recurrent block: two branches in (linear_x to the convolution and the RG-LRU,
               # linear_y to its gate) and linear_out back; the RG-LRU's own gate weights are its other parameters
               "linear_x", "linear_y", "linear_out"}
#: the modules of a decoder layer that hold a state-space mixer or a short convolution, by the names transformers
#: gives them (Nemotron-H's ``mixer`` also holds its attention and MLP layers' linears, by their own names, and
#: RecurrentGemma's ``temporal_block`` its attention layers' q/k/v/o)
MIXER_MODULES = {"mixer", "mamba", "conv", "temporal_block"}
#: modules of a decoder layer whose every linear is a recurrent mixer's, whatever its name: xLSTM's mLSTM
#: (``mlstm_layer``: q, k and v into a matrix memory, its input, forget and output gates, out_proj), a recurrence
#: with no softmax attention, its state and gates the layer's trace's
RECURRENT_MODULES = {"mlstm_layer"}
#: a hybrid layer's linears outside its blocks (Zamba's ``linear`` after the shared transformer, Zamba2's
#: per-layer adapters of the shared MLP): roles of their own (their paths), as an attention block's extras
HYBRID_EXTRA_MARKS = ("adapter",)


#: config keys of the number of attention heads, in the spellings families use
HEADS_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads")
#: config keys of the decoder layers' width (OPT's embeddings may be narrower, projected in and out)
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")


class LayoutError(ValueError):
    """A layout the memory model does not describe; the message says what differs (one line)."""


@dataclass(frozen=True)
class ExpertsLayout:
    """The routed experts as read from the fused expert tensors (see :class:`finetuner.model.shapes.Experts`)."""

    count: int
    top_k: int
    intermediate: int
    numel: int
    layers: int
    gated: bool
    shared_intermediate: int


@dataclass(frozen=True)
class Layout:
    """The roles of a model's decoder layers (every kind of layer together)."""

    #: each linear as read, with the layers that hold it (() when every layer does)
    linears: tuple[tuple[LayerLinear, tuple[int, ...]], ...]
    #: ``(role, path in the layer)``
    roles: tuple[tuple[str, str], ...]
    hidden: int  # the decoder layers' width (the residual stream)
    q_dim: int
    kv_dim: int
    #: attention linears outside q/k/v/o, as ``(path, in_features, out_features)`` (:func:`_attention`)
    attention_extras: tuple[tuple[str, int, int], ...]
    head_dim: int
    #: the dense MLP's width (None: every layer routes to experts)
    intermediate: int | None
    gated: bool
    fused_qkv: bool
    fused_gate_up: bool
    layer_norms: int  # norms per layer outside the q/k norms (the largest kind's)
    qk_norm: bool
    norm_params_per_layer: int  # the largest kind's
    experts: ExpertsLayout | None
    counts: dict[str, int] = field(default_factory=dict)
    #: the paths ``all-linear`` trains (:func:`all_linear_paths`); None: every linear
    all_linear: tuple[str, ...] | None = None

    @property
    def standard(self) -> bool:
        """The names and layers are those of the layout written in :mod:`finetuner.model.shapes` (Llama's)."""
        return (self.experts is None and all(not ix for _, ix in self.linears)
                and all(path in (f"self_attn.{role}", f"mlp.{role}") for role, path in self.roles))


def _key(path: str) -> str:
    parts = path.lower().split(".")
    return parts[-2] if parts[-1] == "linear" and len(parts) > 1 else parts[-1]


def _in_attention(path: str) -> bool:
    return any("att" in part for part in path.lower().split(".")[:-1])


def in_mixer(path: str) -> bool:
    """The linear at ``path`` (in a decoder layer) is a state-space mixer's or a short convolution's
    (:data:`MIXER_NAMES` in one of :data:`MIXER_MODULES`, outside any attention block; any linear of a
    :data:`RECURRENT_MODULES` one)."""
    parts = set(path.split(".")[:-1])
    return bool(parts & RECURRENT_MODULES) or (_key(path) in MIXER_NAMES and not _in_attention(path)
                                               and bool(parts & MIXER_MODULES))


def _attention_like(path: str) -> bool:
    """In an attention block: by its path, or by its name inside a hybrid's mixer module (Nemotron-H's
    ``mixer.q_proj``)."""
    return _in_attention(path) or (bool(set(path.split(".")[:-1]) & MIXER_MODULES) and not in_mixer(path)
                                   and any(_key(path) in names for names in ATTENTION_NAMES.values()))


def _in_linear_attention(path: str) -> bool:
    return any(part in LINEAR_ATTENTION_NAMES for part in path.split(".")[:-1])


def _beside(path: str) -> bool:
    return any(part in BESIDE_NAMES for part in path.split("."))


#: role prefixes of linears that keep their path as their role (:func:`read_layout`'s ``roles``)
PATH_ROLES = ("extra:", "linear:", "beside:")


def _in_shared(path: str) -> bool:
    return any(part in SHARED_NAMES for part in path.split(".")[:-1])


def is_router(path: str, out_features: int, moe: bool) -> bool:
    """The linear at ``path`` (in a decoder layer) routes tokens: a mixture of experts' router, or the one-output
    gate of its shared experts. LoRA's ``all-linear`` leaves it out (:func:`all_linear_paths`)."""
    parts = path.split(".")
    key = _key(path)
    return (moe and (key in ROUTER_NAMES or bool({"router", "gate"} & set(parts[:-1])))) or (out_features == 1 and key in ROUTER_NAMES)


#: peft refuses LoRA on a module of these names in these model types (``_check_lora_target_modules_mamba`` in
#: peft.tuners.tuners_utils: its ``all-linear`` would name ``out_proj`` and fail): left out of ``all-linear``
PEFT_MAMBA_TYPES = {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}
PEFT_MAMBA_REFUSED = {"out_proj", "conv1d"}


def peft_refused(model_type: str) -> frozenset[str]:
    """The module names peft will not put LoRA on in a model of ``model_type`` (:data:`PEFT_MAMBA_TYPES`)."""
    return frozenset(PEFT_MAMBA_REFUSED) if model_type in PEFT_MAMBA_TYPES else frozenset()


def all_linear_paths(linears: list[tuple[str, int, bool]], moe: bool, renames: bool = False,
                     root: bool = False, refused: frozenset[str] = frozenset()) -> list[str] | str:
    """What ``lora.target_modules: all-linear`` means for a decoder layer's linears (``(path in the layer,
    out_features, plain)``): peft's ``all-linear`` where peft does what it says; else the paths themselves.

    Left out: a linear with a forward of its own (:func:`finetuner.model.inventory.is_plain_linear`) or whose
    weight another module shares (:func:`finetuner.model.inventory.shared_weights`: Zamba2's shared block); on a
    mixture of experts everything but its attention and its state-space mixers (peft adds the routers, and a LoRA'd router crashes
    Phi-MoE's forward); where peft renames (``renames``, :func:`finetuner.model.inventory.peft_renames`) every
    linear named like an expert's, wherever it is (peft would move its LoRA onto the fused experts, and the
    dense MLP or the attention gate would go without); ``root``: linears outside the decoder layers (ModernBERT's
    head.dense, OPT-350m's project_in), which stay frozen; ``refused``: names peft refuses for the family
    (:func:`peft_refused`: a Mamba mixer's out_proj). The memory model counts the same
    (:func:`finetuner.model.shapes.lora_targets`)."""
    if not moe and not renames and not root and not refused and all(plain for *_, plain in linears):
        return "all-linear"
    return sorted({p for p, out, plain in linears if plain and not (renames and peft_moe_name(p))
                   and p.rsplit(".", 1)[-1] not in refused and (not moe or (
        (_attention_like(p) or in_mixer(p)) and not is_router(p, out, moe)))})


#: the names peft's bridge for adapters trained under transformers 4 turns into LoRA on a mixture of experts'
#: fused experts (peft.utils.transformers_weight_conversion); a target ending in one is not where it says
PEFT_MOE_NAMES = {"gate", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"}


def peft_moe_name(path: str) -> bool:
    """An attention linear of a mixture of experts that LoRA leaves out: its name is one peft would take for
    the experts' (AFMoE's attention output gate ``self_attn.gate_proj``)."""
    return _key(path) in PEFT_MOE_NAMES


def _attention(linears: list[LayerLinear], h: int) -> dict[str, LayerLinear]:
    """q/k/v/o (or a fused qkv and o) of an attention block by their names; other linears in it are extras
    (role ``extra:<path>``): an output gate (AFMoE's gate_proj, MiniMax's output_gate), Doge's dt_proj, the
    low-rank projections of multi-head latent attention (DeepSeek's q_a_proj, kv_a_proj_with_mqa, kv_b_proj,
    whose queries are q_b_proj's). A layer with q and o alone reads the keys and values of an earlier layer (KV
    shared across layers); one with q, k and o uses its keys as its values (Gemma 4's ``attention_k_eq_v``); one
    with q, v and o its queries as its keys (Reformer's LSH attention, whose ``query_key`` is both); one with q, k,
    o and ``v_proj_*`` extras takes its values in parts (ZAYA's ``v_proj_current`` and ``v_proj_delayed``)."""
    what = f"its attention's linear layers are {', '.join(x.name for x in linears)}"
    by_role: dict[str, LayerLinear] = {}
    for lin in linears:
        role = next((r for r, names in ATTENTION_NAMES.items() if _key(lin.name) in names), None)
        if set(lin.name.split(".")[:-1]) & AUXILIARY_NAMES:
            role = None  # a sparse-attention indexer's own projections (DeepSeek-V3.2's, Hunyuan's)
        if role is None and _key(lin.name) in LATENT_NAMES and LATENT_NAMES[_key(lin.name)] not in by_role:
            role = LATENT_NAMES[_key(lin.name)]
        by_role[role if role is not None and role not in by_role else f"extra:{lin.name}"] = lin
    standard = {"q_proj", "k_proj", "v_proj"} <= by_role.keys() or "qkv_proj" in by_role
    latent = "q_proj" in by_role and not {"k_proj", "v_proj", "qkv_proj"} & by_role.keys() \
        and any("kv" in _key(r) for r in by_role if r.startswith("extra:"))
    # a layer that reads an earlier layer's keys and values (KV shared across layers: Gemma 3n's last layers) has
    # queries and an output only
    reused = set(by_role) == {"q_proj", "o_proj"}
    # a layer whose keys serve as its values (Gemma 4's attention_k_eq_v: no v_proj in its full-attention layers)
    keys_as_values = set(by_role) == {"q_proj", "k_proj", "o_proj"}
    # a layer whose queries serve as its keys (Reformer's LSH attention: one query_key projection, and values)
    queries_as_keys = set(by_role) == {"q_proj", "v_proj", "o_proj"}
    # values from projections of their own parts (ZAYA's compressed convolutional attention: v_proj_current and
    # v_proj_delayed, half the values each): extras, their widths counted as the block's
    split_values = {"q_proj", "k_proj", "o_proj"} <= by_role.keys() and "v_proj" not in by_role \
        and any(_key(r).startswith("v_proj_") for r in by_role if r.startswith("extra:"))
    if "o_proj" not in by_role or not (standard or latent or reused or keys_as_values or queries_as_keys or split_values):
        raise LayoutError(what)
    if by_role["o_proj"].out_features != h:
        raise LayoutError(f"its attention output {by_role['o_proj'].name} is {by_role['o_proj'].out_features} wide, "
                          f"not the hidden size {h}")
    return by_role


def is_attention_role(role: str) -> bool:
    return role in ATTENTION_NAMES or role.startswith(("extra:", "linear:"))


def _mlp(linears: list[LayerLinear], h: int, prefix: str = "") -> dict[str, LayerLinear]:
    """gate/up/down (or gate_up/down, or up/down) of a feed-forward block, by widths: the down projection
    returns to the hidden size; the others read it."""
    what = f"its {'shared experts' if prefix else 'MLP'}'s linear layers are {', '.join(x.name for x in linears)}"
    downs = [x for x in linears if x.out_features == h and x.in_features != h] or [x for x in linears if x.out_features == h]
    if len(downs) != 1 and len(linears) > 1:
        downs = [x for x in downs if _key(x.name) in DOWN_NAMES]
    if len(downs) != 1:
        raise LayoutError(what)
    down = downs[0]
    ins = [x for x in linears if x is not down]
    i = down.in_features
    if any(x.in_features != h for x in ins):
        raise LayoutError(what)
    if len(ins) == 1 and ins[0].out_features == 2 * i:
        return {f"{prefix}gate_up_proj": ins[0], f"{prefix}down_proj": down}
    if len(ins) == 1 and ins[0].out_features == i:
        return {f"{prefix}up_proj": ins[0], f"{prefix}down_proj": down}
    if len(ins) == 2 and all(x.out_features == i for x in ins):
        gate = next((x for x in ins if _key(x.name) in GATE_NAMES), ins[0])
        up = ins[1] if gate is ins[0] else ins[0]
        return {f"{prefix}gate_proj": gate, f"{prefix}up_proj": up, f"{prefix}down_proj": down}
    raise LayoutError(what)


def _experts(kind: LayerKind, h: int) -> tuple[int, int, bool, int]:
    """``(count, one expert's intermediate width, gated, elements)`` of a kind's fused expert tensors."""
    shapes = dict(kind.experts)
    down = next((s for p, s in shapes.items() if p.endswith(("down_proj", "w2", "wo"))), None)
    if down is None or len(down) != 3 or len(shapes) > 2:
        raise LayoutError(f"its expert tensors are {', '.join(f'{p} {s}' for p, s in shapes.items())}")
    count = down[0]
    i = down[2] if down[1] == h else down[1]
    other = next(s for p, s in shapes.items() if s is not down) if len(shapes) == 2 else None
    gated = other is not None and 2 * i in other[1:]
    return count, i, gated, sum(math.prod(s) for s in shapes.values())


def _kind_layout(kind: LayerKind, h: int, hybrid: bool = False) -> tuple[dict[str, LayerLinear], list[LayerLinear]]:
    """A kind's roles and its router linears. ``hybrid``: the model has state-space mixers or short convolutions
    (:func:`in_mixer`), where a layer may hold no attention (a Mamba layer; Nemotron-H's MLP and MoE layers)."""
    moe = bool(kind.experts)
    attn, mlp, shared, routers, mixer, extras, linear, beside = [], [], [], [], [], [], [], []
    for lin in kind.linears:
        if not lin.plain:
            continue  # frozen, counted with its block's parameters (roles: "frozen")
        if is_router(lin.name, lin.out_features, moe):
            routers.append(lin)
        elif hybrid and in_mixer(lin.name):
            mixer.append(lin)
        elif _in_linear_attention(lin.name):
            linear.append(lin)
        elif _beside(lin.name):
            beside.append(lin)
        elif _attention_like(lin.name) if hybrid else _in_attention(lin.name):
            attn.append(lin)
        elif hybrid and ("." not in lin.name or any(m in lin.name for m in HYBRID_EXTRA_MARKS)):
            extras.append(lin)
        elif _in_shared(lin.name):
            shared.append(lin)
        else:
            mlp.append(lin)
    if not attn and not linear and not hybrid:
        raise LayoutError(f"its decoder layer's linear layers are {', '.join(sorted(x.name for x in kind.linears))}"
                          if kind.linears else "its decoder layer holds no linear layers (its own projections)")
    if linear and not any(x.out_features == h for x in linear):
        raise LayoutError(f"its linear attention's linear layers are {', '.join(x.name for x in linear)}: none returns "
                          f"to the hidden size {h}")
    roles = _attention(attn, h) if attn else {}
    roles |= {f"mixer:{x.name}": x for x in mixer} | {f"extra:{x.name}": x for x in extras}
    roles |= {f"linear:{x.name}": x for x in linear} | {f"beside:{x.name}": x for x in beside}
    if mlp and moe:
        if shared:
            raise LayoutError(f"it has routed experts, shared experts and a dense MLP in one layer "
                              f"({', '.join(x.name for x in mlp)})")
        # a dense MLP every token takes beside the routed experts (Gemma 4's MoE layers): a shared expert's terms
        shared, mlp = mlp, []
    if mlp:
        roles |= _mlp(mlp, h)
    elif not moe and not hybrid:
        raise LayoutError(f"its decoder layer's linear layers are {', '.join(sorted(x.name for x in kind.linears))}")
    if shared:
        roles |= _mlp(shared, h, prefix="shared.")
    return roles, routers


def _hidden(inv: Inventory, text_cfg: dict) -> int:
    return next((int(text_cfg[k]) for k in HIDDEN_KEYS if isinstance(text_cfg.get(k), int) and text_cfg[k] > 0),
                inv.hidden_size)


def read_layout(inv: Inventory, text_cfg: dict) -> Layout:
    """The roles of ``inv``'s decoder layers (``text_cfg``: the config it was built from, for the heads and the
    experts per token); :class:`LayoutError` when the memory model does not describe them."""
    h = _hidden(inv, text_cfg)
    hybrid = any(in_mixer(x.name) for kind in inv.kinds for x in kind.linears)
    found = [(kind, *_kind_layout(kind, h, hybrid)) for kind in inv.kinds]
    for kind in inv.kinds:
        if any(in_mixer(x.name) for x in kind.linears):
            continue  # a mixer's own weights (its convolution, A_log, D, dt_bias; Zamba's per-head projections)
        own = sum(x.params for x in kind.linears) + kind.conv_params \
            + sum(n for _, n in kind.norms) + sum(math.prod(s) for _, s in kind.experts) + kind.router_params
        if kind.other_params - kind.conv_params > OTHER_SHARE * (own + kind.other_params - kind.conv_params):
            raise LayoutError(f"{kind.other_params:,} parameters of each {kind.module} are in no linear layer, norm or "
                              "expert")

    # every linear with the layers that hold it; each role's path, the same in every kind
    held: dict[LayerLinear, list[int]] = {}
    paths: dict[str, set[str]] = {}
    for kind, roles, routers in found:
        for lin in kind.linears:
            held.setdefault(lin, []).extend(kind.indices)
        for role, lin in roles.items():
            paths.setdefault(role, set()).add(lin.name)
        for lin in routers:
            paths.setdefault(f"router.{lin.name}", set()).add(lin.name)
        for lin in kind.linears:
            if not lin.plain:
                paths.setdefault(f"frozen.{lin.name}", set()).add(lin.name)
    every = set(range(inv.num_layers))
    linears = tuple((lin, () if set(ix) == every else tuple(sorted(ix))) for lin, ix in held.items())
    # each role's paths (a family may name one role differently in different layers: MiniMax's o_proj / out_proj)
    roles = tuple((r.split(".", 1)[0] if r.startswith(("router.", "frozen.")) else r.split(":", 1)[1] if r.startswith(PATH_ROLES)
                   else "mixer" if r.startswith("mixer:") else r, p)
                  for r, ps in paths.items() for p in sorted(ps))

    # the attention the memory model's terms describe: the widest kind's (layers with other attention widths are
    # counted at these; on the safe side)
    def width(roles: dict) -> int:
        return sum(x.out_features for r, x in roles.items() if r in ("q_proj", "k_proj", "v_proj", "qkv_proj"))

    attending = [roles for _, roles, _ in found if "o_proj" in roles]  # (a linear-attention kind has no q/k/v/o)
    if not attending:
        if any(r.startswith("linear:") for _, roles, _ in found for r in roles):
            raise LayoutError("every decoder layer is linear attention (no softmax attention layer to take the widths of)")
        # no attention in any layer (Mamba, Mamba-2): no heads; its mixers are the trace's
        return _layout(inv, text_cfg, found, linears, roles, h, q_dim=0, kv_dim=0, head_dim=0, fused_qkv=False, extras=())
    first = max(attending, key=width)
    fused_qkv = "qkv_proj" in first
    o = first["o_proj"]
    q_dim = first["q_proj"].out_features if "q_proj" in first else o.in_features
    heads = next((int(text_cfg[k]) for k in HEADS_KEYS if isinstance(text_cfg.get(k), int) and text_cfg[k] > 0), 0)
    head_dim = int(text_cfg.get("head_dim") or text_cfg.get("qk_head_dim") or (q_dim // heads if heads else 0))
    if heads and not text_cfg.get("head_dim") and q_dim % heads == 0:
        head_dim = q_dim // heads
    if heads and head_dim and q_dim % head_dim and q_dim % heads == 0:
        # the config's head_dim is another layer kind's (dots3's sliding layers, their own per_layer_config): the
        # widest kind's width per head, read from its queries
        head_dim = q_dim // heads
    if not head_dim or q_dim % head_dim:
        raise LayoutError(f"its attention width {q_dim} is no whole number of heads (head_dim {head_dim})")
    if fused_qkv:
        kv_dim = (first["qkv_proj"].out_features - q_dim) // 2
    elif "k_proj" in first:
        kv_dim = max(first["k_proj"].out_features, first["v_proj"].out_features if "v_proj" in first else 0)
    else:  # latent attention: keys and values expanded to every head
        kv_dim = q_dim
    kv_dim = -(-kv_dim // head_dim) * head_dim if kv_dim > 0 else kv_dim  # whole heads, rounded up
    if kv_dim <= 0:
        raise LayoutError(f"its key/value width {kv_dim} is no whole number of heads (head_dim {head_dim})")
    extras = tuple((x.name, x.in_features, x.out_features) for r, x in first.items() if r.startswith("extra:"))
    return _layout(inv, text_cfg, found, linears, roles, h, q_dim=q_dim, kv_dim=kv_dim, head_dim=head_dim,
                   fused_qkv=fused_qkv, extras=extras)


def _layout(inv: Inventory, text_cfg: dict, found, linears, roles, h: int, *, q_dim: int, kv_dim: int, head_dim: int,
            fused_qkv: bool, extras: tuple) -> Layout:
    """The :class:`Layout` of the attention widths read, with the MLP, the experts, the norms and the counts."""
    dense = next((roles for kind, roles, _ in found if not kind.experts and "down_proj" in roles), None)
    moe_kinds = [(kind, roles) for kind, roles, _ in found if kind.experts]
    experts = None
    if moe_kinds:
        read = [(_experts(kind, h), kind.count) for kind, _ in moe_kinds]
        sizes = {e[:3] for e, _ in read}
        if len(sizes) > 1:
            raise LayoutError(f"its MoE layers hold experts of different sizes ({sorted(sizes)})")
        count, i, gated = sizes.pop()
        top_k = next((int(text_cfg[k]) for k in TOP_K_KEYS if isinstance(text_cfg.get(k), int) and text_cfg[k] > 0), None)
        if top_k is None or top_k > count:
            raise LayoutError(f"a mixture of {count} experts whose config says no number of experts per token "
                              f"({' or '.join(TOP_K_KEYS[:2])})")
        shared = moe_kinds[0][1].get("shared.down_proj")
        experts = ExpertsLayout(count=count, top_k=top_k, intermediate=i,
                                numel=sum(e[3] * n for e, n in read),
                                layers=sum(kind.count for kind, _ in moe_kinds), gated=gated,
                                shared_intermediate=shared.in_features if shared else 0)
    main = max(inv.kinds, key=lambda k: (bool(k.experts), k.count))
    qk = [n for n, _ in main.norms if _in_attention(n) and any(m in _key(n) for m in ("q_", "k_", "query", "key"))]
    mlp_roles = dense or {}
    counts = _counts(inv, found)
    chosen = all_linear_paths([(lin.name, lin.out_features, lin.plain) for lin, _ in linears], bool(experts), inv.peft_renames,
                              root=bool(inv.root_linears), refused=peft_refused(inv.model_type))
    return Layout(
        linears=linears, roles=roles, hidden=h, q_dim=q_dim, attention_extras=extras, kv_dim=kv_dim, head_dim=head_dim,
        intermediate=mlp_roles["down_proj"].in_features if mlp_roles else None,
        gated=("gate_proj" in mlp_roles or "gate_up_proj" in mlp_roles) if mlp_roles else bool(experts and experts.gated),
        fused_qkv=fused_qkv, fused_gate_up="gate_up_proj" in mlp_roles,
        layer_norms=len(main.norms) - (len(qk) if len(qk) == 2 else 0), qk_norm=len(qk) == 2,
        norm_params_per_layer=sum(n for _, n in main.norms), experts=experts, counts=counts,
        all_linear=None if isinstance(chosen, str) else tuple(chosen),
    )


def _counts(inv: Inventory, found) -> dict[str, int]:
    """Parameters by kind: the inventory's, by where each one sits (:func:`finetuner.model.inventory.kind_of`), with
    linears outside any marked block (OPT's top-level ``fc1``) moved to the kind their role says."""
    from finetuner.model.inventory import kind_of

    c = {k: v for k, v in inv.params.items() if k != "total"}
    for kind, roles, _ in found:
        for role, lin in roles.items():
            if kind_of(lin.name + ".weight") == "other" and not role.startswith("beside:"):
                n = lin.params * kind.count
                c["other"] -= n
                c["attention" if is_attention_role(role) else "mlp"] += n
    c["total"] = inv.params["total"]
    return c


def all_linear_targets(model):
    """``all-linear`` for peft: as it is for a dense model of plain linear layers; else the paths
    :func:`finetuner.model.layout.all_linear_paths` names (a mixture of experts: its attention's linears; never
    a Linear subclass with a forward of its own), what the memory model counts."""
    import re

    import torch

    from finetuner.model.experts4bit import is_mixture_of_experts
    from finetuner.model.inventory import (PARALLEL, is_plain_linear, layer_module_path, layer_modules, peft_renames,
                                           shared_weights)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    layers_path, layers = layer_modules(base, getattr(text, "num_hidden_layers", None))
    if layers_path.endswith(PARALLEL):  # parallel lists: a linear's path in the layer starts with its list's name
        where = (re.escape(layers_path[:-len(PARALLEL)]) + r"\.(" + "|".join(map(re.escape, layers[0].keys()))
                 + r")\.\d+\.(.+)")
    else:
        where = re.escape(layers_path) + r"\.\d+\.()(.+)"
    found, root = [], False
    head = base.get_output_embeddings()
    shared = shared_weights(base)
    for name, mod in base.named_modules():
        if not (isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D") or mod is head:
            continue
        inner = re.fullmatch(where, name)
        if inner:
            found.append((f"{inner[1]}.{inner[2]}" if inner[1] else inner[2],
                          getattr(mod, "out_features", None) or mod.weight.shape[-1],
                          is_plain_linear(mod) and id(mod.weight) not in shared))
        else:
            root = True
    paths = all_linear_paths(found, moe=is_mixture_of_experts(base), renames=peft_renames(str(text.model_type)), root=root,
                             refused=peft_refused(str(getattr(base.config, "model_type", ""))))
    if root and not isinstance(paths, str):  # names alone would also match a vision tower's layers: whole paths
        if layers_path.endswith(PARALLEL):  # each path's list, any index, the rest of its path
            return "|".join(re.escape(layer_module_path(layers_path, "INDEX", p)).replace("INDEX", r"\d+") for p in paths)
        return re.escape(layers_path) + r"\.\d+\.(" + "|".join(re.escape(p) for p in paths) + ")"
    return paths
