"""The model families this pipeline builds, and everything in which one differs from another.

A family is recognized from a checkpoint's config.json (`model_type`, or `text_config.model_type` of a
multimodal save), never from the model's name. Every stage that depends on the architecture reads the
family's row here: the geometry (which tensors a layer has, the default attention pattern, how the
config is normalised), the torch decoder (norm convention, attention scale, value norm, layer scalar)
and the reference (transformers' class). Both families share the rest: sliding + global attention with
a RoPE base each, q/k RMSNorm, sandwich norms, GeGLU with tanh-GELU, a tied embedding scaled by
sqrt(hidden) on lookup.

A new family (Gemma 3 1B/4B share gemma3_text; E4B shares gemma4_text) is a row in FAMILIES, plus a
`normalise` function when its config.json spells things its own way. Stdlib only: the plan reads it
before any image exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.core.errors import UserFixable

SLIDING = "sliding_attention"
FULL = "full_attention"


class FamilyError(UserFixable, ValueError):
    pass


@dataclass(frozen=True)
class Family:
    name: str  # what reports and messages say
    model_types: tuple[str, ...]  # config.json model_type values: the multimodal save's, the text one's
    causal_lm: str  # transformers' text-only class, the reference
    text_config_class: str
    # RMSNorm scales by (norm_offset + weight): Gemma 3 stores the weight minus one (zeros at init).
    norm_offset: float
    # Gemma 4 normalises V with an RMSNorm without a learned scale; Gemma 3 leaves V alone.
    value_norm: bool
    # Gemma 4 multiplies each layer's output by a stored scalar (`layers.N.layer_scalar`).
    layer_scalar: bool
    # transformers' Gemma 4 turns the last layer into a full-attention one whatever the config says;
    # its Gemma 3 keeps the config's pattern.
    last_layer_full: bool
    # The attention pattern when a config lists no layer_types: every n-th layer is full attention.
    full_every: int
    # The dot-product scale of the attention scores, from the text config.
    attention_scale: Callable[[dict[str, Any]], float]
    # The text config in the one form the other stages read (rope_parameters per layer type,
    # global_head_dim, num_kv_shared_layers, hidden_size_per_layer_input), or a FamilyError naming
    # what this pipeline does not build.
    normalise: Callable[[dict[str, Any]], dict[str, Any]]
    example: str  # a checkpoint of the family, for messages
    # The token an instruction-tuned model ends its turn with (a stop token beside the config's EOS).
    end_of_turn: str


def _gemma4_normalise(cfg: dict[str, Any]) -> dict[str, Any]:
    # Gemma 4's own config is the normalised form; its refusals live in the geometry, which reads the
    # per-layer overrides.
    return dict(cfg)


def _rope_of(params: dict[str, Any], where: str) -> dict[str, Any]:
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        # Gemma 3 4B+ scale their global RoPE ("linear", factor 8); Genie's positional-encoding has no
        # such scaling, so the graphs' tables and the phone's would disagree.
        raise FamilyError(
            f"the {where} RoPE is of type {rope_type!r}; this pipeline builds Gemma 3 with plain RoPE only "
            "(270M, 1B)"
        )
    return {"rope_type": "default", "rope_theta": float(params["rope_theta"])}


def _gemma3_normalise(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 saves `rope_parameters` per layer type; Google's published configs (transformers
    4) give `rope_theta`, `rope_local_base_freq` and `rope_scaling`. Read both, as Gemma3TextConfig's
    convert_rope_params_to_dict does."""
    for key in ("attn_logit_softcapping",):
        if cfg.get(key):
            raise FamilyError(f"{key} is {cfg[key]}; this pipeline's attention has no softcapping")
    if cfg.get("use_bidirectional_attention"):
        raise FamilyError("use_bidirectional_attention is set: not a causal language model")
    rope = {k: dict(v) for k, v in (cfg.get("rope_parameters") or {}).items() if v}
    full = rope.get(FULL, {"rope_type": "default"})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    sliding = rope.get(SLIDING, {"rope_type": "default"})
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    # transformers 4 wrote the pattern as `sliding_window_pattern`, later as `_sliding_window_pattern`.
    every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    dropped = (
        "rope_scaling",
        "rope_theta",
        "rope_local_base_freq",
        "sliding_window_pattern",
        "_sliding_window_pattern",
    )
    out = {k: v for k, v in cfg.items() if k not in dropped}
    out.update(
        rope_parameters={FULL: _rope_of(full, "global"), SLIDING: _rope_of(sliding, "sliding")},
        # One head size for both kinds of layer, no KV sharing, no per-layer embeddings.
        global_head_dim=cfg.get("head_dim"),
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )
    if every and not cfg.get("layer_types"):
        n = cfg.get("num_hidden_layers") or 0
        out["layer_types"] = [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
    return out


FAMILIES: tuple[Family, ...] = (
    Family(
        name="Gemma 4",
        model_types=("gemma4", "gemma4_text"),
        causal_lm="Gemma4ForCausalLM",
        text_config_class="Gemma4TextConfig",
        norm_offset=0.0,
        value_norm=True,
        layer_scalar=True,
        last_layer_full=True,
        full_every=6,
        attention_scale=lambda cfg: 1.0,  # q_norm and k_norm already fix the scores' scale
        normalise=_gemma4_normalise,
        example="google/gemma-4-E2B-it",
        end_of_turn="<turn|>",
    ),
    Family(
        name="Gemma 3",
        model_types=("gemma3", "gemma3_text"),
        causal_lm="Gemma3ForCausalLM",
        text_config_class="Gemma3TextConfig",
        norm_offset=1.0,
        value_norm=False,
        layer_scalar=False,
        last_layer_full=False,
        full_every=6,
        attention_scale=lambda cfg: float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]) ** -0.5,
        normalise=_gemma3_normalise,
        example="google/gemma-3-270m",
        end_of_turn="<end_of_turn>",
    ),
)
MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)


def known_types() -> str:
    return ", ".join(MODEL_TYPES)


def family_of_type(model_type: Any) -> Family:
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise FamilyError(
        f"model_type {model_type!r} is not a model family this pipeline builds (model_type {known_types()}; "
        f"e.g. {', '.join(f.example for f in FAMILIES)})"
    )


def family_of(config: dict[str, Any]) -> Family:
    """The family of a config.json (multimodal or text-only); the outer and the text model_type must
    agree on it."""
    outer = config.get("model_type")
    if outer is None:
        # A bare text config without model_type (as the plan's --config-json and older tests give
        # one) is read as the product's own family, Gemma 4, as before there were others.
        outer = FAMILIES[0].model_types[-1]
    text = config.get("text_config")
    inner = text.get("model_type", outer) if isinstance(text, dict) else outer
    family = family_of_type(outer)
    if family_of_type(inner) is not family:
        raise FamilyError(f"config.json's model_type {outer!r} and text_config's {inner!r} disagree")
    return family
