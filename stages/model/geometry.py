"""Text-decoder geometry of a Gemma model (any family in stages/model/families.py): every weight
tensor the text model has, derived from a config.

The same list serves the planner (parameter and byte counts), the download stage (checking a
snapshot's safetensors shapes) and the export stage (which weights go into which shard). Tensor
names are relative to the language model (`model.language_model.` in the -it checkpoint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.errors import UserFixable
from stages.model.families import FULL, SLIDING, Family, FamilyError, family_of, family_of_type

# Gemma 4 E2B text config, as in google/gemma-4-E2B-it's config.json (text_config); see docs/facts.md §1.
E2B_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_text",
    "vocab_size": 262144,
    "hidden_size": 1536,
    "intermediate_size": 6144,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 512,
    "layer_types": ["sliding_attention"] * 4 * 7,  # replaced below: 4 sliding + 1 full, x7
    "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "attention_k_eq_v": False,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
E2B_TEXT_CONFIG["layer_types"] = [
    "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)
]

# The built-in tiny Gemma 4 (`--model tiny`): every feature of E2B at toy width. Sliding and full
# layers with different head dims, a window (8) shorter than the test prompts, three KV-shared layers
# whose donors are a sliding (1) and a full (2) layer, double-wide MLPs on the shared layers, PLE,
# proportional partial RoPE on full layers, logit softcapping. The vocabulary is the built-in
# byte-level tokenizer's: 6 special tokens + 256 bytes.
TINY_TEXT_CONFIG: dict[str, Any] = {
    **E2B_TEXT_CONFIG,
    "vocab_size": 262,
    "vocab_size_per_layer_input": 262,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 3,
    "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 1024,
}

# Google's Gemma 3 270M text config (gemma3_text), as transformers 5.23 reads it from the packaged
# GGUF (docs/facts.md §8): the plan prices it before the download.
GEMMA3_270M_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18)],
    "query_pre_attn_scalar": 256,
    "final_logit_softcapping": None,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

# Google's Gemma 3 1B (pt and it) text config: 270M's family at hidden 1152, 26 layers. Its parameters
# (999,885,952) are the count keras-hub publishes for its gemma3_1b presets.
GEMMA3_1B_TEXT_CONFIG: dict[str, Any] = {
    **GEMMA3_270M_TEXT_CONFIG,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(26)],
}

# What a tensor is for; the planner prices each kind at its own precision.
LINEAR = "linear"  # attention and MLP projections: weight_bits
NORM = "norm"  # RMSNorm weights and layer scalars: activation precision
PLE = "ple"  # in-graph per-layer-embedding paths: the PLE policy
EMBEDDING = "embedding"  # embed_tokens: host LUT, and the tied lm_head in the last shard
PLE_TABLE = "ple_table"  # embed_tokens_per_layer: host LUT only


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layer:
    index: int
    attention: str  # SLIDING or FULL
    head_dim: int
    intermediate_size: int
    kv_donor: int  # the layer whose KV cache this layer reads (itself for owners)
    tensors: tuple[Tensor, ...]

    @property
    def owns_kv(self) -> bool:
        return self.kv_donor == self.index

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


class GeometryError(UserFixable, ValueError):
    pass


@dataclass(frozen=True)
class Geometry:
    config: dict[str, Any]
    layers: tuple[Layer, ...]
    embedding: Tensor
    ple_table: Tensor | None
    ple_projection: tuple[Tensor, ...]
    final_norm: Tensor

    # ---- shape facts other stages need ----
    @property
    def family(self) -> Family:
        return family_of_type(self.config["model_type"])

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.config["num_key_value_heads"]

    @property
    def num_attention_heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def sliding_window(self) -> int:
        return self.config["sliding_window"]

    @property
    def ple_dim(self) -> int:
        return self.config.get("hidden_size_per_layer_input") or 0

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", True))

    def all_tensors(self) -> list[Tensor]:
        out = [self.embedding]
        if self.ple_table is not None:
            out.append(self.ple_table)
        out += list(self.ple_projection)
        for layer in self.layers:
            out += list(layer.tensors)
        out.append(self.final_norm)
        return out

    @property
    def total_params(self) -> int:
        return sum(t.numel for t in self.all_tensors())

    def is_shared_kv_leftover(self, name: str) -> bool:
        """Whether `name` (relative to the language model) is a K/V weight of a KV-shared layer.

        Those layers have no K/V projections, yet some checkpoints store them (the published
        gemma-4-E2B-it keeps k_proj, v_proj and k_norm for layers 15-34); transformers drops them on
        load (Gemma4TextModel's _keys_to_ignore_on_load_unexpected), and so does this pipeline.
        """
        parts = name.split(".")
        if len(parts) < 4 or parts[0] != "layers" or parts[2] != "self_attn" or not parts[1].isdigit():
            return False
        index = int(parts[1])
        return (
            index < self.num_layers
            and not self.layers[index].owns_kv
            and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm")
        )


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise GeometryError(f"text config lacks '{key}'; is this a Gemma config.json?")
    return cfg[key]


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The text config of a config.json: `text_config` of a multimodal save
    (Gemma4ForConditionalGeneration), or the config itself for a bare text save (Gemma4ForCausalLM)."""
    if "text_config" in config:
        text = config["text_config"]
        if not isinstance(text, dict):
            raise GeometryError(f"text_config is {text!r}, not an object; is this a Gemma config.json?")
        return text
    return config


# What transformers' Gemma 4 reads per layer from per_layer_config (Gemma4TextAttention).
PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def _layer_overrides(cfg: dict[str, Any], layer_types: list[str]) -> dict[int, dict[str, int]]:
    """Per-layer head_dim / num_key_value_heads overrides, read as transformers 5.23 reads them.

    Two forms exist. transformers saves `per_layer_config` (layer index keys as strings, zero-padded
    to sort, e.g. "04"; only values that differ from the global ones). The published configs instead
    give `global_head_dim` (and `num_global_key_value_heads`, which transformers applies only with
    `attention_k_eq_v`) for the full-attention layers. When `per_layer_config` is present, even
    empty, transformers ignores the global_* fields, and so does this.
    """
    n = len(layer_types)
    if "per_layer_config" not in cfg:
        if cfg.get("global_head_dim") is None:
            raise GeometryError(
                "text config gives neither 'per_layer_config' nor 'global_head_dim' (the head size of the "
                "full-attention layers); add the one your checkpoint was trained with"
            )
        return {i: {"head_dim": cfg["global_head_dim"]} for i, t in enumerate(layer_types) if t == FULL}
    raw = cfg["per_layer_config"] or {}
    if not isinstance(raw, dict):
        raise GeometryError(f"per_layer_config is {raw!r}, not an object of layer index -> overrides")
    out: dict[int, dict[str, int]] = {}
    for key, overrides in raw.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise GeometryError(f"per_layer_config key {key!r} is not a layer index") from None
        if not 0 <= index < n:
            raise GeometryError(f"per_layer_config key {key!r} is not a layer index in 0..{n - 1}")
        if not isinstance(overrides, dict):
            raise GeometryError(f"per_layer_config[{key!r}] is {overrides!r}, not an object")
        unknown = sorted(set(overrides) - set(PER_LAYER_FIELDS))
        if unknown:
            raise GeometryError(
                f"per_layer_config[{key!r}] sets {', '.join(unknown)}; Gemma 4 reads only "
                f"{' and '.join(PER_LAYER_FIELDS)} per layer"
            )
        out[index] = dict(overrides)
    return out


def _attention_shapes(cfg: dict[str, Any], layer_types: list[str]) -> tuple[list[int], int]:
    """(head_dim of every layer, the KV head count), with the limits transformers and the graphs share."""
    head_dim = _require(cfg, "head_dim")
    n_heads = _require(cfg, "num_attention_heads")
    n_kv = _require(cfg, "num_key_value_heads")
    overrides = _layer_overrides(cfg, layer_types)
    dims = [overrides.get(i, {}).get("head_dim", head_dim) for i in range(len(layer_types))]
    kvs = [overrides.get(i, {}).get("num_key_value_heads", n_kv) for i in range(len(layer_types))]
    for kind in (SLIDING, FULL):
        of_kind = {i: d for i, d in enumerate(dims) if layer_types[i] == kind}
        if len(set(of_kind.values())) > 1:
            # transformers builds one RoPE table per layer type from that type's head_dim.
            listed = ", ".join(f"layer {i}: {d}" for i, d in of_kind.items())
            raise GeometryError(
                f"per_layer_config gives the {kind} layers different head_dim values ({listed}); "
                "Gemma 4 needs one head_dim per layer type"
            )
    if len(set(kvs)) > 1:
        raise GeometryError(
            f"per_layer_config gives layers different num_key_value_heads ({sorted(set(kvs))}); this "
            "pipeline needs one KV head count for every layer (as in E2B and E4B)"
        )
    if n_heads % kvs[0]:
        raise GeometryError(
            f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {kvs[0]}"
        )
    return dims, kvs[0]


def kv_donors(layer_types: list[str], num_kv_shared_layers: int) -> list[int]:
    """For each layer, the index of the layer whose KV it reads (transformers' kv_sharing_modes)."""
    n = len(layer_types)
    first_shared = n - num_kv_shared_layers
    donors = list(range(n))
    for i in range(first_shared, n):
        owners = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not owners:
            raise GeometryError(
                f"layer {i} ({layer_types[i]}) shares KV but no earlier layer of that type owns one"
            )
        donors[i] = owners[-1]
    return donors


def geometry_from_config(config: dict[str, Any]) -> Geometry:
    """The geometry of a config.json of any family in stages/model/families.py (multimodal or
    text-only), in every form transformers writes or Google publishes; a value no form gives is a
    GeometryError naming the field."""
    try:
        family = family_of(config)
        cfg = family.normalise(text_config_of(config))
    except FamilyError as e:
        raise GeometryError(str(e)) from None
    cfg.setdefault("model_type", family.model_types[-1])
    _refuse_unsupported(config, cfg)
    hidden = _require(cfg, "hidden_size")
    n_layers = _require(cfg, "num_hidden_layers")
    n_heads = _require(cfg, "num_attention_heads")
    vocab = _require(cfg, "vocab_size")
    layer_types = _layer_types(cfg, n_layers, family)
    head_dims, n_kv = _attention_shapes(cfg, layer_types)
    n_shared = cfg.get("num_kv_shared_layers") or 0
    donors = kv_donors(layer_types, n_shared)
    ple_dim = cfg.get("hidden_size_per_layer_input") or 0
    inter = _require(cfg, "intermediate_size")
    inters = inter if isinstance(inter, list) else [inter] * n_layers
    full_dims = [d for d, t in zip(head_dims, layer_types, strict=True) if t == FULL]
    sliding_dims = [d for d, t in zip(head_dims, layer_types, strict=True) if t == SLIDING]
    # One normalised form for the other stages and transformers: global_head_dim, no per_layer_config.
    normalised = {k: v for k, v in cfg.items() if k not in ("per_layer_config", "num_global_key_value_heads")}
    normalised.update(
        layer_types=layer_types,
        head_dim=sliding_dims[0] if sliding_dims else cfg["head_dim"],
        global_head_dim=full_dims[0] if full_dims else cfg["global_head_dim"],
        num_key_value_heads=n_kv,
        num_kv_shared_layers=n_shared,
    )
    layers = []
    for i, kind in enumerate(layer_types):
        owns = donors[i] == i
        width = inters[i] * (2 if cfg.get("use_double_wide_mlp") and not owns else 1)
        shapes = (hidden, n_heads, n_kv, head_dims[i], width, ple_dim)
        tensors = _layer_tensors(i, owns, *shapes, scalar=family.layer_scalar)
        layers.append(Layer(i, kind, head_dims[i], width, donors[i], tensors))

    ple_table = None
    ple_projection: tuple[Tensor, ...] = ()
    if ple_dim:
        ple_vocab = cfg.get("vocab_size_per_layer_input", vocab)
        ple_table = Tensor("embed_tokens_per_layer.weight", (ple_vocab, n_layers * ple_dim), PLE_TABLE)
        ple_projection = (
            Tensor("per_layer_model_projection.weight", (n_layers * ple_dim, hidden), PLE),
            Tensor("per_layer_projection_norm.weight", (ple_dim,), PLE),
        )
    return Geometry(
        config=normalised,
        layers=tuple(layers),
        embedding=Tensor("embed_tokens.weight", (vocab, hidden), EMBEDDING),
        ple_table=ple_table,
        ple_projection=ple_projection,
        final_norm=Tensor("norm.weight", (hidden,), NORM),
    )


def _refuse_unsupported(config: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The variants this pipeline does not build, named by the field that says so."""
    if cfg.get("enable_moe_block"):
        raise GeometryError("MoE Gemma 4 variants are not supported; use an E2B/E4B-style config")
    if cfg.get("attention_k_eq_v"):
        raise GeometryError(
            "attention_k_eq_v is true (full-attention keys double as values, as in the larger Gemma 4 "
            "models); this pipeline handles E2B/E4B-style attention only"
        )
    if cfg.get("use_bidirectional_attention") == "all":
        raise GeometryError("use_bidirectional_attention is 'all': not a causal language model")
    for tied in (config.get("tie_word_embeddings"), cfg.get("tie_word_embeddings")):
        if tied is False:
            raise GeometryError(
                "tie_word_embeddings is false: this pipeline's lm_head is the embedding table, as in every "
                "published Gemma 3 and Gemma 4"
            )


def _layer_types(cfg: dict[str, Any], n_layers: int, family: Family) -> list[str]:
    """Each layer's attention kind: the config's, or the family's default pattern."""
    layer_types = list(cfg.get("layer_types") or [])
    if not layer_types:
        every = family.full_every
        layer_types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise GeometryError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    odd = sorted(set(layer_types) - {SLIDING, FULL})
    if odd:
        raise GeometryError(f"layer_types holds {odd[0]!r}; {family.name} layers are {SLIDING} or {FULL}")
    if family.last_layer_full:
        layer_types[-1] = FULL
    return layer_types


def _layer_tensors(
    i: int, owns: bool, hidden: int, n_heads: int, n_kv: int, hd: int, width: int, ple_dim: int, scalar: bool
) -> tuple[Tensor, ...]:
    """Layer i's weights as the checkpoint names them (a KV-shared layer has no K/V projections)."""
    p = f"layers.{i}."
    ts = [
        Tensor(p + "self_attn.q_proj.weight", (n_heads * hd, hidden), LINEAR),
        Tensor(p + "self_attn.q_norm.weight", (hd,), NORM),
    ]
    if owns:
        ts += [
            Tensor(p + "self_attn.k_proj.weight", (n_kv * hd, hidden), LINEAR),
            Tensor(p + "self_attn.v_proj.weight", (n_kv * hd, hidden), LINEAR),
            Tensor(p + "self_attn.k_norm.weight", (hd,), NORM),
        ]
    ts += [
        Tensor(p + "self_attn.o_proj.weight", (hidden, n_heads * hd), LINEAR),
        Tensor(p + "mlp.gate_proj.weight", (width, hidden), LINEAR),
        Tensor(p + "mlp.up_proj.weight", (width, hidden), LINEAR),
        Tensor(p + "mlp.down_proj.weight", (hidden, width), LINEAR),
    ]
    ts += [
        Tensor(p + f"{norm}.weight", (hidden,), NORM)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
    ]
    if scalar:
        ts.append(Tensor(p + "layer_scalar", (1,), NORM))
    if ple_dim:
        ts += [
            Tensor(p + "per_layer_input_gate.weight", (ple_dim, hidden), PLE),
            Tensor(p + "per_layer_projection.weight", (hidden, ple_dim), PLE),
            Tensor(p + "post_per_layer_input_norm.weight", (hidden,), NORM),
        ]
    return tuple(ts)


def e2b_geometry() -> Geometry:
    return geometry_from_config(E2B_TEXT_CONFIG)


# Models whose geometry is known without a downloaded config.json (lower-cased names).
KNOWN_GEOMETRIES = {
    "google/gemma-4-e2b-it": E2B_TEXT_CONFIG,
    # the same architecture, its decoder weights on Q4_0's grid (the `qat` preset)
    "google/gemma-4-e2b-it-qat-q4_0-unquantized": E2B_TEXT_CONFIG,
    "e2b-random": E2B_TEXT_CONFIG,
    "tiny": TINY_TEXT_CONFIG,
    "gemma-3-270m-q4_k_m": GEMMA3_270M_TEXT_CONFIG,
    "google/gemma-3-270m": GEMMA3_270M_TEXT_CONFIG,
    "google/gemma-3-270m-it": GEMMA3_270M_TEXT_CONFIG,
    "google/gemma-3-1b-pt": GEMMA3_1B_TEXT_CONFIG,
    "google/gemma-3-1b-it": GEMMA3_1B_TEXT_CONFIG,
}


# Published checkpoints whose decoder weights sit on a low-bit grid (quantization-aware training), by
# the grid's group size along the input (None: one scale per output channel); lower-cased names.
# What quantize finds in the weights themselves decides (stages/quant/grid.py); this lets the plan and the
# layout rule know it before the download.
KNOWN_QAT_GROUPS: dict[str, int | None] = {"google/gemma-4-e2b-it-qat-q4_0-unquantized": 32}


def builtin_geometry(model: str) -> Geometry | None:
    config = KNOWN_GEOMETRIES.get(model.lower())
    return geometry_from_config(config) if config else None


def resolve_geometry(
    model: str, checkpoint_dir: Path | None = None, config_json: Path | None = None
) -> Geometry | None:
    """The geometry a command prices or checks: the config.json given, else the downloaded checkpoint's
    (`checkpoint_dir`), else the model's built-in one; None when there is none of them."""
    if config_json is None and checkpoint_dir is not None and (checkpoint_dir / "config.json").is_file():
        config_json = checkpoint_dir / "config.json"
    if config_json is not None:
        return load_geometry(config_json)
    return builtin_geometry(model)


def load_geometry(config_json: Path | None) -> Geometry:
    """Geometry of a checkpoint's config.json, or of the built-in E2B geometry when None."""
    if config_json is None:
        return e2b_geometry()
    try:
        config = json.loads(Path(config_json).read_text())
    except FileNotFoundError:
        raise GeometryError(f"{config_json} does not exist; run `make download` first") from None
    except json.JSONDecodeError as e:
        raise GeometryError(f"{config_json} is not valid JSON: {e}") from None
    return geometry_from_config(config)
