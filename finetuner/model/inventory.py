"""A model read from itself: built on the meta device from its ``config.json``, its modules listed.

transformers knows every architecture it builds. Instead of a layout written by hand per family, this module
builds the causal LM (or the language model of an image-text-to-text checkpoint) on the ``meta`` device, where
no weight takes memory, and lists what the memory model needs: the embeddings, the decoder layers and the
linear layers in each (what LoRA can target), fused expert weights (3-D parameters), routers, norms, the
output layer and whether it is tied to the embeddings. Layers that differ from the others (the dense first
layers of a mixture of experts, the state-space layers of a hybrid) are listed as kinds of their own.

Building needs torch and transformers (some 10 s of imports); :mod:`finetuner.model.reading` adds the layer's
trace and caches the result (and ships the presets' read already).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from finetuner.errors import UserError, first_line

#: bump when what :func:`finetuner.model.reading.read_inventory` stores changes
FORMAT_VERSION = 11
#: module class names that are normalisation layers (RMSNorm, LayerNorm and their family variants)
_NORM_MARKS = ("norm",)
#: where an attention block lives inside a decoder layer, by the names transformers gives it
_ATTENTION_MARKS = ("self_attn", "attention", "attn")
#: where a feed-forward block lives inside a decoder layer
_MLP_MARKS = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")


@dataclass(frozen=True)
class LayerLinear:
    """A linear layer inside a decoder layer: its path in the layer, its widths and whether it has a bias."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    #: a plain linear layer (torch's ``Linear.forward`` or GPT-2's ``Conv1D``); False for a Linear subclass with a
    #: forward of its own (DeepSeek-V4's grouped o_a_proj), which LoRA cannot wrap, and for a linear whose weight
    #: another module shares (:func:`shared_weights`)
    plain: bool = True

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class LayerKind:
    """Decoder layers that hold the same modules (``count`` of them, at ``indices``)."""

    linears: tuple[LayerLinear, ...]
    #: 3-D (or larger) parameters: fused expert weights, as ``(path in the layer, shape)``
    experts: tuple[tuple[str, tuple[int, ...]], ...]
    #: normalisation layers as ``(path in the layer, parameters)``, also those with no parameters (OLMo's)
    norms: tuple[tuple[str, int], ...]
    #: parameters in no linear layer, expert tensor, norm or router (a state-space layer's A and D, a learned
    #: activation's scale ...)
    other_params: int
    indices: tuple[int, ...]
    module: str  # the layer's class name
    #: a mixture of experts' router parameters that are no torch Linear (``mlp.gate.weight`` of a top-k router)
    router_params: int = 0
    #: of ``other_params``, those of the layer's convolutions (a short convolution's kernel: frozen under LoRA,
    #: its activations traced with the layer); 0 in inventories read before it was counted
    conv_params: int = 0

    @property
    def count(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class Inventory:
    """What a causal LM holds, read from the model transformers builds for its config."""

    model_type: str
    architecture: str  # the class transformers builds (``LlamaForCausalLM``)
    num_layers: int
    hidden_size: int  # the embeddings' width
    vocab_size: int
    kinds: tuple[LayerKind, ...]
    #: parameters by kind: embeddings, attention, mlp, experts, router, norms, lm_head, other; and total
    params: dict[str, int] = field(default_factory=dict)
    tied: bool = False
    #: the config of the language model that was built (an image-text-to-text config's ``text_config``)
    text_only_of: str | None = None
    #: where the decoder layers sit in the model (``model.layers``; GPT-2's ``transformer.h``)
    layers_path: str = "model.layers"
    #: linear layers outside the decoder layers but the output layer (OPT-350m's project_in and project_out)
    root_linears: tuple[str, ...] = ()
    #: the language model's config as transformers completed it (its defaults for what config.json leaves out:
    #: Gemma-3-4B's published config names no head count), scalars and lists only
    resolved: dict[str, Any] = field(default_factory=dict)
    #: peft turns LoRA targets named like transformers 4's expert linears into LoRA on the fused experts for
    #: this family (:func:`peft_renames`)
    peft_renames: bool = False
    #: what the first decoder layer saves for backward, traced (:func:`finetuner.model.trace.trace_layer`) as
    #: ``(constant, per_token, per_token2)`` bytes; None when it cannot be traced (``trace_note`` says why)
    trace: tuple[float, float, float] | None = None
    trace_note: str | None = None

    @property
    def uniform(self) -> bool:
        """Every decoder layer holds the same modules."""
        return len(self.kinds) == 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Inventory:  # noqa: D102
        kinds = tuple(
            LayerKind(
                linears=tuple(LayerLinear(**lin) for lin in k["linears"]),
                experts=tuple((n, tuple(s)) for n, s in k["experts"]),
                norms=tuple((n, c) for n, c in k["norms"]),
                other_params=k["other_params"],
                indices=tuple(k["indices"]),
                module=k["module"],
                router_params=k.get("router_params", 0),
                conv_params=k.get("conv_params", 0),
            )
            for k in d["kinds"]
        )
        trace = tuple(d["trace"]) if d.get("trace") is not None else None
        return cls(**{**d, "kinds": kinds, "root_linears": tuple(d.get("root_linears", ())), "trace": trace})


def language_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The config of the model to fine-tune on text: ``cfg`` itself, or the ``text_config`` of an
    image-text-to-text checkpoint (with the outer ``model_type`` it came from)."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in cfg:
        inner = dict(text)
        if "model_type" not in inner:
            raise UserError(f"config.json of model_type {cfg.get('model_type')!r}: its text_config names no model_type.")
        if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in inner:
            inner["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        return inner, str(cfg.get("model_type"))
    return cfg, None


def auto_class(model_type: str):
    """The auto class that builds a whole model of ``model_type``: ``AutoModelForCausalLM``, or for an image-text
    type with no causal LM class (LLaVA, Qwen2.5-VL ...) ``AutoModelForImageTextToText``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return causal_lm_auto(model_type)


def causal_lm_auto(model_type: str | None):
    """``AutoModelForCausalLM``, able to build ``model_type`` (a ``config.json``'s) where transformers maps its causal
    LM under the outer type only: Emu3's and Mllama's causal LM (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["emu3"]``) is
    built on the text config alone and saves ``model_type`` ``emu3_text_model``, which the mapping lacks, so
    transformers could not load its own checkpoint back. Such a text config is registered to the causal LM class of
    its own module whose config class it is (that module alone imported)."""
    import importlib

    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        for outer, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
            if model_type_to_module_name(outer) != module:
                continue
            model_class = getattr(importlib.import_module(f"transformers.models.{module}"), class_name, None)
            config_class = getattr(model_class, "config_class", None)
            if getattr(config_class, "model_type", None) == model_type:
                AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    return AutoModelForCausalLM


def transformers_config(cfg: dict[str, Any]):
    """The installed transformers' config object for ``cfg`` (a ``config.json`` dict, its ``_`` keys left out); a
    one-line UserError when it names no model type or one this transformers does not know. ``cfg`` stays as read:
    transformers completes nested settings in place (Llama 3.1's rope_scaling), and a config keys the caches
    (finetuner.model.reading) and the shipped inventories, so it is given a copy all the way down."""
    from transformers import AutoConfig

    settings = special_floats(copy.deepcopy({k: v for k, v in cfg.items() if not k.startswith("_")}))
    mt = settings.pop("model_type", None)
    if not mt:
        raise UserError("config.json names no model_type: transformers cannot tell which model to build.")
    try:
        return AutoConfig.for_model(mt, **settings)
    except (KeyError, ValueError) as e:
        raise UserError(f"model_type {mt!r}: this transformers does not know it ({first_line(str(e))}).",
                        hint="Upgrade transformers, or give a model whose config.json names a model_type it knows.") from None


#: how ``save_pretrained`` writes the floats JSON has no number for (Mamba-2's ``time_step_limit`` of
#: ``[0.0, inf]``), as transformers' own ``from_pretrained`` reads them back
SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def special_floats(value: Any) -> Any:
    """``value`` (read from a ``config.json``) with each ``{"__float__": "Infinity"}`` turned into its float."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[value["__float__"]]
        return {k: special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [special_floats(v) for v in value]
    return value


def build_on_meta(cfg: dict[str, Any]):
    """The causal LM transformers builds for ``cfg`` (a ``config.json`` dict), on the meta device; for an
    image-text-to-text checkpoint with no causal LM class (LLaVA, Qwen2.5-VL ...), its image-text-to-text model."""
    import torch

    from finetuner.quiet import quieted

    config = transformers_config(cfg)
    mt = cfg["model_type"]  # (its own spelling: a config class may name an alias)
    auto = auto_class(mt)
    try:
        with quieted(), torch.device("meta"):
            return auto.from_config(config)
    except ValueError as e:  # no causal LM for this config class
        raise UserError(f"model_type {mt!r}: transformers builds no causal LM for it ({first_line(str(e))}).") from None
    except Exception as e:  # noqa: BLE001 - a config transformers itself cannot build (a missing field, a package)
        raise UserError(f"model_type {mt!r}: transformers cannot build this config "
                        f"({type(e).__name__}: {first_line(str(e))}).") from None


def decoder_layers(model, num_layers: int | None):
    """The ``ModuleList`` of decoder layers and its path: of the lists ``num_hidden_layers`` long (else the longest
    ones), the one beside the input embeddings (an image-text-to-text model's vision tower has layers too)."""
    import torch

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    home = next((n.rsplit(".", 1)[0] if "." in n else "" for n, m in model.named_modules() if m is emb), None)
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise UserError(f"{type(model).__name__}: no list of decoder layers found.")
    exact = [x for x in lists if num_layers and len(x[1]) == num_layers]
    longest = max(len(m) for _, m in lists)
    candidates = exact or [x for x in lists if len(x[1]) == longest]
    return next((x for x in candidates if (x[0].rsplit(".", 1)[0] if "." in x[0] else "") == home), candidates[0])


#: the end of :attr:`Inventory.layers_path` where the decoder layers are parallel lists (:func:`layer_modules`)
PARALLEL = ".*"


def layer_modules(model, num_layers: int | None) -> tuple[str, list]:
    """The decoder layers and their path (:func:`decoder_layers`). A model whose layers are parallel lists, one per
    part (XLM: ``transformer.attentions``, ``layer_norm1``, ``ffns``, ``layer_norm2``; the list found holds attention
    blocks, not whole layers), gets each layer as one module of its parts, by their lists' names
    (``attentions.q_lin``, ``ffns.lin1``), and the path ``<parent>.*`` (:func:`layer_module_path`)."""
    import torch

    path, layers = decoder_layers(model, num_layers)
    parent, _, own = path.rpartition(".")
    if "attention" not in type(layers[0]).__name__.lower():
        return path, list(layers)
    home = model.get_submodule(parent) if parent else model
    lists = {n: m for n, m in home.named_children() if isinstance(m, torch.nn.ModuleList) and len(m) == len(layers)}
    if len(lists) < 2:
        return path, list(layers)
    return parent + PARALLEL, [torch.nn.ModuleDict({n: m[i] for n, m in lists.items()}) for i in range(len(layers))]


def layer_module_path(layers_path: str, i: int | str, name: str) -> str:
    """The whole path of the module at ``name`` in decoder layer ``i`` (``model.layers.3.self_attn.q_proj``; in
    parallel lists, :func:`layer_modules`, ``transformer.attentions.3.q_lin``)."""
    if not layers_path.endswith(PARALLEL):
        return f"{layers_path}.{i}.{name}"
    part, _, rest = name.partition(".")
    return f"{layers_path[:-len(PARALLEL)]}.{part}.{i}" + (f".{rest}" if rest else "")


def _is_norm(module) -> bool:
    return any(m in type(module).__name__.lower() for m in _NORM_MARKS)


def _resolved(config) -> dict[str, Any]:
    """The text config's settings transformers built the model with (JSON-able values only)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kept = {k: v for k, v in text.to_dict().items()
            if not k.startswith("_") and k not in ("id2label", "label2id")
            and isinstance(v, (int, float, str, bool, type(None), list, dict)) and len(json.dumps(v, default=str)) < 10_000}
    return json.loads(json.dumps(kept, default=str))  # as the cache gives it back


def _stack_settings(model, layers_path: str) -> dict[str, Any]:
    """The settings of the module that holds the decoder layers, where it has a config of its own: BLT's stacks (its
    local encoder's ``encoder_config``: the heads and widths its layers were built with; the top config has none).
    Empty where that module shares the model's config (every single-stack family)."""
    from transformers import PreTrainedConfig

    holder = model.get_submodule(layers_path.rsplit(".", 1)[0]) if "." in layers_path else model
    own = getattr(holder, "config", None)
    if not isinstance(own, PreTrainedConfig) or own is model.config or own is model.config.get_text_config():
        return {}
    return _resolved(own)


def peft_renames(model_type: str) -> bool:
    """peft (0.18+) carries adapters trained under transformers 4 over to a mixture of experts whose per-expert
    linears transformers 5 fused: for such a family (transformers converts its checkpoints' ``experts.*.gate_proj``
    or ``experts.*.w1`` into ``experts.gate_up_proj``) it turns every LoRA target named ``gate``, ``w1``-``w3``,
    ``gate_proj``, ``up_proj`` or ``down_proj`` into LoRA on the fused experts, wherever the module is (an
    attention's output gate, a dense MLP, shared experts). True for those families."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    for conversion in get_checkpoint_conversion_mapping(model_type) or ():
        sources = getattr(conversion, "source_patterns", None) or ()
        if any("experts" in src and (".gate_proj." in src or ".w1." in src) for src in sources):
            return True
    return False


def is_plain_linear(module) -> bool:
    """A linear layer LoRA can wrap: torch's ``Linear`` (its forward, or a subclass's that holds no settings of
    its own: Falcon's ``FalconLinear``), a bitsandbytes layer, GPT-2's ``Conv1D``; not a subclass whose forward
    uses its weight its own way by settings of its own (DeepSeek-V4's grouped ``o_a_proj`` and its ``n_groups``)."""
    import torch

    kind = type(module)
    if kind.__name__ == "Conv1D" or kind.forward is torch.nn.Linear.forward or kind.__module__.startswith("bitsandbytes"):
        return True
    return not {k for k in set(vars(module)) - set(vars(torch.nn.Linear(1, 1, device="meta"))) if not k.startswith("_")}


def _linear_widths(module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a torch Linear or of GPT-2's ``Conv1D`` (a linear layer with its
    weight stored transposed, which peft's LoRA and bitsandbytes treat as one), else None."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def shared_weights(model) -> set[int]:
    """The ids of the linear weights that more than one module holds: Zamba2's shared transformer block, one
    weight called from several layers through a module of each. peft would put a LoRA on each module, which no
    single merged weight can hold (the merge adds both to the one weight): these linears are left out of
    ``all-linear`` and counted frozen."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if w is not None and _linear_widths(mod) is not None:
            seen[id(w)] = seen.get(id(w), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def _layer_kind_key(layer, shared: set[int] = frozenset()) -> tuple:
    import torch

    linears, experts, norms, other, router, conv = [], [], [], 0, 0, 0
    seen: set[int] = set()
    for mname, mod in layer.named_modules():
        widths = _linear_widths(mod)
        if isinstance(mod, torch.nn.modules.conv._ConvNd):  # a state-space layer's short convolution: not experts
            conv += sum(p.numel() for p in mod.parameters(recurse=False))
            seen.update(id(p) for p in mod.parameters(recurse=False))
        elif widths is not None:
            linears.append(LayerLinear(mname, widths[0], widths[1], getattr(mod, "bias", None) is not None,
                                       is_plain_linear(mod) and id(mod.weight) not in shared))
            seen.update(id(p) for p in mod.parameters(recurse=False))
        elif _is_norm(mod) and mname:
            own = [p for p in mod.parameters(recurse=False)]
            norms.append((mname, sum(p.numel() for p in own)))
            seen.update(id(p) for p in own)
    for pname, p in layer.named_parameters():
        if id(p) in seen:
            continue
        if _is_expert_tensor(pname, p):
            experts.append((pname, tuple(p.shape)))
        elif kind_of(pname) == "router":
            router += p.numel()
        else:
            other += p.numel()
    return tuple(linears), tuple(experts), tuple(norms), other + conv, type(layer).__name__, router, conv


def _is_expert_tensor(path: str, p) -> bool:
    """Fused expert weights: a parameter of 3 or more dimensions inside an ``experts`` module (RWKV's and
    XLNet's 3-D parameters are not experts)."""
    return p.dim() >= 3 and "experts" in path.split(".")[:-1]


def kind_of(path: str) -> str:
    """The memory model's kind of a parameter at ``path`` inside a decoder layer: a mixture of experts' router
    is the module named ``router`` or ``gate`` (dense MLPs name theirs ``gate_proj``)."""
    parts = path.split(".")[:-1]
    if any(p in ("router", "gate") for p in parts):
        return "router"
    if any(p in ("experts", "shared_expert", "shared_experts") for p in parts):
        return "experts"
    if any(p.startswith(m) for p in parts for m in _ATTENTION_MARKS):
        return "attention"
    if any(p in _MLP_MARKS for p in parts):
        return "mlp"
    return "other"


def _count(model, layers_path: str, layers: list) -> tuple[dict[str, int], bool]:
    """Parameters by kind (tied weights once) and whether the output layer is tied to the embeddings. The language
    model's other embedding tables beside its decoder layers are embeddings too: Gemma 3n/4's per-layer input table
    (``embed_tokens_per_layer``: vocabulary x per-layer width x layers, on the device with the rest, as
    transformers places it)."""
    import torch

    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    tied = out is not None and emb is not None and out.weight is emb.weight
    norm_params = {id(p) for m in model.modules() if _is_norm(m) for p in m.parameters(recurse=False)}
    conv_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)
                   for p in m.parameters(recurse=False)}
    counts = dict.fromkeys(("embeddings", "attention", "mlp", "experts", "router", "norms", "lm_head", "other"), 0)
    # the layers' paths: ``model.layers.``, or in parallel lists (:func:`layer_modules`) each list's, ``transformer.ffns.``
    prefixes = ([layers_path[:-len(PARALLEL)] + f".{part}." for part in layers[0]] if layers_path.endswith(PARALLEL)
                else [layers_path + "."])
    home = layers_path.rsplit(".", 1)[0] + "." if "." in layers_path else ""  # the language model's own modules
    tables = {id(m.weight) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Embedding) and n.startswith(home) and not n.startswith(tuple(prefixes))}
    for name, p in model.named_parameters():  # each shared parameter once
        if (emb is not None and p is emb.weight) or id(p) in tables:
            kind = "embeddings"
        elif out is not None and p is out.weight:
            kind = "lm_head"
        elif id(p) in norm_params and name.startswith(home):  # (a vision tower's norms are its other weights)
            kind = "norms"
        elif name.startswith(tuple(prefixes)):
            prefix = next(x for x in prefixes if name.startswith(x))
            inner = name[len(prefix):].split(".", 1)[-1]  # the path after the layer's index
            if len(prefixes) > 1:  # in parallel lists: its list's name first, as the layer names it
                inner = f"{prefix.split('.')[-2]}.{inner}"
            kind = "other" if id(p) in conv_params else "experts" if _is_expert_tensor(inner, p) else kind_of(inner)
        else:
            kind = "other"
        counts[kind] += p.numel()
    counts["total"] = sum(counts.values())
    return counts, tied


def inventory_of(cfg: dict[str, Any]) -> Inventory:
    """Build the causal LM transformers builds for ``cfg`` on meta and list it (no trace and no cache:
    :func:`finetuner.model.reading.read_inventory` adds both). For an image-text-to-text checkpoint that is what training loads: the language model with its vision
    tower and projector beside it (their parameters are ``other``, their linears :attr:`Inventory.root_linears`)."""
    text_cfg, outer = language_config(cfg)
    model = build_on_meta(cfg if outer else text_cfg)
    layers_path, layers = layer_modules(model, text_cfg.get("num_hidden_layers"))
    groups: dict[tuple, list[int]] = {}
    shared = shared_weights(model)
    for i, layer in enumerate(layers):
        groups.setdefault(_layer_kind_key(layer, shared), []).append(i)
    kinds = tuple(LayerKind(linears=k[0], experts=k[1], norms=k[2], other_params=k[3], indices=tuple(ix), module=k[4],
                            conv_params=k[6],
                            router_params=k[5])
                  for k, ix in groups.items())
    params, tied = _count(model, layers_path, layers)
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    emb = model.get_input_embeddings()
    return Inventory(
        model_type=str(text_cfg.get("model_type")),
        architecture=type(model).__name__,
        num_layers=len(layers),
        hidden_size=int(emb.embedding_dim) if emb is not None else int(text_cfg.get("hidden_size") or 0),
        vocab_size=int(emb.num_embeddings) if emb is not None else int(text_cfg.get("vocab_size") or 0),
        kinds=kinds,
        params=params,
        tied=tied,
        text_only_of=outer,
        layers_path=layers_path,
        peft_renames=peft_renames(str(text_cfg.get("model_type"))),
        resolved={**_resolved(model.config), **_stack_settings(model, layers_path)},
        root_linears=tuple(n for n, m in model.named_modules()
                           if _linear_widths(m) is not None and id(m) not in in_layers
                           and m is not model.get_output_embeddings()),
    )
