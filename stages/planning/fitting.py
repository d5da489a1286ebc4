"""What a pipeline config will produce, priced before anything runs: the model the stages fit against
(export builds a `Job` and refuses what `over_context_limit` names) and `g4v69 plan`
reports (stages/planning/plan.py).

Counts come from the model geometry (every weight tensor), bytes from the quantization scheme each kind
of tensor gets (stages/core/precision.py), limits and bandwidth from the SoC table. Nothing here is
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

Speed is priced as a roofline per graph kind: one call through every part reads its weights, I/O (KV
cache included) and LUT rows from DRAM and computes 2 x AR x weights plus attention operations; it
takes at least the longer of bytes / bandwidth and operations / the HTP's peak (SoC table, estimates).
Decode tokens/s, prefill tokens/s and time to first token follow from how Genie calls each layout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from stages.core.config import PipelineConfig
from stages.core.precision import usable_precisions
from stages.core.soc import GIB, MIB
from stages.model.contract import cache_kind, cache_slots
from stages.model.geometry import FULL, LINEAR, SLIDING, Geometry, Tensor
from stages.model.graphs import GraphKind, graph_name, part_name
from stages.planning.job import Job, part_extras, tensor_bytes, weight_scheme

# The token embedding LUT export writes: ufixed16 rows (stages/export.py).
EMBEDDING_LUT_BITS = 16

# How Genie holds the LUT files, measured on QAIRT 2.51's x86 libGenie.so (strace of GenieDialog_create
# and a query on the tiny bundle): each LUT file is memory-mapped whole, read-only (mmap MAP_PRIVATE of
# the file's size), after one read of its tail; rows become resident only as tokens touch them, as
# file-backed pages the OS may drop. With 1 GiB appended to the per-layer LUT the process's peak RSS
# moved by 0.3 MiB. (Genie's public source, qualla encoders/LUT.cpp through
# ResourceManager::getBuffer, reads a file into a heap buffer: not what 2.51 does.) The plan still
# counts the LUTs whole as pinned, an upper bound: what a long chat touches is far less.
LUT_RESIDENCY = (
    "memory-mapped whole, read-only, at load (measured: QAIRT 2.51 libGenie.so, strace; peak RSS "
    "unchanged with 1 GiB appended to a LUT): only touched rows become resident, as file-backed pages; "
    "counted whole here as an upper bound"
)
# Measured on QAIRT 2.51's libGenie.so (docs/fitting.md, "A 4-bit per-layer LUT"): the perlayer-embedding
# section takes a ufixed4 LUT, the even entry in the low nibble, requantized into the ufixed8 input.
PLE_LUT_4BIT_NOTE = (
    "ple_lut_bits=4 builds it (QAIRT 2.51's Genie takes a ufixed4 perlayer-embedding LUT, measured); "
    "the LUT alone costs the tiny model KL 0.0014, top-1 0.972 (8-bit: 0.00001, 0.994), and Genie maps "
    "LUTs, so it saves bundle size more than memory (docs/fitting.md)"
)


def fmt_gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def fmt_mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def fmt_size(n: int) -> str:
    """Bytes in GiB, or in MiB below a tenth of one."""
    return fmt_gib(n) if n >= GIB // 10 else fmt_mib(n)


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
class CallCost:
    """One call of a graph kind through every part, at best on this SoC: bytes read from DRAM
    (weights, I/O with the KV cache, spill-fill written and read back, LUT rows) and operations
    (2 per multiply-accumulate); its time is the longer of the memory time and the compute time."""

    role: str
    ar: int
    bytes: int
    ops: int
    memory_s: float
    compute_s: float | None  # None: the SoC table has no compute figure (memory time alone)

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s or 0.0)

    @property
    def bound(self) -> str:
        return "compute" if (self.compute_s or 0.0) > self.memory_s else "memory"

    def to_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds, "bound": self.bound}


@dataclass
class Plan:
    model: str
    soc: str
    dsp_arch: str
    precision: str
    weight_scheme: str
    kv_cache_bits: int
    max_context: int
    usable_context: int  # tokens a conversation holds in this job's graph kinds (Runtime.usable_context)
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
    decode_bytes_per_token: int  # one decode call: every part's weights, I/O and KV, LUT rows
    decode_tokens_per_s_ceiling: float
    bandwidth: dict
    calls: list[CallCost]  # the roofline of one call per graph kind
    calls_by_ar: list[CallCost]  # the same at each AR of the layout table, at this precision
    compute: dict  # the SoC's HTP peak figures with their source ({} when the table has none)
    prefill_tokens_per_s: float
    ttft_s: dict[int, float]  # prompt tokens -> estimated time to first token
    lut_residency: str
    per_layer_lut_4bit_bytes: int  # the per-layer LUT at 4 bits where ple_lut_bits is more (else 0)
    job_disk_bytes: int  # what a full run of this config writes to WORKDIR, roughly
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["calls"] = [c.to_dict() for c in self.calls]
        d["calls_by_ar"] = [c.to_dict() for c in self.calls_by_ar]
        return d

    def fits(self, phone_ram_gib: int) -> bool:
        """Every SoC limit met, and the phone budget of a phone with this much RAM."""
        return all(c.meets for c in self.limits if c.phone_ram_gib in (0, phone_ram_gib))


def kv_slots(geo: Geometry, attention: str, cfg: PipelineConfig, windowed: bool = True) -> int:
    if cache_kind(geo, attention) == FULL or not windowed:
        return cfg.max_context
    return min(geo.sliding_window, cfg.max_context)


def kv_cache_bytes(geo: Geometry, cfg: PipelineConfig, windowed: bool = True) -> int:
    total = 0
    for layer in geo.layers:
        if layer.owns_kv:
            per_slot = 2 * geo.num_kv_heads * layer.head_dim * cfg.kv_cache_bits // 8
            total += per_slot * kv_slots(geo, layer.attention, cfg, windowed)
    return total


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
    io += ar * ctx * act  # the masks
    if cache_kind(geo, SLIDING) == SLIDING:
        io += ar * (min(geo.sliding_window, ctx - ar) + ar) * act
    io += 2 * ar * (full_dim + slide_dim) // 2 * act  # cos and sin of both RoPE tables
    donors_from_outside = set()
    for li in layers:
        layer = geo.layers[li]
        per_token = 2 * geo.num_kv_heads * layer.head_dim * kv
        if layer.owns_kv:
            io += per_token * (cache_slots(geo, layer.attention, cfg.max_context, ar) + ar)
        elif layer.kv_donor not in layers:
            donors_from_outside.add(layer.kv_donor)
    for d in donors_from_outside:
        donor = geo.layers[d]
        io += (
            2
            * geo.num_kv_heads
            * donor.head_dim
            * kv
            * (cache_slots(geo, donor.attention, cfg.max_context, ar) + ar)
        )
    if last:
        io += ar * geo.vocab_size * act
    widest = 0
    for li in layers:
        layer = geo.layers[li]
        span = cache_slots(geo, layer.attention, cfg.max_context, ar) + ar
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


def lut_row_bytes(geo: Geometry, cfg: PipelineConfig) -> int:
    """What Genie copies out of the LUTs per token: one embedding row and one per-layer row."""
    row = geo.hidden_size * EMBEDDING_LUT_BITS // 8
    if geo.ple_table is not None:
        row += geo.ple_table.shape[1] * cfg.ple_lut_bits // 8
    return row


def attention_ops(geo: Geometry, cfg: PipelineConfig, ar: int) -> int:
    """Operations of Q.K^T and probabilities.V in every layer at AR tokens per call, over every cache
    slot the static-shape graph reads (a masked slot costs what a used one does)."""
    total = 0
    for layer in geo.layers:
        span = cache_slots(geo, layer.attention, cfg.max_context, ar) + ar
        total += 2 * 2 * ar * span * geo.num_attention_heads * layer.head_dim
    return total


def call_cost(
    geo: Geometry, cfg: PipelineConfig, kind: GraphKind, params: int, allocations: list[Allocation]
) -> CallCost:
    """The roofline of one call of a graph kind through every part (`allocations`: its graphs', one
    per part; `params`: the weights in the graphs, each one multiply-accumulate per row)."""
    soc = cfg.soc_info
    read = sum(a.weights + a.io + 2 * a.spill_fill for a in allocations) + kind.ar * lut_row_bytes(geo, cfg)
    ops = 2 * kind.ar * params + attention_ops(geo, cfg, kind.ar)
    compute_s = None
    if soc.compute is not None:
        compute_s = ops / soc.compute.ops_per_s(cfg.precision_info.activation_bits)
    return CallCost(kind.role, kind.ar, read, ops, read / (soc.memory.gb_per_s * 1e9), compute_s)


def prompt_seconds(calls: list[CallCost], tokens: int) -> float:
    """How long Genie takes over a prompt (qualla KVCache/kvmanager.cpp prepareInferenceStrategy):
    the smallest AR >= the tokens, else the largest, in chunks of that AR, the last one padded. The
    last call's logits give the first token, so this is the time to first token."""
    by_ar = {c.ar: c for c in calls}
    ar = min((a for a in by_ar if a >= tokens), default=max(by_ar))
    return math.ceil(tokens / ar) * by_ar[ar].seconds


