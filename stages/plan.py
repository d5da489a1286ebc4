"""`g4v69 plan`: what a pipeline config will produce, priced before anything runs.

Counts come from the model geometry (every weight tensor), bytes from the quantization scheme each kind
of tensor gets (stages/precision.py), limits and bandwidth from the SoC table. Nothing here is
measured; the compile stage records what the binaries really weigh, and the benchmark puts measured
figures beside these.

Memory is priced three ways, against the three limits of the SoC table:
- per binary, its ESTIMATED ALLOCATION (what the context-binary generator compares with its
  per-context limit): weights + the graph's I/O tensors + the live intermediates of its widest layer at
  the graph's AR + spill-fill (those intermediates beyond VTCM). The compiler's own figure is not
  public; ours is a model of it, and the compile stage keeps the two apart.
- mapped: the sum of every binary's estimated allocation, what Genie maps when it loads every
  ctx-bin, against one DSP process domain's 32-bit address space.
- pinned: binaries + LUTs + KV cache, against the RAM a bundle may pin on each phone class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from stages.config import PipelineConfig
from stages.contract import GENIE_LUT_LIMIT_BYTES
from stages.geometry import EMBEDDING, FULL, LINEAR, NORM, PLE, Geometry, Tensor
from stages.graphs import binary_layout, graph_kinds, graph_name, part_name, partition_layers, past_len
from stages.precision import DECODER_ROLE, LM_HEAD_ROLE, NORM_ROLE, PLE_ROLE, WeightScheme, usable_precisions

GIB = 1 << 30
MIB = 1 << 20
# Genie reads LUT sizes as uint32.
EMBEDDING_LUT_BITS = 16
# A geometry tensor's kind -> the role whose storage rule it follows (the embedding is the tied lm_head).
KIND_ROLES = {LINEAR: DECODER_ROLE, EMBEDDING: LM_HEAD_ROLE, PLE: PLE_ROLE, NORM: NORM_ROLE}


@dataclass
class PartPlan:
    name: str
    layers: list[int]
    params: int
    bytes: int
    holds: list[str]


@dataclass
class Allocation:
    """A graph's estimated allocation on the HTP, in bytes (see the module docstring)."""

    weights: int
    io: int
    intermediates: int
    spill_fill: int

    @property
    def total(self) -> int:
        return self.weights + self.io + self.intermediates + self.spill_fill

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass
class GraphPlan:
    name: str
    part: str
    role: str
    ar: int
    params: int
    bytes: int
    kv_inputs: int
    allocation: dict[str, int]


@dataclass
class BinaryPlan:
    file: str
    part: str
    graphs: list[str]
    weight_bytes: int
    estimated_allocation: int


@dataclass
class LimitCheck:
    """One limit of the SoC table against what the config needs."""

    limit: str
    needed_bytes: int
    limit_bytes: int
    meets: bool
    source: str
    unverified: str = ""  # what only a phone can settle about this verdict
    phone_ram_gib: int = 0  # set on the phone-budget checks


@dataclass
class Plan:
    model: str
    soc: str
    dsp_arch: str
    precision: str
    weight_scheme: str
    kv_cache_bits: int
    params: dict[str, int]
    parts: list[PartPlan]
    graphs: list[GraphPlan]
    binaries: list[BinaryPlan]
    luts: dict[str, int]
    kv_cache_bytes: int
    kv_cache_bytes_without_window: int
    device_bytes_shared_weights: int
    device_bytes_separate_binaries: int
    device_bytes: int  # pinned: binaries + LUTs + KV cache, as this SoC stores the binaries
    mapped_bytes: int  # every binary's estimated allocation, one process domain
    four_bit_weight_bytes: int  # 4-bit weights in all binaries: what unpacking them to 8 bits adds
    limits: list[LimitCheck]
    decode_bytes_per_token: int
    decode_tokens_per_s_ceiling: float
    bandwidth: dict
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def fits(self, phone_ram_gib: int) -> bool:
        """Every SoC limit met, and the phone budget of a phone with this much RAM."""
        return all(c.meets for c in self.limits if c.phone_ram_gib in (0, phone_ram_gib))


