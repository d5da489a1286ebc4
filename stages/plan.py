"""`g4v69 plan`: what a pipeline config will produce, priced before anything runs.

Counts come from the model geometry (every weight tensor), bytes from the precision each kind of
tensor gets, limits and bandwidth from the SoC table. Nothing here is measured; the benchmark puts
measured figures beside these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from stages.config import PipelineConfig
from stages.geometry import EMBEDDING, FULL, LINEAR, NORM, PLE, Geometry, Tensor
from stages.graphs import graph_kinds, graph_name, part_name, partition_layers

GIB = 1 << 30
# Genie reads LUT sizes as uint32.
LUT_LIMIT_BYTES = 4 * GIB
# ExecuTorch's QNN docs give 4 GB per context binary; a lower v69 limit is unverified.
CONTEXT_LIMIT_BYTES = 4 * 10**9
PLE_POLICY_BITS = {"float16": 16, "int16": 16, "int8": 8}
EMBEDDING_LUT_BITS = 16


@dataclass
class PartPlan:
    name: str
    layers: list[int]
    params: int
    bytes: int
    holds: list[str]


@dataclass
class GraphPlan:
    name: str
    part: str
    role: str
    ar: int
    params: int
    bytes: int
    kv_inputs: int


@dataclass
class Plan:
    model: str
    soc: str
    dsp_arch: str
    precision: str
    kv_cache_bits: int
    params: dict[str, int]
    parts: list[PartPlan]
    graphs: list[GraphPlan]
    luts: dict[str, int]
    kv_cache_bytes: int
    kv_cache_bytes_without_window: int
    device_bytes_shared_weights: int
    device_bytes_separate_binaries: int
    device_bytes: int
    decode_bytes_per_token: int
    decode_tokens_per_s_ceiling: float
    bandwidth: dict
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def tensor_bits(t: Tensor, cfg: PipelineConfig) -> int:
    """Bits per element of a weight as it will sit in a context binary."""
    p = cfg.precision_info
    if t.kind == LINEAR:
        return p.weight_bits
    if t.kind == EMBEDDING:  # the tied lm_head: 8-bit per channel at least
        return max(8, p.weight_bits)
    if t.kind == PLE:
        return PLE_POLICY_BITS[cfg.ple_policy]
    if t.kind == NORM:
        return p.activation_bits
    raise ValueError(f"{t.name} ({t.kind}) does not live in a graph")


def tensor_bytes(tensors: list[Tensor], cfg: PipelineConfig) -> int:
    return sum(t.numel * tensor_bits(t, cfg) // 8 for t in tensors)


def kv_slots(geo: Geometry, attention: str, cfg: PipelineConfig, windowed: bool = True) -> int:
    if attention == FULL or not windowed:
        return cfg.max_context
    return min(geo.sliding_window, cfg.max_context)


def kv_cache_bytes(geo: Geometry, cfg: PipelineConfig, windowed: bool = True) -> int:
    total = 0
    for layer in geo.layers:
        if layer.owns_kv:
            per_slot = 2 * geo.num_kv_heads * layer.head_dim * cfg.kv_cache_bits // 8
            total += per_slot * kv_slots(geo, layer.attention, cfg, windowed)
    return total


def part_extras(geo: Geometry) -> tuple[list[Tensor], list[Tensor]]:
    """Weights outside the decoder layers: the PLE projection rides with the first part, the final
    norm and the lm_head (the tied embedding, an explicit weight in the graph) with the last."""
    return list(geo.ple_projection), [geo.final_norm, geo.embedding]


def part_layers(geo: Geometry, cfg: PipelineConfig) -> list[range]:
    """The decoder layers of each part, balanced by weight bytes at the config's precision.

    The export cuts its graphs here too, so the plan prices exactly what gets built.
    """
    head, tail = part_extras(geo)
    layer_bytes = [tensor_bytes(list(layer.tensors), cfg) for layer in geo.layers]
    return partition_layers(layer_bytes, cfg.num_shards, tensor_bytes(head, cfg), tensor_bytes(tail, cfg))


def make_plan(geo: Geometry, cfg: PipelineConfig) -> Plan:
    soc = cfg.soc_info
    head, tail = part_extras(geo)
    bounds = part_layers(geo, cfg)

    parts: list[PartPlan] = []
    for i, layer_range in enumerate(bounds, start=1):
        tensors: list[Tensor] = []
        holds = [f"layers {layer_range.start}-{layer_range.stop - 1}"]
        if i == 1 and head:
            tensors += head
            holds.insert(0, "PLE projection")
        for li in layer_range:
            tensors += geo.layers[li].tensors
        if i == len(bounds):
            tensors += tail
            holds += ["final norm", "lm_head"]
        parts.append(
            PartPlan(
                name=part_name(i, len(bounds)),
                layers=list(layer_range),
                params=sum(t.numel for t in tensors),
                bytes=tensor_bytes(tensors, cfg),
                holds=holds,
            )
        )

    graphs = []
    for kind in graph_kinds(cfg):
        for i, (part, layer_range) in enumerate(zip(parts, bounds, strict=True), start=1):
            kv_inputs = sum(2 * geo.num_kv_heads for li in layer_range if geo.layers[li].owns_kv)
            graphs.append(
                GraphPlan(
                    name=graph_name(kind, i, len(parts)),
                    part=part.name,
                    role=kind.role,
                    ar=kind.ar,
                    params=part.params,
                    bytes=part.bytes,
                    kv_inputs=kv_inputs,
                )
            )

    luts = {"embedding": geo.embedding.numel * EMBEDDING_LUT_BITS // 8}
    if geo.ple_table is not None:
        luts["per_layer_embedding"] = geo.ple_table.numel * cfg.ple_lut_bits // 8

    kv = kv_cache_bytes(geo, cfg)
    shared = sum(p.bytes for p in parts)
    separate = sum(g.bytes for g in graphs)
    host_side = sum(luts.values()) + kv
    device_shared = shared + host_side
    device_separate = separate + host_side
    device = device_shared if soc.weight_sharing else device_separate

    # Decode reads every weight of every part once per token, the whole KV cache at full context,
    # and one row of each LUT.
    lut_rows = geo.hidden_size * EMBEDDING_LUT_BITS // 8
    if geo.ple_table is not None:
        lut_rows += geo.ple_table.shape[1] * cfg.ple_lut_bits // 8
    per_token = shared + kv + lut_rows
    tokens_per_s = soc.memory.gb_per_s * 1e9 / per_token

    param_counts = {
        "total": geo.total_params,
        "embedding": geo.embedding.numel,
        "per_layer_embedding_table": geo.ple_table.numel if geo.ple_table else 0,
        "ple_projection": sum(t.numel for t in geo.ple_projection),
        "decoder_layers": sum(layer.numel for layer in geo.layers),
        "in_graphs": sum(p.params for p in parts),
    }

    warnings = []
    if cfg.separate_prefill_and_decode and not soc.weight_sharing:
        warnings.append(
            f"{soc.name} ({soc.dsp_arch}) has no weight sharing: prefill and decode binaries each "
            f"carry their own weights ({_gib(separate - shared)} more on the device); set "
            f"PREFILL_AR equal to DECODE_AR to ship one graph per part instead"
        )
    for name, size in luts.items():
        if size >= LUT_LIMIT_BYTES:
            warnings.append(
                f"{name} LUT is {_gib(size)}, over Genie's 4 GiB LUT limit (uint32 sizes); use ple_lut_bits=8"
            )
    for part in parts:
        if part.bytes >= CONTEXT_LIMIT_BYTES:
            warnings.append(
                f"{part.name} is {_gib(part.bytes)}, over the 4 GB per-context limit; raise NUM_SHARDS"
            )

    return Plan(
        model=cfg.model,
        soc=soc.name,
        dsp_arch=soc.dsp_arch,
        precision=cfg.precision,
        kv_cache_bits=cfg.kv_cache_bits,
        params=param_counts,
        parts=parts,
        graphs=graphs,
        luts=luts,
        kv_cache_bytes=kv,
        kv_cache_bytes_without_window=kv_cache_bytes(geo, cfg, windowed=False),
        device_bytes_shared_weights=device_shared,
        device_bytes_separate_binaries=device_separate,
        device_bytes=device,
        decode_bytes_per_token=per_token,
        decode_tokens_per_s_ceiling=round(tokens_per_s, 1),
        bandwidth={"gb_per_s": soc.memory.gb_per_s, "dram": soc.memory.dram, "source": soc.memory.source},
        warnings=warnings,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _m(n: int) -> str:
    return f"{n / 1e6:,.1f} M"


def _table(rows: list[list[str]], header: list[str], text_columns: int = 1) -> list[str]:
    """Plain-text table; the first `text_columns` columns align left, figures align right."""
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if c < text_columns else '>'}{w}}}" for c, w in enumerate(widths))
    lines = [fmt.format(*header), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in rows]
    return lines


def render_plan(plan: Plan) -> str:
    out = [
        f"Plan: {plan.model} on {plan.soc} ({plan.dsp_arch}), {plan.precision}, KV {plan.kv_cache_bits}-bit",
        "",
        "Parameters",
    ]
    out += _table([[k, _m(v)] for k, v in plan.params.items()], ["what", "params"])
    out += ["", "Parts (one context binary per graph)"]
    out += _table(
        [[p.name, ", ".join(p.holds), _m(p.params), _mib(p.bytes)] for p in plan.parts],
        ["part", "holds", "params", "bytes"],
        text_columns=2,
    )
    out += ["", "Graphs"]
    out += _table(
        [[g.name, g.role, str(g.ar), str(g.kv_inputs), _mib(g.bytes)] for g in plan.graphs],
        ["graph", "role", "AR", "KV in", "bytes"],
        text_columns=2,
    )
    out += ["", "Device memory"]
    rows = [[f"{k} LUT", _mib(v)] for k, v in plan.luts.items()]
    rows += [
        ["KV cache (sliding layers windowed)", _mib(plan.kv_cache_bytes)],
        ["KV cache (every layer full length)", _mib(plan.kv_cache_bytes_without_window)],
        ["total, weight-shared binaries", _gib(plan.device_bytes_shared_weights)],
        ["total, separate prefill/decode binaries", _gib(plan.device_bytes_separate_binaries)],
        [f"total on {plan.soc}", _gib(plan.device_bytes)],
    ]
    out += _table(rows, ["what", "bytes"])
    out += [
        "",
        f"Decode roofline: {plan.decode_bytes_per_token / 1e9:.2f} GB read per token at "
        f"{plan.bandwidth['gb_per_s']} GB/s ({plan.bandwidth['dram']}) -> at most "
        f"{plan.decode_tokens_per_s_ceiling} tokens/s",
    ]
    if plan.warnings:
        out += ["", "Warnings"] + [f"  ! {w}" for w in plan.warnings]
    return "\n".join(out)