# Prompt lengths the plan prices the time to first token for (the config's own is added).
TTFT_PROMPTS = (128, 512, 2048)


def ttft_prompts(cfg: PipelineConfig) -> list[int]:
    return sorted({*TTFT_PROMPTS, cfg.ttft_prompt_tokens})


# GPTQ keeps a full Hessian (float32, in x in) of each MatMul input up to this width and only its
# diagonal above: E2B's 12,288-wide MLP down projections would take 604 MB each (stages/quant/gptq.py).
FULL_HESSIAN_MAX_WIDTH = 8192


def hessian_shape(width: int) -> tuple[int, ...]:
    """The shape of the Hessian GPTQ keeps for a MatMul input `width` wide: the full matrix, or its
    diagonal alone above FULL_HESSIAN_MAX_WIDTH."""
    return (width,) if width > FULL_HESSIAN_MAX_WIDTH else (width, width)


def hessian_bytes(geo: Geometry, cfg: PipelineConfig) -> int:
    """What quantize keeps of the calibration Hessians on disk (memory-mapped files in its output
    folder while it runs, between the rounding and the scale search): one float32 Hessian per distinct
    MatMul input of each decoder layer (q/k/v share one, gate/up another). Only `gptq-search` keeps
    them (`WeightRounder.round_all`); plain GPTQ drops them after rounding, and 8-bit weights or
    round-to-nearest never collect any."""
    if cfg.decoder_scheme.bits != 4 or cfg.weight_rounding != "gptq-search":
        return 0
    total = 0
    for layer in geo.layers:
        inputs = {(t.shape[1], t.name.rsplit(".", 2)[0]) for t in layer.tensors if t.kind == LINEAR}
        total += sum(4 * math.prod(hessian_shape(w)) for w, _ in inputs)
    return total