def weight_scheme(t: Tensor, cfg: PipelineConfig) -> WeightScheme:
    """How a weight is stored in a context binary."""
    if t.kind not in KIND_ROLES:
        raise ValueError(f"{t.name} ({t.kind}) does not live in a graph")
    return cfg.weight_scheme(KIND_ROLES[t.kind])


def tensor_bits(t: Tensor, cfg: PipelineConfig) -> int:
    """Bits per element of a weight as it will sit in a context binary."""
    return weight_scheme(t, cfg).bits


def tensor_bytes(tensors: list[Tensor], cfg: PipelineConfig) -> int:
    return sum(weight_scheme(t, cfg).stored_bytes(t.numel) for t in tensors)


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


def graph_allocation(
    geo: Geometry, cfg: PipelineConfig, layers: range, last: bool, ar: int, weights: int
) -> Allocation:
    """The estimated allocation of one graph of a part at AR tokens per call.

    I/O: hidden state (or inputs_embeds) in and out, per-layer inputs, both masks, both RoPE tables,
    the KV inputs and new entries of the owner layers, the donor caches shared with later parts, and
    the logits. Intermediates: the widest layer's live tensors (Q, scores and probabilities, the
    concatenated K/V it reads; or the MLP's gate, up and product) plus the residual stream.
    Spill-fill: what of those intermediates does not fit in VTCM.
    """
    act = cfg.precision_info.activation_bits // 8
    kv = cfg.kv_cache_bits // 8
    ctx, hidden = cfg.max_context, geo.hidden_size
    full_dim = max((lay.head_dim for lay in geo.layers if lay.attention == FULL), default=0)
    slide_dim = max((lay.head_dim for lay in geo.layers if lay.attention != FULL), default=0)
    io = ar * hidden * act * (1 if last else 2)  # hidden state (inputs_embeds) in; out unless last
    io += ar * geo.num_layers * geo.ple_dim * act
    io += ar * ctx * act + ar * (min(geo.sliding_window, ctx - ar) + ar) * act
    io += 2 * ar * (full_dim + slide_dim) // 2 * act  # cos and sin of both RoPE tables
    donors_from_outside = set()
    for li in layers:
        layer = geo.layers[li]
        per_token = 2 * geo.num_kv_heads * layer.head_dim * kv
        if layer.owns_kv:
            io += per_token * (past_len(geo, layer.attention, cfg, ar) + ar)
        elif layer.kv_donor not in layers:
            donors_from_outside.add(layer.kv_donor)
    for d in donors_from_outside:
        donor = geo.layers[d]
        io += 2 * geo.num_kv_heads * donor.head_dim * kv * (past_len(geo, donor.attention, cfg, ar) + ar)
    if last:
        io += ar * geo.vocab_size * act
    widest = 0
    for li in layers:
        layer = geo.layers[li]
        span = past_len(geo, layer.attention, cfg, ar) + ar
        attention = (
            ar * geo.num_attention_heads * layer.head_dim * act
            + 2 * geo.num_attention_heads * ar * span * act
            + 2 * geo.num_kv_heads * layer.head_dim * span * kv
        )
        mlp = 3 * ar * layer.intermediate_size * act
        widest = max(widest, attention, mlp)
    intermediates = widest + 2 * ar * hidden * act
    spill_fill = max(0, intermediates - cfg.soc_info.vtcm_mib * MIB)
    return Allocation(weights=weights, io=io, intermediates=intermediates, spill_fill=spill_fill)


