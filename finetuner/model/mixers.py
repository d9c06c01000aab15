"""A model's token mixers, read from its shape: how many layers hold softmax attention, and the linear-attention
(Gated DeltaNet), state-space (Mamba, Mamba-2) and short-convolution (LFM2) layers with their widths.

Facts of the model, so they live with its shapes: the speed model (:mod:`finetuner.planning.scans`) counts these
layers' work from them, the memory model (:mod:`finetuner.memory.grpo`) the state their generation keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetuner.model.shapes import ModelShape

#: Mamba-2's chunk where the config does not say (``Mamba2Config``'s default)
MAMBA2_CHUNK = 256


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k)), default)


@dataclass(frozen=True)
class Mixers:
    """One model's non-attention token mixers: how many layers of each kind and their widths."""

    delta_layers: int = 0  # Gated DeltaNet
    delta_heads: int = 0
    delta_dk: int = 0
    delta_dv: int = 0
    delta_conv_channels: int = 0
    mamba2_layers: int = 0
    mamba2_heads: int = 0
    mamba2_head_dim: int = 0
    mamba2_state: int = 0
    mamba2_chunk: int = MAMBA2_CHUNK
    mamba2_groups: int = 1  # B and C's groups (n_groups), their width in the convolution
    mamba_layers: int = 0  # Mamba-1's sequential scan
    mamba_inner: int = 0
    mamba_state: int = 0
    conv_kernel: int = 4
    #: layers whose mixer is only a short convolution (LFM2), its channels
    conv_layers: int = 0
    conv_channels: int = 0

    @property
    def any(self) -> bool:
        return bool(self.delta_layers or self.mamba2_layers or self.mamba_layers or self.conv_layers)


def attention_layers(shape: ModelShape) -> int:
    """Decoder layers with softmax attention: those that hold the q (or fused qkv) projection; every layer of a
    written layout; none of a pure Mamba."""
    if not shape.q_dim:
        return 0
    paths = {p for role, p in shape.roles if role in ("q_proj", "qkv_proj")}
    held = [lin.layers for lin in shape.layer_linears() if lin.name in paths]
    if not held or any(not ix for ix in held):
        return shape.num_layers
    return len({i for ix in held for i in ix})


def mixers(shape: ModelShape) -> Mixers:
    """The model's linear-attention and state-space layers, their widths read from its mixer linears and its
    config (the keys each family names them by)."""
    from finetuner.model.inventory import language_config

    cfg, _ = language_config(shape.config) if shape.config else ({}, None)
    found: dict[str, Any] = {}
    if shape.linear_attention_layers:
        heads = int(_first(cfg, "linear_num_value_heads", default=0))
        dk, dv = int(_first(cfg, "linear_key_head_dim", default=0)), int(_first(cfg, "linear_value_head_dim", default=0))
        k_heads = int(_first(cfg, "linear_num_key_heads", default=heads))
        found |= dict(delta_layers=shape.linear_attention_layers, delta_heads=heads, delta_dk=dk, delta_dv=dv,
                      delta_conv_channels=2 * k_heads * dk + heads * dv,
                      conv_kernel=int(_first(cfg, "linear_conv_kernel_dim", default=4)))
    if shape.mixer_layers:
        paths = {p for role, p in shape.roles if role == "mixer"}
        by_short = {lin.short_name: lin for lin in shape.layer_linears() if lin.name in paths}
        kernel = int(_first(cfg, "conv_kernel", "mamba_d_conv", "conv_L_cache", default=4))
        if "dt_proj" in by_short and "x_proj" in by_short:  # Mamba-1: x_proj gives dt's rank, B and C
            inner, dt_rank = by_short["dt_proj"].out_features, by_short["dt_proj"].in_features
            found |= dict(mamba_layers=shape.mixer_layers, mamba_inner=inner,
                          mamba_state=(by_short["x_proj"].out_features - dt_rank) // 2, conv_kernel=kernel)
        elif _first(cfg, "mamba_n_heads", "mamba_num_heads", "num_heads") and "out_proj" in by_short and \
                _first(cfg, "mamba_d_state", "ssm_state_size", "state_size"):
            heads = int(_first(cfg, "mamba_n_heads", "mamba_num_heads", "num_heads"))
            inner = by_short["out_proj"].in_features
            found |= dict(mamba2_layers=shape.mixer_layers, mamba2_heads=heads, mamba2_head_dim=inner // heads,
                          mamba2_state=int(_first(cfg, "mamba_d_state", "ssm_state_size", "state_size")),
                          mamba2_chunk=int(_first(cfg, "mamba_chunk_size", "chunk_size", default=MAMBA2_CHUNK)),
                          mamba2_groups=int(_first(cfg, "mamba_n_groups", "n_groups", default=1)),
                          conv_kernel=kernel)
        else:  # a short convolution (LFM2): in_proj makes B, C and x, the convolution runs over x
            first = next(iter(by_short.values()))
            found |= dict(conv_layers=shape.mixer_layers, conv_channels=first.in_features, conv_kernel=kernel)
    return Mixers(**found)


def recurrent_state_numel(shape: ModelShape) -> int:
    """Elements of the state one sequence's generation keeps in place of a KV cache, all layers (the same at any
    length): a Gated DeltaNet layer its convolution's last ``K`` inputs (``2 key heads dk + H dv`` channels) and its
    ``H x dk x dv`` state; a Mamba-2 mixer its convolution's (``H P + 2 G N`` channels: x, B and C) and its
    ``H x P x N`` state; a Mamba-1 mixer ``d x K`` and ``d x N``; LFM2's short convolution its last ``K`` inputs
    (transformers' ``LinearAttentionLayer`` and ``MambaCache``'s ``conv_states`` and ``recurrent_states``/
    ``ssm_states``)."""
    m = mixers(shape)
    K = m.conv_kernel
    delta = m.delta_conv_channels * K + m.delta_heads * m.delta_dk * m.delta_dv
    H, P, N = m.mamba2_heads, m.mamba2_head_dim, m.mamba2_state
    mamba2 = (H * P + 2 * m.mamba2_groups * N) * K + H * P * N
    mamba = m.mamba_inner * (K + m.mamba_state)
    return (m.delta_layers * delta + m.mamba2_layers * mamba2 + m.mamba_layers * mamba
            + m.conv_layers * m.conv_channels * K)