def job_disk_bytes(
    geo: Geometry,
    cfg: PipelineConfig,
    parts: list[PartPlan],
    graphs: list[GraphPlan],
    luts: dict[str, int],
    in_graphs: int,
) -> int:
    """Rough disk a full run writes to WORKDIR: checkpoint (bf16), float32 export (with the calibration
    twins, which stay: quantize reads them again on a rerun), quantized graphs (QDQ ONNX and their
    weights) and the GPTQ Hessians quantize holds on disk while it runs, binaries, bundle."""
    from stages.model.graphs import calibration_kind

    checkpoint = geo.total_params * 2
    exported = in_graphs * 4 + sum(luts.values())
    if calibration_kind(cfg):  # the calibration twins: one more float copy of every part
        exported += 4 * in_graphs
    quantized = sum(p.bytes for p in parts) * 2 + hessian_bytes(geo, cfg)
    compiled = sum(g.bytes for g in graphs)
    bundle = compiled + sum(luts.values())
    return checkpoint + exported + quantized + compiled + bundle


def _part_plans(geo: Geometry, cfg: PipelineConfig, bounds: list[range]) -> tuple[list[PartPlan], int]:
    """Each part's weights priced at the config's precision, and the bytes of 4-bit weights in them
    (what unpacking them to 8 bits would add)."""
    head, tail = part_extras(geo)
    parts: list[PartPlan] = []
    four_bit = 0
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
    return parts, four_bit


def _graph_plans(
    job: Job, geo: Geometry, cfg: PipelineConfig, parts: list[PartPlan], bounds: list[range]
) -> tuple[list[GraphPlan], dict[str, Allocation]]:
    """Every shipped graph with its estimated allocation, by graph name."""
    graphs: list[GraphPlan] = []
    allocations: dict[str, Allocation] = {}
    for kind in job.kinds:
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
    return graphs, allocations


