"""The graph I/O contract: every tensor name, shape and dtype of every exported graph, written once.

Export builds its graphs from these specs, the export report records them, and the host runner,
quantize overrides, compile input specs and the Genie config read them from that report. Names and
layouts follow the Genie Gemma 4 contract (qai-hub-models 0.65 templates/gemma4, docs/facts.md §3):

- `inputs_embeds` (1,T,H) and `per_layer_inputs` (1,T,L,P) come from the host LUTs (first part).
- `attention_mask` (1,1,T,C) and `swa_attention_mask` (1,1,T,W+T) are additive: 0 attends,
  ATTENTION_MASK_MIN masks. Columns are the cache slots, then the T new tokens.
- `position_ids_cos/sin` (1,1,T,Dg/2) hold the global "proportional" RoPE table (only the first
  partial_rotary_factor of the frequencies rotate), `swa_position_ids_cos/sin` (1,1,T,Ds/2).
- KV cache per owner layer i and KV head h: `{past|swa}_key_{i}_h{h}_in` (1,1,D,S) and
  `{past|swa}_value_{i}_h{h}_in` (1,1,S,D); the `_out` tensors hold only the T new entries.
  S = C-T for full layers, W for sliding ones (Genie's sliding-window cache group). In a model
  without per-layer inputs the sliding layers keep full-context `past_` caches instead and take
  their window from `attention_mask` in the graph (`window_cache`, `sliding_mask_from_full`).

Tensors that cross part boundaries are named so that the next part's input has the same name as the
previous part's output (Genie wires graphs by tensor name), and start with `xfer_` (LINK_PREFIX: never
a cache-group prefix, and sorting after both): `xfer_hidden_states_layer{j}` (the residual stream
entering layer j), `xfer_per_layer_embeds` (the combined per-layer embeddings, made in the first
part), and `xfer_kvshare_key_{d}`/`xfer_kvshare_value_{d}` (a donor layer's whole attention K/V for
the KV-shared layers of later parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from stages.model.geometry import FULL, SLIDING, Geometry
from stages.model.graphs import GraphKind, graph_name, part_name

# Masked positions get this additive value (qai-hub-models' Gemma 4 clips its masks to -100 as well);
# a quantized mask then spans [-100, 0] instead of the whole float range.
ATTENTION_MASK_MIN = -100.0
CACHE_PREFIX = {FULL: "past", SLIDING: "swa"}
MASK_NAME = {FULL: "attention_mask", SLIDING: "swa_attention_mask"}
ROPE_PREFIX = {FULL: "", SLIDING: "swa_"}  # `{prefix}position_ids_{cos|sin}`
FLOAT32 = "float32"


class ContractError(ValueError):
    pass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = FLOAT32

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TensorSpec:
        return TensorSpec(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class GraphSpec:
    name: str
    part: int  # 1-based
    num_parts: int
    role: str  # prefill | decode | calibration (a twin, stages.model.graphs.calibration_kind)
    ar: int
    context: int
    layers: tuple[int, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def part_name(self) -> str:
        return part_name(self.part, self.num_parts)

    @property
    def is_first(self) -> bool:
        return self.part == 1

    @property
    def is_last(self) -> bool:
        return self.part == self.num_parts

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["inputs"] = [t.to_dict() for t in self.inputs]
        d["outputs"] = [t.to_dict() for t in self.outputs]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GraphSpec:
        return GraphSpec(
            name=d["name"],
            part=d["part"],
            num_parts=d["num_parts"],
            role=d["role"],
            ar=d["ar"],
            context=d["context"],
            layers=tuple(d["layers"]),
            inputs=tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_dict(t) for t in d["outputs"]),
        )


# ---- names ----
# Tensors that cross part boundaries start with this. Genie (QAIRT 2.51, GraphVariant's type detection)
# reads a graph's outputs in name order and stops looking for KV$ outputs at the first other tensor:
# a part whose hand-over outputs sort before `past_*`/`swa_*` is taken for a KV_SHARE_NO_KV_OUTPUT
# graph, its cache groups get no context size ("Missing context size for key input prefix") and every
# multi-chunk prompt fails. "xfer_" sorts after both cache prefixes (docs/facts.md §3).
LINK_PREFIX = "xfer_"


def cache_name(layer: int, attention: str, which: str, head: int, direction: str) -> str:
    """`past_key_4_h0_in`: which is key|value, direction in|out."""
    return f"{CACHE_PREFIX[attention]}_{which}_{layer}_h{head}_{direction}"


HIDDEN_PREFIX = f"{LINK_PREFIX}hidden_states_layer"


def hidden_name(layer: int) -> str:
    return f"{HIDDEN_PREFIX}{layer}"


def kvshare_name(donor: int, which: str) -> str:
    return f"{KVSHARE_PREFIX}{which}_{donor}"


def rope_name(attention: str, which: str) -> str:
    """`position_ids_cos`, `swa_position_ids_sin`: which is cos|sin."""
    return f"{ROPE_PREFIX[attention]}position_ids_{which}"


PER_LAYER_EMBEDS = f"{LINK_PREFIX}per_layer_embeds"
INPUTS_EMBEDS = "inputs_embeds"
PER_LAYER_INPUTS = "per_layer_inputs"
LOGITS = "logits"
# Graph inputs Genie fills from a host LUT, and the export report's key of that LUT.
LUT_INPUTS = {INPUTS_EMBEDS: "embedding", PER_LAYER_INPUTS: "per_layer_embedding"}


def constructed_input_ranges() -> dict[str, tuple[float, float]]:
    """The value range of each input Genie computes itself (masks, RoPE tables), known by construction.

    Quantize gives these one fixed range, so every graph (prefill and decode, every part) reads them
    with one encoding: Genie keeps one buffer per tensor name and refuses to load graphs whose
    encodings of a name differ."""
    ranges = {MASK_NAME[kind]: (ATTENTION_MASK_MIN, 0.0) for kind in MASK_NAME}
    for kind in ROPE_PREFIX:
        ranges |= {rope_name(kind, f): (-1.0, 1.0) for f in ("cos", "sin")}
    return ranges


KVSHARE_PREFIX = f"{LINK_PREFIX}kvshare_"


@dataclass(frozen=True)
class LutSpec:
    """One Genie LUT file: rows of `size` unsigned `bits`-bit values; real = (q + offset) * scale.
    As the export report records it (`ExportResult.luts`), `path` is under exported/."""

    path: str
    rows: int
    size: int
    bits: int
    scale: float
    offset: int

    @property
    def datatype(self) -> str:
        return f"ufixed{self.bits}"


# ---- cache layout ----
def window_cache(geo: Geometry) -> bool:
    """Whether the sliding-window layers keep their own window-sized caches (`swa_`, Genie's
    sliding-window cache group), or full-context caches in the full-attention group (`past_`), the
    graph then applying the window itself from `attention_mask` (`sliding_mask_from_full`).

    QAIRT 2.51's Genie runs a sliding-window group right only in a dialog with a perlayer-embedding
    LUT; without one (Gemma 3) it marks the group's new tokens at the wrong cache columns and cannot
    reset the dialog after the window wrapped (docs/facts.md §3 (l), stages/runtimes/genie/rules.py).
    The full-attention group it runs right on either path. The price: the sliding layers' caches span
    the context (Gemma 3 270M at 8-bit KV: 16 MB instead of 4)."""
    return bool(geo.ple_dim)


def cache_kind(geo: Geometry, attention: str) -> str:
    """The cache layout (FULL or SLIDING: its prefix and slots) of a layer of this attention kind."""
    return attention if window_cache(geo) else FULL


# ---- shapes ----
def cache_slots(geo: Geometry, attention: str, context: int, ar: int) -> int:
    """Past KV slots a graph of AR tokens reads from one layer's cache inputs: the rest of the
    context for a full-attention cache, the sliding window (or the rest of the context, where that
    is less: a layout the plan prices and `check_fits` refuses to build) for a sliding-window one."""
    if cache_kind(geo, attention) == FULL:
        return context - ar
    return min(geo.sliding_window, context - ar)


def check_fits(geo: Geometry, context: int, kinds: Sequence[GraphKind]) -> None:
    """The contract's assumptions about the job, checked before any graph is built: every graph
    kind's sliding-window cache inputs hold the whole window; where the graph applies the window
    itself, no call is wider than the window and every layer's cache entries have one width (Genie's
    cache group has one kv-dim)."""
    uses_sliding = any(layer.attention == SLIDING for layer in geo.layers)
    if uses_sliding and not window_cache(geo):
        dims = sorted({layer.head_dim for layer in geo.layers if layer.owns_kv})
        if len(dims) > 1:
            raise ContractError(
                f"a model without per-layer inputs keeps its sliding-window layers in the full-attention "
                f"cache group, whose entries have one width, but its layers' head_dim are {dims}"
            )
        for kind in kinds:
            if kind.ar > geo.sliding_window:
                raise ContractError(
                    f"the {kind.role} AR ({kind.ar}) is wider than the sliding window "
                    f"({geo.sliding_window}); use an AR of at most {geo.sliding_window}"
                )
        return
    for kind in kinds:
        if uses_sliding and context - kind.ar < geo.sliding_window:
            raise ContractError(
                f"max_context ({context}) minus the {kind.role} AR ({kind.ar}) is smaller than the "
                f"sliding window ({geo.sliding_window}); raise max_context to at least "
                f"{kind.ar + geo.sliding_window}"
            )


def graph_specs(
    geo: Geometry, context: int, parts: Sequence[range], kinds: Sequence[GraphKind]
) -> list[GraphSpec]:
    """Every graph of a job: for each graph kind, one per part (stages.planning.job.Job.build hands
    in the shipped kinds and the calibration twin's)."""
    check_fits(geo, context, kinds)
    return [part_graph_spec(geo, kind, context, list(parts), p) for kind in kinds for p in range(len(parts))]


def part_graph_spec(
    geo: Geometry, kind: GraphKind, context: int, parts: list[range], index: int
) -> GraphSpec:
    """The I/O of part `index`'s graph of this kind (see the module docstring for the names)."""
    layers = parts[index]
    n_parts = len(parts)
    return GraphSpec(
        name=graph_name(kind, index + 1, n_parts),
        part=index + 1,
        num_parts=n_parts,
        role=kind.role,
        ar=kind.ar,
        context=context,
        layers=tuple(layers),
        inputs=tuple(_part_inputs(geo, layers, index == 0, kind.ar, context)),
        outputs=tuple(_part_outputs(geo, layers, index == 0, index == n_parts - 1, kind.ar, context)),
    )


def sliding_mask_from_full(mask: Any, window: int) -> Any:
    """A sliding-window layer's additive mask (1,1,T,S+T), in torch, from the full-attention mask of
    a full-context cache: past slots in position order (Genie fills that group from slot 0), then the
    T new tokens. A query row whose past holds n entries sits at position n + i and may see positions
    above n + i - window: past slot j is out of the window exactly when slot j + window - i - 1 is one
    of the visible past slots, so the window is the row's own past visibility shifted, a gather of the
    mask itself. Every value stays one of the mask's two (0 and ATTENTION_MASK_MIN), so the quantized
    graph computes it exactly with the mask's own encoding; no position or count enters the graph.
    The new tokens' columns are the full mask's (the AR is at most the window: `check_fits`)."""
    import torch

    t = mask.shape[-2]
    s = mask.shape[-1] - t
    past = mask[..., :s]
    padded = torch.cat((past, torch.full((1, 1, t, 1), ATTENTION_MASK_MIN)), dim=-1)
    # Built in its final shape: a reshaped constant would export as a run-time Reshape, not an initializer.
    index = torch.tensor(
        [[[[min(j + window - i - 1, s) for j in range(s)] for i in range(t)]]], dtype=torch.int64
    )
    shifted = torch.gather(padded, -1, index)  # 0 where the slot is out of the window
    past = torch.minimum(past, ATTENTION_MASK_MIN - shifted)
    return torch.cat((past, mask[..., s:]), dim=-1)


def _kvshare(geo: Geometry, donor: int, t: int, context: int) -> list[TensorSpec]:
    """A donor layer's whole attention K/V, for the KV-shared layers of later parts."""
    d = geo.layers[donor]
    s = cache_slots(geo, d.attention, context, t) + t
    return [
        TensorSpec(kvshare_name(donor, "key"), (1, geo.num_kv_heads, d.head_dim, s)),
        TensorSpec(kvshare_name(donor, "value"), (1, geo.num_kv_heads, s, d.head_dim)),
    ]


def _part_inputs(geo: Geometry, layers: range, first: bool, t: int, context: int) -> list[TensorSpec]:
    """The hidden state (or the embeddings), the per-layer inputs, masks and RoPE tables of the
    attention kinds the part holds, donors' K/V from earlier parts, and its own layers' past KV."""
    hidden, n_kv = geo.hidden_size, geo.num_kv_heads
    g_hd, s_hd = geo.config["global_head_dim"], geo.config["head_dim"]
    kinds_here = {geo.layers[i].attention for i in layers}
    inputs: list[TensorSpec] = []
    if first:
        inputs.append(TensorSpec(INPUTS_EMBEDS, (1, t, hidden)))
        if geo.ple_dim:
            inputs.append(TensorSpec(PER_LAYER_INPUTS, (1, t, geo.num_layers, geo.ple_dim)))
    else:
        inputs.append(TensorSpec(hidden_name(layers.start), (1, t, hidden)))
        if geo.ple_dim:
            inputs.append(TensorSpec(PER_LAYER_EMBEDS, (1, t, geo.num_layers, geo.ple_dim)))
    if FULL in {cache_kind(geo, kind) for kind in kinds_here}:
        inputs.append(TensorSpec(MASK_NAME[FULL], (1, 1, t, cache_slots(geo, FULL, context, t) + t)))
    if SLIDING in kinds_here and window_cache(geo):
        inputs.append(TensorSpec(MASK_NAME[SLIDING], (1, 1, t, cache_slots(geo, SLIDING, context, t) + t)))
    if FULL in kinds_here:
        inputs += [TensorSpec(rope_name(FULL, f), (1, 1, t, g_hd // 2)) for f in ("cos", "sin")]
    if SLIDING in kinds_here:
        inputs += [TensorSpec(rope_name(SLIDING, f), (1, 1, t, s_hd // 2)) for f in ("cos", "sin")]
    # Donors of this part's shared layers that live in earlier parts arrive as inputs.
    for donor in sorted({geo.layers[i].kv_donor for i in layers if not geo.layers[i].owns_kv}):
        if donor < layers.start:
            inputs += _kvshare(geo, donor, t, context)
    for i in layers:
        layer = geo.layers[i]
        if layer.owns_kv:
            s = cache_slots(geo, layer.attention, context, t)
            kind = cache_kind(geo, layer.attention)
            for h in range(n_kv):
                inputs.append(TensorSpec(cache_name(i, kind, "key", h, "in"), (1, 1, layer.head_dim, s)))
                inputs.append(TensorSpec(cache_name(i, kind, "value", h, "in"), (1, 1, s, layer.head_dim)))
    return inputs


def _part_outputs(
    geo: Geometry, layers: range, first: bool, last: bool, t: int, context: int
) -> list[TensorSpec]:
    """The logits (last part) or the hidden state and the per-layer embeddings for the next parts,
    the K/V of donors later parts share, and its own layers' new KV entries."""
    outputs: list[TensorSpec] = []
    if last:
        outputs.append(TensorSpec(LOGITS, (1, t, geo.vocab_size)))
    else:
        outputs.append(TensorSpec(hidden_name(layers.stop), (1, t, geo.hidden_size)))
        if first and geo.ple_dim:
            outputs.append(TensorSpec(PER_LAYER_EMBEDS, (1, t, geo.num_layers, geo.ple_dim)))
    # A donor's K/V leaves the part that made it once; every later part that needs it reads that one
    # tensor by name, so nothing is passed through.
    later = range(layers.stop, geo.num_layers)
    for donor in sorted({geo.layers[i].kv_donor for i in later if not geo.layers[i].owns_kv}):
        if donor in layers:
            outputs += _kvshare(geo, donor, t, context)
    for i in layers:
        layer = geo.layers[i]
        if layer.owns_kv:
            kind = cache_kind(geo, layer.attention)
            for h in range(geo.num_kv_heads):
                outputs.append(TensorSpec(cache_name(i, kind, "key", h, "out"), (1, 1, layer.head_dim, t)))
                outputs.append(TensorSpec(cache_name(i, kind, "value", h, "out"), (1, 1, t, layer.head_dim)))
    return outputs