def make_plan(geo: Geometry, cfg: PipelineConfig) -> Plan:
    soc = cfg.soc_info
    head, tail = part_extras(geo)
    bounds = part_layers(geo, cfg)

    parts: list[PartPlan] = []
    four_bit = 0  # bytes of 4-bit weights in the parts: what unpacking them to 8 bits would add
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
        four_bit += sum(t.numel // 2 for t in tensors if weight_scheme(t, cfg).bits == 4)
        parts.append(
            PartPlan(
                name=part_name(i, len(bounds)),
                layers=list(layer_range),
                params=sum(t.numel for t in tensors),
                bytes=tensor_bytes(tensors, cfg),
                holds=holds,
            )
        )

    graphs: list[GraphPlan] = []
    allocations: dict[str, Allocation] = {}
    for kind in graph_kinds(cfg):
        for i, (part, layer_range) in enumerate(zip(parts, bounds, strict=True), start=1):
            kv_inputs = sum(2 * geo.num_kv_heads for li in layer_range if geo.layers[li].owns_kv)
            name = graph_name(kind, i, len(parts))
            alloc = graph_allocation(geo, cfg, layer_range, i == len(parts), kind.ar, part.bytes)
            allocations[name] = alloc
            graphs.append(
                GraphPlan(
                    name=name,
                    part=part.name,
                    role=kind.role,
                    ar=kind.ar,
                    params=part.params,
                    bytes=part.bytes,
                    kv_inputs=kv_inputs,
                    allocation=alloc.to_dict(),
                )
            )

    # A weight-shared binary holds its part's weights once; its graphs never run at the same time,
    # so the largest one's activations bound the rest.
    binaries = []
    for b in binary_layout(cfg):
        allocs = [allocations[g] for g in b.graphs]
        weights = parts[b.part - 1].bytes
        binaries.append(
            BinaryPlan(
                file=b.file,
                part=parts[b.part - 1].name,
                graphs=list(b.graphs),
                weight_bytes=weights,
                estimated_allocation=weights + max(a.total - a.weights for a in allocs),
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
    device = sum(b.weight_bytes for b in binaries) + host_side
    mapped = sum(b.estimated_allocation for b in binaries)

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

    four_bit *= len(binaries) // len(parts)  # each part's weights are stored this many times
    limits = limit_checks(cfg, binaries, mapped, device, device + four_bit)
    warnings = []
    if cfg.separate_prefill_and_decode and not soc.weight_sharing:
        warnings.append(
            f"{soc.name} ({soc.dsp_arch}) has no weight sharing: prefill and decode binaries each "
            f"carry their own weights ({_gib(separate - shared)} more on the device); set "
            f"PREFILL_AR equal to DECODE_AR to ship one graph per part instead"
        )
    for name, size in luts.items():
        if size > GENIE_LUT_LIMIT_BYTES:
            warnings.append(
                f"{name} LUT is {_gib(size)}, over Genie's 4 GiB LUT limit (uint32 sizes); use ple_lut_bits=8"
            )
    warnings += [
        f"over the {c.limit}: {_gib(c.needed_bytes)} > {_gib(c.limit_bytes)}" for c in limits if not c.meets
    ]

    return Plan(
        model=cfg.model,
        soc=soc.name,
        dsp_arch=soc.dsp_arch,
        precision=cfg.precision,
        weight_scheme=cfg.decoder_scheme.name,
        kv_cache_bits=cfg.kv_cache_bits,
        params=param_counts,
        parts=parts,
        graphs=graphs,
        binaries=binaries,
        luts=luts,
        kv_cache_bytes=kv,
        kv_cache_bytes_without_window=kv_cache_bytes(geo, cfg, windowed=False),
        device_bytes_shared_weights=device_shared,
        device_bytes_separate_binaries=device_separate,
        device_bytes=device,
        mapped_bytes=mapped,
        four_bit_weight_bytes=four_bit,
        limits=limits,
        decode_bytes_per_token=per_token,
        decode_tokens_per_s_ceiling=round(tokens_per_s, 1),
        bandwidth={"gb_per_s": soc.memory.gb_per_s, "dram": soc.memory.dram, "source": soc.memory.source},
        warnings=warnings,
    )


def over_context_limit(geo: Geometry, cfg: PipelineConfig) -> str:
    """Empty if every binary's estimated allocation is within the SoC's per-context limit; otherwise
    one line naming the largest binary and the smallest num_shards whose parts all fit."""
    limit = cfg.soc_info.limits.context_allocation.bytes
    worst = max(make_plan(geo, cfg).binaries, key=lambda b: b.estimated_allocation)
    if worst.estimated_allocation <= limit:
        return ""
    fitting = next(
        (
            n
            for n in range(cfg.num_shards + 1, geo.num_layers + 1)
            if max(
                b.estimated_allocation
                for b in make_plan(geo, dataclasses.replace(cfg, num_shards=n)).binaries
            )
            <= limit
        ),
        None,
    )
    fix = f"use num_shards >= {fitting}" if fitting else "no num_shards fits: lower precision or max_context"
    return (
        f"{worst.file} needs an estimated allocation of {worst.estimated_allocation // 1024} KB at "
        f"{cfg.precision}, over {cfg.soc}'s per-context limit of {limit // 1024} KB "
        f"({cfg.soc_info.dsp_arch}); {fix} (now {cfg.num_shards})"
    )


def built_limits(
    plan: Plan, cfg: PipelineConfig, compiled_binaries: list[dict], lut_bytes: int
) -> list[LimitCheck]:
    """The limits against a built bundle: the binaries' real sizes and the compile stage's weights +
    I/O per binary, plus the plan's intermediates and spill-fill (only the compiler knows those)."""
    planned = {b.file: b for b in plan.binaries}
    binaries = []
    for b in compiled_binaries:
        p = planned[b["file"]]
        activations = p.estimated_allocation - p.weight_bytes
        graphs = [g["name"] for g in b["graphs"]]
        allocation = b.get("estimated_allocation_bytes", b["bytes"]) + activations
        binaries.append(BinaryPlan(b["file"], p.part, graphs, b["bytes"], allocation))
    pinned = sum(b.weight_bytes for b in binaries) + lut_bytes + plan.kv_cache_bytes
    mapped = sum(b.estimated_allocation for b in binaries)
    return limit_checks(cfg, binaries, mapped, pinned, pinned + plan.four_bit_weight_bytes)


# What nobody here can settle without a phone; each verdict below says which of these it rests on.
UNVERIFIED_PD = (
    "whether QNN under Genie on this SoC spreads contexts over several process domains (then only "
    "the per-context limit binds)"
)
UNVERIFIED_PINNED = "the real resident limit of the phone (the budget is an estimate)"
UNVERIFIED_4BIT = (
    "whether the runtime keeps 4-bit weights packed in memory or unpacks them at load (then the "
    "bundle pins {unpacked} instead)"
)


def limit_checks(
    cfg: PipelineConfig, binaries: list[BinaryPlan], mapped: int, pinned: int, pinned_unpacked: int
) -> list[LimitCheck]:
    """The config's needs against the SoC table's memory limits, one verdict each. `pinned_unpacked`
    is the pinned figure if 4-bit weights were held at 8 bits."""
    limits = cfg.soc_info.limits
    largest = max(binaries, key=lambda b: b.estimated_allocation)
    checks = [
        LimitCheck(
            limit=f"per-context allocation limit ({largest.file})",
            needed_bytes=largest.estimated_allocation,
            limit_bytes=limits.context_allocation.bytes,
            meets=largest.estimated_allocation <= limits.context_allocation.bytes,
            source=limits.context_allocation.source,
            unverified="our estimate of the allocation; the compiler's own figure is not public",
        ),
        LimitCheck(
            limit="single-process-domain address space (every ctx-bin mapped)",
            needed_bytes=mapped,
            limit_bytes=limits.process_domain.bytes,
            meets=mapped <= limits.process_domain.bytes,
            source=limits.process_domain.source,
            unverified=UNVERIFIED_PD,
        ),
    ]
    for phone in limits.phones:
        note = UNVERIFIED_PINNED
        if pinned_unpacked > pinned:
            note += "; " + UNVERIFIED_4BIT.format(unpacked=_size(pinned_unpacked))
        checks.append(
            LimitCheck(
                limit=f"RAM a bundle may pin ({phone.name})",
                needed_bytes=pinned,
                limit_bytes=phone.pinnable_bytes,
                meets=pinned <= phone.pinnable_bytes,
                source=phone.derivation,
                unverified=note,
                phone_ram_gib=phone.ram_gib,
            )
        )
    return checks


# ---- layouts side by side ----
# The prefill AR the layout table prices when the config itself has one graph kind: Genie's own
# bundles pair AR-128 with AR-1 (qai-hub-models; qualla's variant choice makes a third AR useless).
LAYOUT_PREFILL_AR = 128

# How Genie runs each layout (qualla KVCache/kvmanager.cpp prepareInferenceStrategy: it picks the
# smallest AR >= the tokens to process, else the largest, and pads the last chunk on that graph).
GENIE_SEPARATE = "prompt in AR-{p} chunks (last one padded), each new token through AR-{d}"
GENIE_ONE_KIND_SMALL = (
    "every prompt token is its own AR-{d} call: time to first token = prompt length / decode rate"
)
GENIE_ONE_KIND_LARGE = (
    "each new token is an AR-{p} call with 1 of {p} rows used: {p}x the compute per decoded token"
)


@dataclass
class LayoutPlan:
    name: str
    precision: str
    prefill_ar: int
    decode_ar: int
    graph_kinds: int
    binaries_bytes: int
    largest_allocation: int
    mapped_bytes: int
    pinned_bytes: int
    decode_tokens_per_s_ceiling: float
    quality_rank: int
    limits: dict[str, bool]
    genie: str
    fits: dict[int, bool]  # phone RAM (GB) -> every limit met
    is_config: bool


def layout_configs(cfg: PipelineConfig) -> list[tuple[PipelineConfig, str]]:
    """The config at every built precision the SoC runs, each with separate prefill and decode graphs
    and with one graph kind per part (at the decode AR, and at the prefill AR)."""
    d = cfg.decode_ar
    p = cfg.prefill_ar if cfg.separate_prefill_and_decode else min(LAYOUT_PREFILL_AR, cfg.max_context // 2)
    out = []
    for prec in usable_precisions(cfg.soc_info):
        base = dataclasses.replace(cfg, precision=prec.name)
        kinds = [(d, d, GENIE_ONE_KIND_SMALL)]
        if p > d:
            kinds = [(p, d, GENIE_SEPARATE), *kinds, (p, p, GENIE_ONE_KIND_LARGE)]
        for pa, da, how in kinds:
            out.append((dataclasses.replace(base, prefill_ar=pa, decode_ar=da), how.format(p=pa, d=da)))
    return out


def _layout_name(cfg: PipelineConfig) -> str:
    if cfg.separate_prefill_and_decode:
        return f"{cfg.precision}, prefill AR-{cfg.prefill_ar} + decode AR-{cfg.decode_ar}"
    return f"{cfg.precision}, one graph kind AR-{cfg.prefill_ar}"


def make_layouts(geo: Geometry, cfg: PipelineConfig) -> list[LayoutPlan]:
    out = []
    for variant, how in layout_configs(cfg):
        plan = make_plan(geo, variant)
        phones = [c.phone_ram_gib for c in plan.limits if c.phone_ram_gib]
        out.append(
            LayoutPlan(
                name=_layout_name(variant),
                precision=variant.precision,
                prefill_ar=variant.prefill_ar,
                decode_ar=variant.decode_ar,
                graph_kinds=len(graph_kinds(variant)),
                binaries_bytes=sum(b.weight_bytes for b in plan.binaries),
                largest_allocation=max(b.estimated_allocation for b in plan.binaries),
                mapped_bytes=plan.mapped_bytes,
                pinned_bytes=plan.device_bytes,
                decode_tokens_per_s_ceiling=plan.decode_tokens_per_s_ceiling,
                quality_rank=variant.precision_info.quality_rank,
                limits={c.limit: c.meets for c in plan.limits},
                genie=how,
                fits={ram: plan.fits(ram) for ram in phones},
                is_config=(variant.precision, variant.prefill_ar, variant.decode_ar)
                == (cfg.precision, cfg.prefill_ar, cfg.decode_ar),
            )
        )
    return out


def recommended_layout(layouts: list[LayoutPlan], phone_ram_gib: int) -> LayoutPlan | None:
    """The most accurate layout that fits a phone with this much RAM; among equals, separate prefill
    and decode graphs (fast prompts and fast decoding), then one kind at the decode AR (fast decoding),
    then the smaller binaries (int4 per channel over LPBQ, which ranks level with it)."""
    fitting = [lay for lay in layouts if lay.fits.get(phone_ram_gib)]
    if not fitting:
        return None
    return min(
        fitting, key=lambda lay: (lay.quality_rank, -lay.graph_kinds, lay.prefill_ar, lay.binaries_bytes)
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


def render_plan(plan: Plan, layouts: list[LayoutPlan] | None = None) -> str:
    out = [
        f"Plan: {plan.model} on {plan.soc} ({plan.dsp_arch}), {plan.precision} "
        f"({plan.weight_scheme} decoder weights), KV {plan.kv_cache_bits}-bit",
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
    out += ["", "Graphs (estimated allocation = weights + I/O + widest layer's intermediates + spill-fill)"]
    out += _table(
        [
            [
                g.name,
                g.role,
                str(g.ar),
                str(g.kv_inputs),
                _mib(g.bytes),
                _mib(g.allocation["io"]),
                _mib(g.allocation["intermediates"] + g.allocation["spill_fill"]),
                _mib(g.allocation["total"]),
            ]
            for g in plan.graphs
        ],
        ["graph", "role", "AR", "KV in", "weights", "I/O", "interm.+spill", "est. alloc"],
        text_columns=2,
    )
    out += ["", "Device memory"]
    rows = [[f"{k} LUT", _mib(v)] for k, v in plan.luts.items()]
    rows += [
        ["KV cache (sliding layers windowed)", _mib(plan.kv_cache_bytes)],
        ["KV cache (every layer full length)", _mib(plan.kv_cache_bytes_without_window)],
        ["pinned, weight-shared binaries", _gib(plan.device_bytes_shared_weights)],
        ["pinned, separate prefill/decode binaries", _gib(plan.device_bytes_separate_binaries)],
        [f"pinned on {plan.soc} (binaries + LUTs + KV)", _gib(plan.device_bytes)],
        ["mapped by Genie (every ctx-bin's est. allocation)", _gib(plan.mapped_bytes)],
    ]
    out += _table(rows, ["what", "bytes"])
    out += ["", f"Limits of {plan.soc}"]
    out += render_limits(plan.limits)
    out += [
        "",
        f"Decode roofline: {plan.decode_bytes_per_token / 1e9:.2f} GB read per token at "
        f"{plan.bandwidth['gb_per_s']} GB/s ({plan.bandwidth['dram']}) -> at most "
        f"{plan.decode_tokens_per_s_ceiling} tokens/s",
    ]
    if layouts:
        out += ["", "Layouts side by side (same model, SoC and context)"]
        out += render_layouts(layouts)
    if plan.warnings:
        out += ["", "Warnings"] + [f"  ! {w}" for w in plan.warnings]
    return "\n".join(out)


def _size(n: int) -> str:
    return _gib(n) if n >= GIB // 10 else _mib(n)


def render_limits(limits: list[LimitCheck]) -> list[str]:
    rows = [
        [c.limit, _size(c.needed_bytes), _size(c.limit_bytes), "meets" if c.meets else "OVER"] for c in limits
    ]
    out = _table(rows, ["limit", "needs", "limit", "verdict"])
    out += ["  sources and what only a phone can settle:"]
    for c in limits:
        out.append(f"  - {c.limit}: {c.source}")
        if c.unverified:
            out.append(f"    unverified: {c.unverified}")
    return out


def render_layouts(layouts: list[LayoutPlan]) -> list[str]:
    phones = sorted({ram for lay in layouts for ram in lay.fits})
    rows = []
    for lay in layouts:
        rows.append(
            [
                ("* " if lay.is_config else "  ") + lay.name,
                _gib(lay.binaries_bytes),
                _gib(lay.largest_allocation),
                _gib(lay.mapped_bytes),
                _gib(lay.pinned_bytes),
                f"{lay.decode_tokens_per_s_ceiling}",
                *["fits" if lay.fits[ram] else "no" for ram in phones],
            ]
        )
    header = ["layout (* = this config)", "binaries", "largest ctx", "mapped", "pinned", "tok/s max"]
    out = _table(rows, header + [f"{ram} GB" for ram in phones])
    for ram in phones:
        best = recommended_layout(layouts, ram)
        out.append(
            f"  most accurate layout that fits a phone with {ram} GB: {best.name if best else 'none'}"
            + (f" (Genie: {best.genie})" if best else "")
        )
    return out
