"""One part of a Gemma text decoder as a static-shape torch module with the Genie I/O contract.

Numerics follow transformers' Gemma4TextModel (docs/facts.md §1), or Gemma3TextModel where the
geometry's family says how they differ (stages/model/families.py), with the caches turned into graph
inputs and outputs: keys are stored transposed (head_dim x slots) and after RoPE, so a cache slot
never needs re-rotation; KV-shared layers read their donor's whole K/V; the per-layer-embedding
projection runs in the first part; logit softcapping runs in the last. RMSNorm and tanh-GELU use the
fused torch ops, which export to ONNX RMSNormalization (opset 23) and Gelu: quantization and the
HTP both prefer them to the decomposed x^2 / x^3 forms.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from stages.model.contract import (
    INPUTS_EMBEDS,
    LOGITS,
    MASK_NAME,
    PER_LAYER_EMBEDS,
    PER_LAYER_INPUTS,
    GraphSpec,
    cache_kind,
    cache_name,
    hidden_name,
    kvshare_name,
    rope_name,
    sliding_mask_from_full,
)
from stages.model.geometry import FULL, SLIDING, Geometry, Layer


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (1,heads,T,D); cos/sin (1,1,T,D/2) as the graph receives them, broadcast over heads with no
    transpose of a graph input (which would stay float after quantization). HF's rotate_half form."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def matmul_layout(t: torch.Tensor) -> torch.Tensor:
    """A checkpoint weight as the module holds it: float32, and 2-D (linear) weights transposed to
    (in, out), the ONNX MatMul layout, so the exported initializer keeps the checkpoint's tensor name
    instead of becoming a folded anonymous copy (quantization overrides and audits find weights by
    those names). Done once at load time, so a part's weights exist in one copy."""
    t = t.to(torch.float32)
    return t.t().contiguous() if t.dim() == 2 else t


def _param(t: torch.Tensor) -> nn.Parameter:
    """Wraps a weight already in matmul_layout without copying it."""
    return nn.Parameter(t.detach(), requires_grad=False)


def norm_weight(geo: Geometry, name: str, t: torch.Tensor) -> torch.Tensor:
    """An RMSNorm weight as the graph multiplies by it: Gemma 3 stores it minus one (its RMSNorm
    scales by 1 + weight), Gemma 4 as it is. Other tensors pass through."""
    offset = geo.family.norm_offset
    if offset and name.endswith("norm.weight"):
        return t + offset
    return t


def _holder(t: torch.Tensor) -> nn.Module:
    """A module holding one weight, so its parameter (and ONNX initializer) is named `<attr>.weight`."""
    m = nn.Module()
    m.weight = _param(t)
    return m