def _binary_plans(job: Job, parts: list[PartPlan], allocations: dict[str, Allocation]) -> list[BinaryPlan]:
    """The context binaries, each with its weights and estimated allocation. A weight-shared binary
    holds its part's weights once; its graphs never run at the same time, so the largest one's
    activations bound the rest."""
    binaries = []
    for b in job.binaries:
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
    return binaries


def _lut_bytes(geo: Geometry, cfg: PipelineConfig) -> dict[str, int]:
    luts = {"embedding": geo.embedding.numel * EMBEDDING_LUT_BITS // 8}
    if geo.ple_table is not None:
        luts["per_layer_embedding"] = geo.ple_table.numel * cfg.ple_lut_bits // 8
    return luts


def _plan_warnings(
    cfg: PipelineConfig, extra_separate: int, luts: dict[str, int], limits: list[LimitCheck]
) -> list[str]:
    """What the plan warns about: weights stored twice without weight sharing (`extra_separate`
    bytes), a LUT the config's runtime cannot load (`Runtime.lut_problems`), every limit not met."""
    from stages.runtimes import get_runtime

    soc = cfg.soc_info
    warnings = []
    if cfg.separate_prefill_and_decode and not soc.weight_sharing:
        warnings.append(
            f"{soc.name} ({soc.dsp_arch}) has no weight sharing: prefill and decode binaries each "
            f"carry their own weights ({fmt_gib(extra_separate)} more on the device); set "
            f"PREFILL_AR equal to DECODE_AR to ship one graph per part instead"
        )
    warnings += get_runtime(cfg.runtime).lut_problems(luts)
    warnings += [
        f"over the {c.limit}: {fmt_gib(c.needed_bytes)} > {fmt_gib(c.limit_bytes)}"
        for c in limits
        if not c.meets
    ]
    return warnings


def plan_config(geo: Geometry, cfg: PipelineConfig) -> Plan:
    """The job `cfg` builds on this geometry, priced: what `make plan` and the checks before a run
    price (export prices the job it builds and records, `make_plan`)."""
    return make_plan(Job.build(geo, cfg, specs=False), geo, cfg)


def _call_costs(
    job: Job, geo: Geometry, cfg: PipelineConfig, parts: list[PartPlan], allocations: dict[str, Allocation]
) -> tuple[list[CallCost], list[CallCost]]:
    """The roofline of one call of each of the job's graph kinds, and of one call at each AR of
    LAYOUT_ARS: a call reads every part's weights and I/O (the KV cache at full context)."""
    in_graphs = sum(p.params for p in parts)

    def calls_at(kind: GraphKind) -> CallCost:
        names = [graph_name(kind, i, len(parts)) for i in range(1, len(parts) + 1)]
        allocs = [
            allocations[n]
            if n in allocations
            else graph_allocation(geo, cfg, r, i == len(parts), kind.ar, p.bytes)
            for i, (n, r, p) in enumerate(zip(names, job.part_ranges, parts, strict=True), start=1)
        ]
        return call_cost(geo, cfg, kind, in_graphs, allocs)

    calls = [calls_at(kind) for kind in job.kinds]
    return calls, [calls_at(GraphKind("any", ar)) for ar in LAYOUT_ARS if ar < cfg.max_context]


def make_plan(job: Job, geo: Geometry, cfg: PipelineConfig) -> Plan:
    """A job priced on its geometry at its config's precision and SoC: its parts, graphs and binaries
    (`_part_plans`, `_graph_plans`, `_binary_plans`), memory, each graph kind's call cost, the limits
    and warnings. Nothing of the job is derived again here: its parts, kinds and binaries are read."""
    soc = cfg.soc_info
    bounds = job.part_ranges
    parts, four_bit = _part_plans(geo, cfg, bounds)
    graphs, allocations = _graph_plans(job, geo, cfg, parts, bounds)
    binaries = _binary_plans(job, parts, allocations)
    luts = _lut_bytes(geo, cfg)

    kv = kv_cache_bytes(geo, cfg)
    shared = sum(p.bytes for p in parts)
    separate = sum(g.bytes for g in graphs)
    host_side = sum(luts.values()) + kv
    device_shared = shared + host_side
    device_separate = separate + host_side
    device = sum(b.weight_bytes for b in binaries) + host_side
    mapped = sum(b.estimated_allocation for b in binaries)

    in_graphs = sum(p.params for p in parts)
    calls, by_ar = _call_costs(job, geo, cfg, parts, allocations)
    # The smallest AR decodes (one token per call), the largest takes the prompt.
    decode = min(calls, key=lambda c: c.ar)
    prefill = max(calls, key=lambda c: c.ar)
    param_counts = {
        "total": geo.total_params,
        "embedding": geo.embedding.numel,
        "per_layer_embedding_table": geo.ple_table.numel if geo.ple_table else 0,
        "ple_projection": sum(t.numel for t in geo.ple_projection),
        "decoder_layers": sum(layer.numel for layer in geo.layers),
        "in_graphs": in_graphs,
    }

    from stages.runtimes import get_runtime

    usable = get_runtime(cfg.runtime).usable_context(geo, cfg.max_context, [k.ar for k in job.kinds])
    four_bit *= len(binaries) // len(parts)  # each part's weights are stored this many times
    limits = limit_checks(cfg, binaries, mapped, device, device + four_bit)
    warnings = _plan_warnings(cfg, separate - shared, luts, limits)

    return Plan(
        model=cfg.model,
        soc=soc.name,
        dsp_arch=soc.dsp_arch,
        precision=cfg.precision,
        weight_scheme=cfg.decoder_scheme.name,
        kv_cache_bits=cfg.kv_cache_bits,
        max_context=cfg.max_context,
        usable_context=usable,
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
        decode_bytes_per_token=decode.bytes,
        decode_tokens_per_s_ceiling=round(1 / decode.seconds, 1),
        bandwidth={"gb_per_s": soc.memory.gb_per_s, "dram": soc.memory.dram, "source": soc.memory.source},
        calls=calls,
        calls_by_ar=by_ar,
        compute=asdict(soc.compute) if soc.compute else {},
        prefill_tokens_per_s=round(prefill.ar / prefill.seconds, 1),
        ttft_s={n: prompt_seconds(calls, n) for n in ttft_prompts(cfg)},
        lut_residency=LUT_RESIDENCY,
        per_layer_lut_4bit_bytes=geo.ple_table.numel // 2
        if geo.ple_table is not None and cfg.ple_lut_bits > 4
        else 0,
        job_disk_bytes=job_disk_bytes(geo, cfg, parts, graphs, luts, in_graphs),
        warnings=warnings,
    )


def over_context_limit(geo: Geometry, cfg: PipelineConfig, plan: Plan | None = None) -> str:
    """Empty if every binary's estimated allocation is within the SoC's per-context limit; otherwise
    one line naming the largest binary and the smallest num_shards whose parts all fit. `plan`: the
    config's own, where the caller has priced it already."""
    limit = cfg.soc_info.limits.context_allocation.bytes
    plan = plan or plan_config(geo, cfg)
    worst = max(plan.binaries, key=lambda b: b.estimated_allocation)
    if worst.estimated_allocation <= limit:
        return ""
    fitting = next(
        (
            n
            for n in range(cfg.num_shards + 1, geo.num_layers + 1)
            if max(
                b.estimated_allocation
                for b in plan_config(geo, dataclasses.replace(cfg, num_shards=n)).binaries
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
    plan: Plan, cfg: PipelineConfig, compiled_binaries: list[Any], lut_bytes: int
) -> list[LimitCheck]:
    """The limits against a built bundle: the binaries' real sizes and the compile stage's weights +
    I/O per binary, plus the plan's intermediates and spill-fill (only the compiler knows those).
    `compiled_binaries`: `CompileResult.binaries` (not imported: the results import the job, which
    imports this module)."""
    planned = {b.file: b for b in plan.binaries}
    binaries = []
    for b in compiled_binaries:
        p = planned[b.file]
        activations = p.estimated_allocation - p.weight_bytes
        graphs = [g.name for g in b.graphs]
        own = b.estimated_allocation_bytes if b.estimated_allocation_bytes is not None else b.bytes
        binaries.append(BinaryPlan(b.file, p.part, graphs, b.bytes, own + activations))
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
            note += "; " + UNVERIFIED_4BIT.format(unpacked=fmt_size(pinned_unpacked))
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
# The ARs the layout table prices: one graph kind at each, and each above 1 as a separate prefill kind
# beside an AR-1 decode kind. Genie's own bundles pair AR-128 with AR-1 (qai-hub-models); qualla's
# variant choice (smallest AR >= the tokens, else the largest) makes a third kind useless.
LAYOUT_ARS = (1, 2, 4, 8, 16, 32, 64, 128)

# The layout rule, stated once: `rule_layout` applies it, `make plan` prints it.
LAYOUT_RULE = (
    "among the layouts the runtime accepts that fit every memory limit of the target phone and meet "
    "both targets (estimated time to first token and decode rate): the most accurate precision; then "
    "the least compute per decoded token (the smallest decode AR); then the smallest prefill AR; then "
    "the least pinned memory"
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
    decode_bound: str  # "memory" or "compute"
    prefill_tokens_per_s: float
    ttft_s: dict[int, float]  # prompt tokens -> estimated time to first token
    usable_context: int  # tokens a conversation holds (Plan.usable_context)
    quality_rank: int
    limits: dict[str, bool]
    genie: str
    fits: dict[int, bool]  # phone RAM (GB) -> every limit met
    is_config: bool


def layout_configs(geo: Geometry, cfg: PipelineConfig) -> list[tuple[PipelineConfig, str]]:
    """The config at every built precision the SoC runs, in one graph kind per part at each AR of
    LAYOUT_ARS and with separate prefill (each AR above 1) and AR-1 decode graphs, plus the config's
    own layout; only layouts the config's runtime accepts for this model (`Runtime.layout_problems`),
    each with how that runtime runs it (`Runtime.describe_layout`)."""
    from stages.runtimes import get_runtime

    runtime = get_runtime(cfg.runtime)
    ars = [ar for ar in LAYOUT_ARS if ar < cfg.max_context]
    pairs = {(ar, ar) for ar in ars} | {(ar, 1) for ar in ars if ar > 1} | {(cfg.prefill_ar, cfg.decode_ar)}
    out = []
    for prec in usable_precisions(cfg.soc_info):
        base = dataclasses.replace(cfg, precision=prec.name)
        for pa, da in sorted(pairs, key=lambda pd: (pd[0] == pd[1], pd[0])):
            variant = dataclasses.replace(base, prefill_ar=pa, decode_ar=da)
            if runtime.layout_problems(variant, geo):
                continue
            out.append((variant, runtime.describe_layout(pa, da)))
    return out


def _layout_name(cfg: PipelineConfig) -> str:
    if cfg.separate_prefill_and_decode:
        return f"{cfg.precision}, prefill AR-{cfg.prefill_ar} + decode AR-{cfg.decode_ar}"
    return f"{cfg.precision}, one graph kind AR-{cfg.prefill_ar}"


def quality_rank(cfg: PipelineConfig) -> int:
    """The precision's quality rank (lower: closer to the float model), one better where the model is
    a known QAT checkpoint whose grid the precision keeps (checkpoint_grid=keep): a grid with groups
    needs block scales (LPBQ), a per-channel grid any 4-bit scheme. Measured on the tiny QAT fixtures
    (docs/fitting.md, "A QAT source"): the group grid kept as LPBQ, KL 0.0121 against 0.0231 rounded
    again."""
    from stages.model.geometry import KNOWN_QAT_GROUPS

    rank = cfg.precision_info.quality_rank
    model = cfg.model.lower()
    if cfg.checkpoint_grid != "keep" or model not in KNOWN_QAT_GROUPS or cfg.decoder_scheme.bits != 4:
        return rank
    keeps = cfg.decoder_scheme.blockwise or KNOWN_QAT_GROUPS[model] is None
    return rank - 1 if keeps else rank


def make_layouts(geo: Geometry, cfg: PipelineConfig) -> list[LayoutPlan]:
    out = []
    for variant, how in layout_configs(geo, cfg):
        job = Job.build(geo, variant, specs=False)
        plan = make_plan(job, geo, variant)
        phones = [c.phone_ram_gib for c in plan.limits if c.phone_ram_gib]
        decode = min(plan.calls, key=lambda c: c.ar)
        out.append(
            LayoutPlan(
                name=_layout_name(variant),
                precision=variant.precision,
                prefill_ar=variant.prefill_ar,
                decode_ar=variant.decode_ar,
                graph_kinds=len(job.kinds),
                binaries_bytes=sum(b.weight_bytes for b in plan.binaries),
                largest_allocation=max(b.estimated_allocation for b in plan.binaries),
                mapped_bytes=plan.mapped_bytes,
                pinned_bytes=plan.device_bytes,
                decode_tokens_per_s_ceiling=plan.decode_tokens_per_s_ceiling,
                decode_bound=decode.bound,
                prefill_tokens_per_s=plan.prefill_tokens_per_s,
                ttft_s=plan.ttft_s,
                usable_context=plan.usable_context,
                quality_rank=quality_rank(variant),
                limits={c.limit: c.meets for c in plan.limits},
                genie=how,
                fits={ram: plan.fits(ram) for ram in phones},
                is_config=(variant.precision, variant.prefill_ar, variant.decode_ar)
                == (cfg.precision, cfg.prefill_ar, cfg.decode_ar),
            )
        )
    return out


def recommended_layout(layouts: list[LayoutPlan], phone_ram_gib: int) -> LayoutPlan | None:
    """The most accurate layout that fits a phone with this much RAM, whatever its speed; among
    equals, separate prefill and decode graphs (fast prompts and fast decoding), then one kind at
    the smallest AR (least compute per decoded token), then the smaller binaries (int4 per channel
    over LPBQ, which ranks level with it)."""
    fitting = [lay for lay in layouts if lay.fits.get(phone_ram_gib)]
    if not fitting:
        return None
    return min(
        fitting, key=lambda lay: (lay.quality_rank, -lay.graph_kinds, lay.prefill_ar, lay.binaries_bytes)
    )


class LayoutRuleError(ValueError):
    """No priced layout meets the config's layout targets; the message says how close they come."""


def _targets(cfg: PipelineConfig) -> str:
    return (
        f"time to first token <= {cfg.max_ttft_s:g} s for a {cfg.ttft_prompt_tokens}-token prompt and "
        f">= {cfg.min_decode_tokens_per_s:g} decoded tokens/s within the {cfg.target_phone_ram_gb} GB "
        "phone's memory budget"
    )


def meets_targets(lay: LayoutPlan, cfg: PipelineConfig) -> bool:
    return (
        bool(lay.fits.get(cfg.target_phone_ram_gb))
        and cfg.ttft_prompt_tokens < lay.usable_context
        and lay.ttft_s[cfg.ttft_prompt_tokens] <= cfg.max_ttft_s
        and lay.decode_tokens_per_s_ceiling >= cfg.min_decode_tokens_per_s
    )


def rule_layout(layouts: list[LayoutPlan], cfg: PipelineConfig) -> LayoutPlan:
    """The layout LAYOUT_RULE picks for the config's targets; LayoutRuleError when none meets them."""
    if cfg.ttft_prompt_tokens >= cfg.max_context:
        raise LayoutRuleError(
            f"ttft_prompt_tokens {cfg.ttft_prompt_tokens} leaves no room for a reply in max_context "
            f"{cfg.max_context}; allowed values: 1..{cfg.max_context - 1}"
        )
    meeting = [lay for lay in layouts if meets_targets(lay, cfg)]
    if meeting:
        return min(
            meeting, key=lambda lay: (lay.quality_rank, lay.decode_ar, lay.prefill_ar, lay.pinned_bytes)
        )
    phones = sorted({ram for lay in layouts for ram in lay.fits})
    if cfg.target_phone_ram_gb not in phones:
        raise LayoutRuleError(
            f"target_phone_ram_gb {cfg.target_phone_ram_gb} is not a phone class of {cfg.soc}; "
            f"allowed values: {', '.join(map(str, phones))}"
        )
    fitting = [lay for lay in layouts if lay.fits[cfg.target_phone_ram_gb]]
    if not fitting:
        raise LayoutRuleError(
            f"no layout fits the {cfg.target_phone_ram_gb} GB phone's memory budget at "
            f"max_context {cfg.max_context}: target a larger phone (target_phone_ram_gb) or lower max_context"
        )
    n = cfg.ttft_prompt_tokens
    fastest_prompt = min(fitting, key=lambda lay: lay.ttft_s[n])
    fastest_decode = max(fitting, key=lambda lay: lay.decode_tokens_per_s_ceiling)
    raise LayoutRuleError(
        f"no layout meets the targets ({_targets(cfg)}); of those that fit, the quickest first token is "
        f"{fastest_prompt.name} ({fastest_prompt.ttft_s[n]:.2f} s, "
        f"{fastest_prompt.decode_tokens_per_s_ceiling} tokens/s) and the fastest decode "
        f"{fastest_decode.name} ({fastest_decode.ttft_s[n]:.2f} s, "
        f"{fastest_decode.decode_tokens_per_s_ceiling} tokens/s): raise max_ttft_s, lower "
        "min_decode_tokens_per_s or target a larger phone"
    )