class DecoderLayer(nn.Module):
    def __init__(self, geo: Geometry, layer: Layer, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.index = layer.index
        self.attention = layer.attention
        self.owns_kv = layer.owns_kv
        self.head_dim = layer.head_dim
        self.n_heads = geo.num_attention_heads
        self.n_kv = geo.num_kv_heads
        self.eps = geo.config.get("rms_norm_eps", 1e-6)
        family = geo.family
        self.layer_scalar_used = family.layer_scalar
        p = f"layers.{layer.index}."
        for t in layer.tensors:
            # Parameter names mirror the checkpoint's, so graph initializers are recognisable.
            *path, attr = t.name.removeprefix(p).split(".")
            owner: nn.Module = self
            for name in path:
                if name not in owner._modules:
                    owner.add_module(name, nn.Module())
                owner = owner._modules[name]
            owner.register_parameter(attr, _param(norm_weight(geo, t.name, weights[t.name])))
        # The attention's score scale folded into the query norm's weight (exact up to float32
        # rounding): the graph keeps Gemma 4's shape, with no extra Mul for the quantizer to place.
        scale = family.attention_scale(geo.config)
        if scale != 1.0:
            self.self_attn.q_norm.weight.data = self.self_attn.q_norm.weight.data * scale
        if self.owns_kv and family.value_norm:
            # Gemma's value norm has no learned scale. Exporting F.rms_norm(weight=None) gives
            # RMSNormalization a scale computed at run time (ones expanded to the input's shape),
            # which QNN's HTP rejects in prefill graphs; a constant (head_dim,) scale it accepts.
            self.register_buffer("v_norm_scale", torch.ones(layer.head_dim), persistent=False)

    def forward(
        self,
        h: torch.Tensor,
        ple: torch.Tensor | None,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """Returns the new hidden state, the attention's whole K/V (for KV-shared layers) and the new
        cache entries (key (1,kv,D,T), value (1,kv,T,D)) for owner layers."""
        t = h.shape[1]
        d, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        attn, mlp = self.self_attn, self.mlp
        x = rms_norm(h, self.input_layernorm.weight, self.eps)
        q = torch.matmul(x, attn.q_proj.weight).view(1, t, nh, d)
        q = apply_rope(rms_norm(q, attn.q_norm.weight, self.eps).transpose(1, 2), cos, sin)  # (1,nh,T,D)
        new_kv = None
        if self.owns_kv:
            k = torch.matmul(x, attn.k_proj.weight).view(1, t, nkv, d)
            k = apply_rope(rms_norm(k, attn.k_norm.weight, self.eps).transpose(1, 2), cos, sin)  # (1,kv,T,D)
            v = torch.matmul(x, attn.v_proj.weight).view(1, t, nkv, d)
            if hasattr(self, "v_norm_scale"):
                v = rms_norm(v, self.v_norm_scale, self.eps)
            new_k = k.transpose(2, 3)  # (1,kv,D,T)
            new_v = v.transpose(1, 2)  # (1,kv,T,D)
            past_k, past_v = cache
            keys = torch.cat((past_k, new_k), dim=-1)
            values = torch.cat((past_v, new_v), dim=-2)
            new_kv = (new_k, new_v)
        else:
            keys, values = shared_kv
        # Query heads are grouped by the KV head they read (HF's repeat_kv order).
        groups = nh // nkv
        qg = q.reshape(1, nkv, groups * t, d)
        scores = torch.matmul(qg, keys).reshape(1, nh, t, -1)  # the scale is in q_norm's weight
        probs = torch.softmax(scores + mask, dim=-1).reshape(1, nkv, groups * t, -1)
        out = torch.matmul(probs, values).reshape(1, nh, t, d).transpose(1, 2).reshape(1, t, nh * d)
        out = torch.matmul(out, attn.o_proj.weight)
        h = h + rms_norm(out, self.post_attention_layernorm.weight, self.eps)

        x = rms_norm(h, self.pre_feedforward_layernorm.weight, self.eps)
        x = torch.matmul(
            F.gelu(torch.matmul(x, mlp.gate_proj.weight), approximate="tanh")
            * torch.matmul(x, mlp.up_proj.weight),
            mlp.down_proj.weight,
        )
        h = h + rms_norm(x, self.post_feedforward_layernorm.weight, self.eps)

        if ple is not None:
            g = F.gelu(torch.matmul(h, self.per_layer_input_gate.weight), approximate="tanh") * ple
            g = torch.matmul(g, self.per_layer_projection.weight)
            h = h + rms_norm(g, self.post_per_layer_input_norm.weight, self.eps)
        if self.layer_scalar_used:
            h = h * self.layer_scalar
        return h, (keys, values), new_kv


class DecoderPart(nn.Module):
    """The graph `spec` describes. forward() takes the spec's inputs in order, returns its outputs.
    `weights` maps checkpoint names to tensors in matmul_layout()."""

    def __init__(self, geo: Geometry, spec: GraphSpec, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.geo = geo
        self.spec = spec
        self.eps = geo.config.get("rms_norm_eps", 1e-6)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(geo, geo.layers[i], weights) for i in spec.layers})
        if spec.is_first and geo.ple_dim:
            self.per_layer_model_projection = _holder(weights["per_layer_model_projection.weight"])
            self.per_layer_projection_norm = _holder(weights["per_layer_projection_norm.weight"])
        if spec.is_last:
            self.norm = _holder(norm_weight(geo, "norm.weight", weights["norm.weight"]))
            # An explicit, untied copy: quantization must see the lm_head as a weight (docs/facts.md §5).
            self.lm_head = _holder(weights["embed_tokens.weight"])
        self.softcap = geo.config.get("final_logit_softcapping")

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec, geo = self.spec, self.geo
        x = {s.name: v for s, v in zip(spec.inputs, inputs, strict=True)}
        out: dict[str, torch.Tensor] = {}
        if spec.is_first:
            h = x[INPUTS_EMBEDS]
            ple = None
            if geo.ple_dim:
                proj = torch.matmul(h, self.per_layer_model_projection.weight) * (geo.hidden_size**-0.5)
                proj = rms_norm(
                    proj.reshape(1, h.shape[1], geo.num_layers, geo.ple_dim),
                    self.per_layer_projection_norm.weight,
                    self.eps,
                )
                ple = (proj + x[PER_LAYER_INPUTS]) * (2.0**-0.5)
                if PER_LAYER_EMBEDS in {o.name for o in spec.outputs}:
                    out[PER_LAYER_EMBEDS] = ple
        else:
            h = x[hidden_name(spec.layers[0])]
            ple = x.get(PER_LAYER_EMBEDS)

        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for donor in {geo.layers[i].kv_donor for i in spec.layers}:
            if kvshare_name(donor, "key") in x:  # a donor in an earlier part
                shared[donor] = (x[kvshare_name(donor, "key")], x[kvshare_name(donor, "value")])
        n_kv = geo.num_kv_heads
        masks = {kind: x[name] for kind, name in MASK_NAME.items() if name in x}
        if SLIDING not in masks and any(geo.layers[i].attention == SLIDING for i in spec.layers):
            # Sliding layers in the full cache group (contract.window_cache): the window in the graph.
            masks[SLIDING] = sliding_mask_from_full(masks[FULL], geo.sliding_window)
        for i in spec.layers:
            layer = self.layers[str(i)]
            mask = masks[layer.attention]
            cos, sin = x[rope_name(layer.attention, "cos")], x[rope_name(layer.attention, "sin")]
            kind = cache_kind(geo, layer.attention)
            cache = None
            if layer.owns_kv:
                names = [cache_name(i, kind, w, hd, "in") for w in ("key", "value") for hd in range(n_kv)]
                cache = (
                    torch.cat([x[n] for n in names[:n_kv]], dim=1),
                    torch.cat([x[n] for n in names[n_kv:]], dim=1),
                )
            donor = geo.layers[i].kv_donor
            h, kv, new = layer(
                h, ple[:, :, i, :] if ple is not None else None, mask, cos, sin, cache, shared.get(donor)
            )
            if layer.owns_kv:
                shared[i] = kv
                for hd in range(n_kv):
                    out[cache_name(i, kind, "key", hd, "out")] = new[0][:, hd : hd + 1]
                    out[cache_name(i, kind, "value", hd, "out")] = new[1][:, hd : hd + 1]
            if kvshare_name(i, "key") in {o.name for o in spec.outputs}:
                out[kvshare_name(i, "key")], out[kvshare_name(i, "value")] = kv

        if spec.is_last:
            logits = torch.matmul(rms_norm(h, self.norm.weight, self.eps), self.lm_head.weight)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            out[LOGITS] = logits
        else:
            out[hidden_name(spec.layers[-1] + 1)] = h
        return tuple(out[o.name] for o in spec.outputs)


def part_weight_names(geo: Geometry, spec: GraphSpec) -> list[str]:
    """The checkpoint tensors (relative to the language model) one part needs."""
    names = [t.name for i in spec.layers for t in geo.layers[i].tensors]
    if spec.is_first:
        names += [t.name for t in geo.ple_projection]
    if spec.is_last:
        names += [geo.final_norm.name, geo.embedding.name]
    return names
