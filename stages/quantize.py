"""The quantize stage: exported float graphs -> w8a16 QDQ graphs the target HTP can run, audited, with
a quality report.

- onnxruntime static quantization with its QNN configuration (`get_qnn_qdq_config`): activations
  uint16, weights int8 symmetric per output channel (an explicit axis per MatMul weight: onnxruntime
  leaves MatMul weights per-tensor otherwise), the lm_head included.
- The SoC rule for activation x activation MatMuls (Q.K^T, probs.V): without a 16x16 matmul (v69)
  the second operand, the KV cache, is 8-bit. Each owner layer's K (and V) cache input, its new
  entries, the concatenation the MatMul reads and the `kvshare_*` tensors that carry it to later parts
  get one encoding, from one calibrated range, so the runtime copies new entries into the cache
  without requantizing. SoCs with a 16x16 matmul keep KV at `kv_cache_bits`.
- The PLE policy: the in-graph per-layer-embedding paths stay float (float16 on the HTP; the default),
  or get int16 or int8 weights.
- The inputs Genie fills from host LUTs (`inputs_embeds`, `per_layer_inputs`) are read with exactly
  their LUT's encoding, whatever the PLE policy, so Genie copies LUT rows into them byte for byte
  (it has no path from a fixed-point LUT into a float input: `stages.encoding`). Under the float16
  policy the graph dequantizes `per_layer_inputs` right away and the PLE path after it stays float.
- Calibration (MinMax) streams graph inputs from the float chain on real text (`stages.calibration`);
  AR-1 prefill graphs calibrate through their twin at `calibration_ar` (same ranges up to rounding,
  except the attention scores before the mask, which the twin's chunk widens: `twin_tensor_names`).

Every quantized graph is audited (KV and activation-matmul bit widths, the PLE policy tensor by tensor,
no float tensor left outside the PLE policy); the stage fails if an audit fails.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stages.config import PipelineConfig, stage_fields
from stages.contract import (
    CACHE_PREFIX,
    HIDDEN_PREFIX,
    KVSHARE_PREFIX,
    LUT_INPUTS,
    PER_LAYER_EMBEDS,
    PER_LAYER_INPUTS,
    GraphSpec,
    constructed_input_ranges,
)
from stages.encoding import ONNX_TYPE_NAMES, Encoding, QdqGraph
from stages.gptq import Hessian, best_scales, collect_hessians, gptq
from stages.graphs import calibration_kind, copy_graph, qdq_file_name
from stages.pipeline import output_dir
from stages.precision import INT8_CHANNEL, LPBQ_BLOCK_SCALE_MAX
from stages.quality import EVAL_SAMPLES, SQNR_TOKENS, compare_chains, output_sqnr, write_quality_html
from stages.report import REPORT_NAME, check_inputs, read_report, stage_output
from stages.sensitivity import sensitivity_samples

# Ops that move or regroup values without changing them: a tensor and its image share an encoding.
ENCODING_PRESERVING = {"Concat", "Slice", "Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze"}
CACHE_TENSOR = re.compile(rf"^(?:{'|'.join(CACHE_PREFIX.values())})_(key|value)_(\d+)_h\d+_(?:in|out)$")
# Tensors that leave one part and enter the next (the kvshare ones are pinned with their cache).
BOUNDARY_TENSOR = re.compile(rf"^(?:{HIDDEN_PREFIX}\d+|{PER_LAYER_EMBEDS})$")
KVSHARE_TENSOR = re.compile(rf"^{KVSHARE_PREFIX}(key|value)_(\d+)$")
PLE_START_WEIGHTS = ("per_layer_model_projection.weight", "per_layer_input_gate.weight")
PLE_END_WEIGHT = "post_per_layer_input_norm.weight"
PLE_GRAPH_INPUTS = {PER_LAYER_INPUTS, PER_LAYER_EMBEDS}
# Weights of the PLE paths: the int16 policy gives these 16-bit.
PLE_WEIGHT_SUFFIXES = (
    "per_layer_model_projection.weight",
    "per_layer_projection_norm.weight",
    "per_layer_input_gate.weight",
    "per_layer_projection.weight",
    "post_per_layer_input_norm.weight",
)
DECODE_CALIBRATION_STEPS = 64
# GPTQ's Hessians come from the first calibration samples: 8 x 2048 tokens on the default preset
# (16k rows for at most 6,144-wide inputs; the reference implementation uses 128 x 2048).
HESSIAN_SAMPLES = 8


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    return getattr(CalibrationMethod, name)


# MinMax keeps running extremes (flat memory); the others keep every tensor of every call, so use a
# stride (calls per collection) with them on big graphs.
CALIBRATION_METHODS = {
    "minmax": lambda: _method("MinMax"),
    "entropy": lambda: _method("Entropy"),
    "percentile": lambda: _method("Percentile"),
}


class QuantizeError(ValueError):
    pass


# ---- graph analysis ----
@dataclass
class GraphAnalysis:
    act_matmuls: list[tuple[str, str]]  # (node, second input) of MatMuls with no weight input
    kv_groups: dict[tuple[str, int], set[str]]  # (key|value, layer) -> tensors sharing one encoding
    ple_nodes: list[str]
    matmul_weights: list[str]


def analyse(model) -> GraphAnalysis:
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[Any]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)

    act_matmuls, weights = [], []
    for n in graph.node:
        if n.op_type == "MatMul":
            if n.input[1] in inits:
                weights.append(n.input[1])
            elif n.input[0] not in inits:
                act_matmuls.append((n.name, n.input[1]))

    def group_of(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            t = todo.pop()
            if t in seen or t in inits or not t:
                continue
            seen.add(t)
            p = producer.get(t)
            if p is not None and p.op_type in ENCODING_PRESERVING:
                todo += list(p.input) if p.op_type == "Concat" else [p.input[0]]
            for c in consumers.get(t, []):
                if c.op_type in ENCODING_PRESERVING and (c.op_type == "Concat" or c.input[0] == t):
                    todo += list(c.output)
        return seen

    kv_groups: dict[tuple[str, int], set[str]] = {}
    for _, operand in act_matmuls:
        group = group_of(operand)
        keys = set()
        for t in group:
            m = CACHE_TENSOR.match(t) or KVSHARE_TENSOR.match(t)
            if m:
                keys.add((m.group(1), int(m.group(2))))
        if len(keys) != 1:
            raise QuantizeError(
                f"cannot tell which KV cache feeds MatMul operand {operand} (found {sorted(keys)})"
            )
        key = keys.pop()
        kv_groups[key] = kv_groups.get(key, set()) | group

    # PLE paths: forward from the projection/gate MatMuls up to each layer's post-PLE norm.
    weight_of = {n.name: next((i for i in n.input if i in inits), None) for n in graph.node}
    ple: list[str] = []
    seen_nodes: set[str] = set()
    todo = [
        n
        for n in graph.node
        if (weight_of[n.name] or "").endswith(PLE_START_WEIGHTS) or set(n.input) & PLE_GRAPH_INPUTS
    ]
    while todo:
        n = todo.pop()
        if n.name in seen_nodes:
            continue
        seen_nodes.add(n.name)
        ple.append(n.name)
        if (weight_of[n.name] or "").endswith(PLE_END_WEIGHT):
            continue
        for o in n.output:
            todo += consumers.get(o, [])
    order = {n.name: i for i, n in enumerate(graph.node)}
    return GraphAnalysis(act_matmuls, kv_groups, sorted(ple, key=order.get), weights)


# ---- calibration ----
class _FeedsReader:
    """An onnxruntime CalibrationDataReader over a stream of feeds."""

    def __init__(self, feeds: Iterator[dict[str, np.ndarray]], expected: int, desc: str = "calibrate"):
        from tqdm import tqdm

        self.feeds = feeds
        self.expected = expected  # onnxruntime's strided calibrators ask for len()
        self.count = 0
        self.budget: int | None = None
        self.progress = tqdm(total=expected, desc=desc, unit="call", leave=False)

    def __len__(self) -> int:
        return self.expected

    def set_range(self, start_index: int, end_index: int) -> None:
        """Strided calibration asks for the calls in consecutive ranges; the stream is already in order."""
        self.budget = end_index - start_index

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.budget is not None:
            if self.budget == 0:
                return None
            self.budget -= 1
        item = next(self.feeds, None)
        if item is not None:
            self.count += 1
            self.progress.update()
        else:
            self.progress.close()
        return item


@dataclass
class CalibratedRanges:
    """Ranges fixed before any graph is quantized, so every graph that touches a tensor agrees on its
    encoding: the KV caches (per layer, key and value) and the tensors that cross from one part to
    the next (Genie binds a part's output buffer to the next part's input as raw bytes)."""

    kv: dict[tuple[str, int], tuple[float, float]]
    boundary: dict[str, tuple[float, float]]


def calibrated_ranges(runner, samples: list[list[int]]) -> CalibratedRanges:
    """The KV and cross-part ranges from a prefill pass of its own (the stage takes them from its
    calibration pass instead: RangeCollector)."""
    from tqdm import tqdm

    collector = RangeCollector()
    runner.observer = collector.observe
    try:
        for sample in tqdm(samples, desc="calibrate KV and part ranges", unit="sample", leave=False):
            runner.reset()
            runner.prefill(sample)
    finally:
        runner.observer = None
        runner.release("prefill")
    return collector.ranges()


def quant_settings(
    cfg: PipelineConfig,
    analysis: GraphAnalysis,
    ranges: CalibratedRanges,
    graph_tensors: set[str],
    luts: dict[str, dict[str, Any]],
) -> tuple[dict, list[str]]:
    """Tensor overrides and excluded nodes for one graph under the config's rules."""
    from onnxruntime.quantization import QuantType

    overrides: dict[str, list[dict[str, Any]]] = {}
    for w in analysis.matmul_weights:
        overrides[w] = [{"axis": 1}]  # output channels of a (in, out) MatMul weight
    if cfg.ple_policy == "int16":
        for w in analysis.matmul_weights:
            if w.endswith(PLE_WEIGHT_SUFFIXES):
                overrides[w] = [{"axis": 1, "quant_type": QuantType.QInt16, "symmetric": True}]
    kv_type = QuantType.QUInt8 if cfg.kv_cache_bits == 8 else QuantType.QUInt16
    for key, tensors in analysis.kv_groups.items():
        if key not in ranges.kv:
            raise QuantizeError(f"no calibrated range for the {key[0]} cache of layer {key[1]}")
        lo, hi = ranges.kv[key]
        for t in tensors:
            overrides[t] = [{"quant_type": kv_type, "rmin": np.float32(lo), "rmax": np.float32(hi)}]
    for name, (lo, hi) in ranges.boundary.items():
        if name in graph_tensors and not (name == PER_LAYER_EMBEDS and cfg.ple_policy == "float16"):
            overrides[name] = [
                {"quant_type": QuantType.QUInt16, "rmin": np.float32(lo), "rmax": np.float32(hi)}
            ]
    for name, (lo, hi) in constructed_input_ranges().items():
        if name in graph_tensors:
            overrides[name] = [
                {"quant_type": QuantType.QUInt16, "rmin": np.float32(lo), "rmax": np.float32(hi)}
            ]
    for name, enc in lut_input_encodings(luts, graph_tensors).items():
        # The graph reads LUT rows exactly as the LUT stores them (real = (q + offset) * scale), so
        # Genie can copy rows into the input tensor without requantizing.
        overrides[name] = [
            {
                "quant_type": {"ufixed8": QuantType.QUInt8, "ufixed16": QuantType.QUInt16}[enc.datatype],
                "scale": np.array(enc.scale, dtype=np.float32),
                "zero_point": np.array(-enc.offset, dtype=enc.numpy_dtype),
            }
        ]
    return overrides, excluded_nodes(cfg, analysis)


def excluded_nodes(cfg: PipelineConfig, analysis: GraphAnalysis) -> list[str]:
    """Nodes left float: the PLE paths under the float16 policy."""
    return analysis.ple_nodes if cfg.ple_policy == "float16" else []


# ---- weight schemes (stages/precision.py) ----
# onnxruntime's quantizer writes every MatMul weight as int8 per output channel; a precision with other
# decoder weights rewrites those DequantizeLinear nodes from the float weights afterwards. The lm_head
# and the PLE paths keep what the precision and the PLE policy give them.
LM_HEAD_WEIGHT = "lm_head.weight"


def weight_role(weight: str) -> str:
    """decoder, lm_head or ple: which row of the precision table a MatMul weight follows."""
    if weight.endswith(LM_HEAD_WEIGHT):
        return "lm_head"
    if weight.endswith(PLE_WEIGHT_SUFFIXES):
        return "ple"
    return "decoder"


def expected_scheme(cfg: PipelineConfig, weight: str, int8_weights: frozenset[str] = frozenset()):
    """The WeightScheme a MatMul weight must have, or None where the PLE policy keeps it float.
    `int8_weights`: the decoder weights a mixed precision keeps at int8 (`WeightRounder.choose_int8`)."""
    from stages.plan import PLE_POLICY_SCHEMES

    role = weight_role(weight)
    if role == "lm_head":
        return cfg.lm_head_scheme
    if role == "ple":
        return None if cfg.ple_policy == "float16" else PLE_POLICY_SCHEMES[cfg.ple_policy]
    if weight in int8_weights:
        return INT8_CHANNEL
    return cfg.decoder_scheme


def _has_4bit_weights(cfg: PipelineConfig) -> bool:
    return 4 in (cfg.decoder_scheme.bits, cfg.lm_head_scheme.bits)


def _4bit_weights(cfg: PipelineConfig, src: Path) -> list[str]:
    """The MatMul weights of the graph at src that the precision stores in 4 bits."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    return [
        w
        for w in analyse(model).matmul_weights
        if (scheme := expected_scheme(cfg, w)) is not None and scheme.bits == 4
    ]


def _pack_int4(q: np.ndarray) -> bytes:
    """ONNX INT4 storage: two values per byte, the first in the low nibble."""
    flat = q.astype(np.int8).ravel()
    if flat.size % 2:
        flat = np.append(flat, np.int8(0))
    nibbles = (flat & 0x0F).astype(np.uint8)
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def _int4_tensor(name: str, q: np.ndarray):
    from onnx import TensorProto, helper

    return helper.make_tensor(name, TensorProto.INT4, list(q.shape), _pack_int4(q), raw=True)


# Candidate clipping ratios for int4 per-channel scales: a column's scale is ratio * max|w| / 7 for the
# ratio with the least squared weight error. Max-abs scaling (ratio 1) spends most of a 16-level grid
# on one outlier; on the trained tiny model the search took held-out KL from 0.110 to 0.074 and
# perplexity from 4.54 to 4.37 (float 4.17). Fixed candidates keep the result deterministic.
INT4_CLIP_RATIOS = np.linspace(0.5, 1.0, 26)
# weight_rounding "gptq-search": GPTQ moves rounding error onto the rows not yet rounded, so the ratio
# with the least weight error is not the one with the least output error after GPTQ. Each column of a
# weight left at 4 bits is rounded again under these steps of INT4_CLIP_RATIOS around its weight-error
# ratio (one GPTQ per step under one Hessian factor) and keeps the least output error. On the trained
# tiny model's 4-bit weights the best ratio under GPTQ lay below the weight-error one for 46 % of
# columns and above it for 37 %, further below than above; this window (9 of 26 ratios) reached 88 %
# of the whole grid's output-error gain, and the held-out and calibration-side KL of the grid.
SCALE_SEARCH_STEPS = range(-6, 3)


def _int4_error(w: np.ndarray, s: np.ndarray, buf: np.ndarray, axis: int) -> np.ndarray:
    """The squared error of `w` rounded to symmetric int4 at scale `s`, summed in float64 along `axis`;
    step by step in the reused float32 buffer `buf` (the arithmetic of the plain expression)."""
    np.divide(w, s, out=buf)
    np.rint(buf, out=buf)
    np.clip(buf, -8, 7, out=buf)
    np.multiply(buf, s, out=buf)
    np.subtract(buf, w, out=buf)
    np.square(buf, out=buf)
    return buf.sum(axis=axis, dtype=np.float64)


def _clip_scale(ratio: np.ndarray | float, safe: np.ndarray) -> np.ndarray:
    """The int4 scale of columns with max-abs `safe` clipped at `ratio` (a number or one per column)."""
    return (np.float32(ratio) * safe / np.float32(7.0)).astype(np.float32)


def _clip_search(w: np.ndarray, safe: np.ndarray) -> np.ndarray:
    """The index in INT4_CLIP_RATIOS of each column of `w` (in, cols)'s best clipping ratio; one reused
    buffer, the arithmetic of a plain expression step by step (float32, the error summed in float64
    row by row)."""
    best_err = np.full(w.shape[1], np.inf, np.float64)
    best = np.full(w.shape[1], len(INT4_CLIP_RATIOS) - 1)
    buf = np.empty_like(w)
    for i in range(len(INT4_CLIP_RATIOS) - 1, -1, -1):  # ratio 1 first: ties keep the unclipped scale
        err = _int4_error(w, _clip_scale(INT4_CLIP_RATIOS[i], safe), buf, axis=0)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, i, best)
    return best


def int4_channel(
    w: np.ndarray, workers: int | None = None, hessian: Hessian | None = None, search: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 per output channel of a (in, out) weight: (values, scale per column), each
    column's scale the clipping ratio with the least squared weight error. With the input's `hessian`
    GPTQ picks the integers under those scales. (Weighting the clipping search by the Hessian's
    diagonal measured no better on the tiny model: held-out KL 0.042 vs 0.041.) With `search` too,
    each column keeps, of the ratios SCALE_SEARCH_STEPS around that one, the one whose GPTQ rounding
    leaves the least output error (`stages.gptq.best_scales`; the weight-error ratio wins ties).

    Columns are searched independently, so blocks of columns go to threads (numpy releases the GIL):
    the same result on any number of threads, 2.5x faster on 2 cores at E2B's 1536 x 6144."""
    from concurrent.futures import ThreadPoolExecutor

    w = np.ascontiguousarray(w, dtype=np.float32)
    absmax = np.abs(w).max(axis=0)
    safe = np.where(absmax > 0, absmax, 1.0).astype(np.float32)
    workers = max(1, min(workers or os.cpu_count() or 1, w.shape[1]))
    bounds = np.linspace(0, w.shape[1], workers + 1).astype(int)
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    blocks = [(np.ascontiguousarray(w[:, a:b]), safe[a:b]) for a, b in spans]
    with ThreadPoolExecutor(workers) as pool:
        ratio = np.concatenate(list(pool.map(lambda block: _clip_search(*block), blocks)))
    scale = _clip_scale(INT4_CLIP_RATIOS[ratio], safe)
    if hessian is not None and search:
        last = len(INT4_CLIP_RATIOS) - 1
        candidates = [scale] + [
            _clip_scale(INT4_CLIP_RATIOS[np.clip(ratio + step, 0, last)], safe)
            for step in SCALE_SEARCH_STEPS
            if step
        ]
        q, best = best_scales(w, hessian, [c[None, :] for c in candidates])
        return q, best[0]
    if hessian is not None:
        return gptq(w, hessian, scale[None, :]), scale
    q = np.clip(np.rint(w / scale), -8, 7).astype(np.int8)
    return q, scale


def _block_scale_search(blocks: np.ndarray, channel: np.ndarray) -> np.ndarray:
    """The 4-bit scale of each block of `blocks` (nb, block, cols) with the least squared weight error,
    a block's scale being k * its column's `channel` scale for k in 1..LPBQ_BLOCK_SCALE_MAX; one reused
    buffer, the error summed in float64."""
    best_err = np.full((blocks.shape[0], blocks.shape[2]), np.inf, np.float64)
    q_scale = np.full(best_err.shape, LPBQ_BLOCK_SCALE_MAX, np.uint8)
    buf = np.empty_like(blocks)
    for k in range(LPBQ_BLOCK_SCALE_MAX, 0, -1):  # the largest first: ties keep the unclipped scale
        err = _int4_error(blocks, (np.float32(k) * channel).astype(np.float32), buf, axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        q_scale = np.where(better, np.uint8(k), q_scale)
    return q_scale


def int4_lpbq(
    w: np.ndarray, block: int, workers: int | None = None, hessian: Hessian | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LPBQ of a (in, out) weight, blocks of `block` input rows: (int4 values, 4-bit block scales as
    uint8 (in/block, out), float scale per column); a block's scale is its integer times its column's.

    A column's float scale is its largest block's max-abs scale / LPBQ_BLOCK_SCALE_MAX; each block then
    takes the integer (1..LPBQ_BLOCK_SCALE_MAX) with the least squared error, not the nearest one: it
    clips where that helps, and a quiet block's coarse integer is picked for its error. On the trained
    tiny model the search took held-out KL from 0.106 to 0.072 (README, "Fitting the target").
    Columns are independent: spans of them go to threads, as int4_channel's do. With the input's
    `hessian` GPTQ picks the integers under those block scales."""
    from concurrent.futures import ThreadPoolExecutor

    rows, cols = w.shape
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(rows // block, block, cols)
    channel = np.abs(blocks).max(axis=(0, 1)) / np.float32(7 * LPBQ_BLOCK_SCALE_MAX)
    channel = np.where(channel > 0, channel, 1.0).astype(np.float32)
    workers = max(1, min(workers or os.cpu_count() or 1, cols))
    bounds = np.linspace(0, cols, workers + 1).astype(int)
    spans = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def search(span: slice) -> np.ndarray:
        return _block_scale_search(np.ascontiguousarray(blocks[:, :, span]), channel[span])

    with ThreadPoolExecutor(workers) as pool:
        q_scale = np.concatenate(list(pool.map(search, spans)), axis=1)
    if hessian is not None:
        return gptq(w, hessian, q_scale * channel), q_scale, channel
    effective = (q_scale * channel)[:, None, :]
    q = np.clip(np.rint(blocks / effective), -8, 7).astype(np.int8).reshape(rows, cols)
    return q, q_scale, channel


def int8_channel_error(w: np.ndarray) -> np.ndarray:
    """What onnxruntime's int8 per-channel weight (symmetric, max-abs / 127) minus the float weight is."""
    absmax = np.abs(w).max(axis=0)
    scale = np.where(absmax > 0, absmax, 1.0) / 127.0
    return np.clip(np.rint(w / scale), -127, 127) * scale - w


@dataclass
class RoundedWeight:
    q: np.ndarray  # int4 values, (in, out)
    scale: np.ndarray  # per output channel (LPBQ: the float scale under the block scales)
    block_scales: np.ndarray | None
    params: int
    nsr_int4: float  # output noise-to-signal of the 4-bit weight on the calibration inputs
    nsr_int8: float  # the same for the int8 weight a mixed precision would keep instead
    kl_int4: float | None = None  # measured: next-token KL with this weight alone at 4 bits

    def dequantized(self) -> np.ndarray:
        if self.block_scales is None:
            return self.q * self.scale
        block = self.q.shape[0] // self.block_scales.shape[0]
        return self.q * np.repeat(self.block_scales * self.scale, block, axis=0)


class WeightRounder:
    """Every 4-bit weight of the precision rounded once (GPTQ with `hessians`, else the clipping
    search alone), each with its MatMul's own output error at 4 and 8 bits and, where measured, the
    model's next-token KL with it alone at 4 bits: what the mixed precision ranks. With the
    `gptq-search` rounding, the weights left at 4 bits are then rounded again with their scales
    searched under GPTQ's output error (`search_scales`)."""

    def __init__(self, cfg: PipelineConfig, hessians: dict[str, Hessian] | None):
        self.cfg = cfg
        self.hessians = hessians or {}
        self.rounding = cfg.weight_rounding if self.hessians else "nearest"
        self.rounded: dict[str, RoundedWeight] = {}
        self.int8_weights: frozenset[str] = frozenset()
        self.searched: list[str] = []  # weights whose scales search_scales chose
        self.search_s = 0.0

    @property
    def searches(self) -> bool:
        return self.rounding == "gptq-search"

    def round_all(self, graphs: list[Path], keep_hessians_in: Path | None = None) -> None:
        """Round every 4-bit weight of the graphs, then drop the Hessians (E2B's take ~4 GB), or, with
        `keep_hessians_in`, move them to files there, mapped back on use (for `search_scales`)."""
        from tqdm import tqdm

        names = {src: _4bit_weights(self.cfg, src) for src in graphs}
        with tqdm(total=sum(map(len, names.values())), desc="round 4-bit weights", unit="weight") as bar:
            for src in graphs:  # one graph's float weights in memory at a time
                weights = matmul_weights_by_name(src)
                for name in names[src]:
                    bar.update()
                    if name not in self.rounded:
                        self.round_weight(name, weights.pop(name))
                del weights
        self.hessians = _on_disk(self.hessians, keep_hessians_in) if keep_hessians_in else {}

    def search_scales(self, graphs: list[Path]) -> None:
        """Round each weight stored at 4 bits per channel again, its scales searched under GPTQ's
        output error (`int4_channel(search=True)`); after `choose_int8`, so a mixed precision
        searches only the weights it leaves at 4 bits. Its measured cost stays that of the first
        rounding (what the choice ranked). Drops the Hessians when done."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        names = {
            src: [
                n
                for n in _4bit_weights(self.cfg, src)
                if n not in self.int8_weights and not expected_scheme(self.cfg, n).blockwise
            ]
            for src in graphs
        }
        with tqdm(total=sum(map(len, names.values())), desc="search 4-bit scales", unit="weight") as bar:
            for src in graphs:
                weights = matmul_weights_by_name(src)
                for name in names[src]:
                    bar.update()
                    if name not in self.searched:
                        kl = self.rounded[name].kl_int4
                        self.round_weight(name, weights.pop(name), search=True).kl_int4 = kl
                        self.searched.append(name)
                del weights
        self.hessians = {}
        self.search_s = time.perf_counter() - t0

    def measure(self, runner, samples: list[list[int]], scratch: Path) -> None:
        """Each decoder weight's measured cost at 4 bits (`stages.sensitivity`), on the runner's
        prefill graphs: what the mixed precision ranks by."""
        from stages.sensitivity import measure

        decoder = {n: r.dequantized for n, r in self.rounded.items() if weight_role(n) == "decoder"}
        for name, kl in measure(runner, decoder, samples, scratch).items():
            self.rounded[name].kl_int4 = kl

    def round_weight(self, name: str, w: np.ndarray, search: bool = False) -> RoundedWeight:
        """One (in, out) weight rounded to its 4-bit scheme (per channel with `search`: its scales
        searched under GPTQ's output error), with the output error of 4 and 8 bits."""
        from stages.gptq import output_error

        scheme, hessian = expected_scheme(self.cfg, name), self.hessians.get(name)
        if scheme.blockwise:
            block = lpbq_block(scheme, w.shape[0])
            if w.shape[0] % block:
                raise QuantizeError(
                    f"{name}: {w.shape[0]} input rows are not a multiple of its {scheme.name} "
                    f"block of {block} rows; use precision w4a16 (int4 per channel) for this model"
                )
            q, block_scales, scale = int4_lpbq(w, block, hessian=hessian)
            dequantized = q * np.repeat(block_scales * scale, block, axis=0)
        else:
            (q, scale), block_scales = int4_channel(w, hessian=hessian, search=search), None
            dequantized = q * scale
        hess = hessian or Hessian(np.ones(w.shape[0], np.float32))
        self.rounded[name] = RoundedWeight(
            q,
            scale,
            block_scales,
            w.size,
            output_error(w, dequantized, hess),
            output_error(w, w + int8_channel_error(w), hess),
        )
        return self.rounded[name]

    def choose_int8(self, share: float) -> frozenset[str]:
        """The decoder weights kept at int8: the most measured cost (next-token KL at 4 bits; where
        not measured, the MatMul's own output error) removed per extra byte first, while their
        parameters stay within `share` of the decoder's (the precision's memory price)."""
        decoder = {n: r for n, r in self.rounded.items() if weight_role(n) == "decoder"}
        budget = share * sum(r.params for r in decoder.values())

        def gain(n: str) -> float:
            r = decoder[n]
            return (r.kl_int4 if r.kl_int4 is not None else r.nsr_int4 - r.nsr_int8) / r.params

        chosen, used = [], 0
        for name in sorted(decoder, key=lambda n: (-gain(n), n)):
            if used + decoder[name].params <= budget:
                chosen.append(name)
                used += decoder[name].params
        return frozenset(chosen)

    def figures(self) -> dict[str, Any]:
        return {
            "rounding": self.rounding,
            "int8_weights": sorted(self.int8_weights),
            "int8_share": round(
                sum(self.rounded[n].params for n in self.int8_weights)
                / max(1, sum(r.params for n, r in self.rounded.items() if weight_role(n) == "decoder")),
                4,
            ),
            "sensitivity": "measured"
            if any(r.kl_int4 is not None for r in self.rounded.values())
            else "local",
            "scales_searched": sorted(self.searched),
            "scale_search_s": round(self.search_s, 1),
            "weights": {
                n: {
                    "nsr_int4": round(r.nsr_int4, 6),
                    "nsr_int8": round(r.nsr_int8, 8),
                    "params": r.params,
                    **({"kl_int4": round(r.kl_int4, 6)} if r.kl_int4 is not None else {}),
                }
                for n, r in sorted(self.rounded.items())
            },
        }


def _on_disk(hessians: dict[str, Hessian], folder: Path) -> dict[str, Hessian]:
    """The same Hessians (shared ones stay shared) saved under folder and memory-mapped back: the
    measured-sensitivity pass between rounding and the scale search then does not hold E2B's ~4 GB."""
    folder.mkdir(parents=True, exist_ok=True)
    mapped: dict[int, Hessian] = {}
    for h in hessians.values():
        if id(h) not in mapped:
            path = folder / f"{len(mapped)}.npy"
            np.save(path, h.matrix)
            mapped[id(h)] = Hessian(np.load(path, mmap_mode="r"), h.rows)
    return {name: mapped[id(h)] for name, h in hessians.items()}


def lpbq_block(scheme, rows: int) -> int:
    """The block size a weight with `rows` input rows gets: the scheme's, or one block per column
    where the whole column is shorter (tiny test models; every E2B input width is a multiple of 64).
    QNN's HTP emulation agrees with LPBQ MatMuls at blocks of 16 rows and up; at 8 rows only below 64
    output columns, at 4 rows not at all (the tiny model's narrowest input is 32 rows)."""
    return min(scheme.block_size, rows)


def apply_weight_scheme(
    cfg: PipelineConfig,
    qmodel,
    float_weights: dict[str, np.ndarray],
    rounder: WeightRounder | None = None,
) -> int:
    """Rewrite the int8 weight DequantizeLinear of every MatMul whose scheme is 4-bit (`float_weights`:
    MatMul node name -> its float (in, out) weight; `rounder`: the weights rounded already, and which
    a mixed precision keeps at int8). Returns how many weights were rewritten."""
    from onnx import helper, numpy_helper

    graph = qmodel.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    rewritten, new_nodes = 0, {}

    def replace_init(name: str, tensor) -> None:
        graph.initializer.remove(inits[name])
        tensor.name = name
        graph.initializer.append(tensor)
        inits[name] = tensor

    for node in graph.node:
        if node.op_type != "MatMul" or node.name not in float_weights:
            continue
        dq = producer.get(node.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        w = float_weights[node.name]
        scheme = expected_scheme(cfg, _weight_name(dq), rounder.int8_weights if rounder else frozenset())
        if scheme is None or scheme.bits != 4:
            continue
        q_name, s_name = dq.input[0], dq.input[1]
        if len(dq.input) < 3 or not dq.input[2]:  # symmetric weights may come without a zero point
            zp_name = f"{q_name}_zero_point4"
            graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.int8), zp_name))
            inits[zp_name] = graph.initializer[-1]
            del dq.input[2:]
            dq.input.append(zp_name)
        zp_name = dq.input[2]
        done = rounder.rounded.get(_weight_name(dq)) if rounder else None
        done = done or WeightRounder(cfg, None).round_weight(_weight_name(dq), w)
        if not scheme.blockwise:
            q, scale = done.q, done.scale
            replace_init(q_name, _int4_tensor(q_name, q))
            replace_init(s_name, numpy_helper.from_array(scale))
            replace_init(zp_name, _int4_tensor(zp_name, np.zeros(scale.shape, np.int8)))
        else:
            block = lpbq_block(scheme, w.shape[0])
            q, q_scale, channel = done.q, done.block_scales, done.scale
            # The pattern onnxruntime-qnn's LPBQ fusion takes: UINT8 block scales (nb, out) under a
            # per-channel float scale (axis 1, zero points 0) feeding the INT4 weight's blockwise
            # DequantizeLinear (axis 0, block_size, zero points 0).
            base = q_name.removesuffix("_quantized")
            block_scales = f"{base}_block_scales"
            for suffix, arr in (
                ("_block_scales_q", q_scale),
                ("_channel_scale", channel),
                ("_block_scales_zero_point", np.zeros(channel.shape, np.uint8)),
            ):
                graph.initializer.append(numpy_helper.from_array(arr, base + suffix))
            new_nodes[dq.name] = helper.make_node(
                "DequantizeLinear",
                [base + "_block_scales_q", base + "_channel_scale", base + "_block_scales_zero_point"],
                [block_scales],
                name=f"{base}_block_scales_DequantizeLinear",
                axis=1,
            )
            replace_init(q_name, _int4_tensor(q_name, q))
            graph.initializer.remove(inits.pop(s_name))
            replace_init(zp_name, _int4_tensor(zp_name, np.zeros(q_scale.shape, np.int8)))
            dq.input[1] = block_scales
            del dq.attribute[:]
            dq.attribute.extend(
                [helper.make_attribute("axis", 0), helper.make_attribute("block_size", block)]
            )
        rewritten += 1
    if new_nodes:  # each block-scale DQ goes right before the weight DQ that reads it
        nodes = []
        for n in graph.node:
            if n.name in new_nodes:
                nodes.append(new_nodes[n.name])
            nodes.append(n)
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


def rewrite_weights(cfg: PipelineConfig, src: Path, dest: Path, rounder: WeightRounder | None = None) -> None:
    """Give the quantized graph at dest the precision's decoder weights, from the float graph at src."""
    import onnx

    qmodel = onnx.load(str(dest))
    apply_weight_scheme(cfg, qmodel, matmul_float_weights(src), rounder)
    data = dest.with_name(dest.name + ".data")
    large = data.exists() or sum(len(i.raw_data) for i in qmodel.graph.initializer) > 1_900_000_000
    data.unlink(missing_ok=True)  # onnx appends to an existing external-data file
    onnx.save(qmodel, str(dest), save_as_external_data=large, location=data.name)


def matmul_weights_by_name(src: Path) -> dict[str, np.ndarray]:
    """Weight name -> its float (in, out) value, for every MatMul weight of the exported graph."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    return {
        n.input[1]: numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits
    }


def _weight_name(dq) -> str:
    """The float weight a weight DequantizeLinear stands for (onnxruntime names it <weight>_quantized)."""
    return dq.input[0].removesuffix("_quantized")


def matmul_float_weights(src: Path) -> dict[str, np.ndarray]:
    """MatMul node name -> its float weight, from the exported graph."""
    import onnx

    by_name = matmul_weights_by_name(src)
    model = onnx.load(str(src), load_external_data=False)
    return {
        n.name: by_name[n.input[1]]
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in by_name
    }


def lut_input_encodings(luts: dict[str, dict[str, Any]], graph_tensors: set[str]) -> dict[str, Encoding]:
    """The encoding each LUT-fed input of a graph must have: its LUT's (export report `luts`)."""
    return {
        name: Encoding.of_lut(luts[key])
        for name, key in LUT_INPUTS.items()
        if key in luts and name in graph_tensors
    }


def read_lut_inputs_quantized(model, encodings: dict[str, Encoding]) -> list[str]:
    """Make every LUT-fed graph input enter through a QuantizeLinear -> DequantizeLinear pair with its
    LUT's encoding, where the quantizer left it float (it does when every reader of the input is an
    excluded float node: the float16 PLE policy's `per_layer_inputs`). Compile folds the pair's
    QuantizeLinear into the input, so the binary takes the LUT's bytes. Returns the inputs changed."""
    from onnx import helper

    g = model.graph
    changed = []
    for name, enc in encodings.items():
        readers = [n for n in g.node if name in n.input]
        if len(readers) == 1 and readers[0].op_type == "QuantizeLinear":
            continue  # the quantizer did it (with the override's encoding; the audit checks it)
        scale, zero_point = f"{name}_lut_scale", f"{name}_lut_zero_point"
        g.initializer.extend(
            [
                helper.make_tensor(scale, 1, [], [float(np.float32(enc.scale))]),
                helper.make_tensor(zero_point, {"uint8": 2, "uint16": 4}[enc.numpy_dtype], [], [-enc.offset]),
            ]
        )
        quantized, dequantized = f"{name}_lut_quantized", f"{name}_lut_dequantized"
        for n in readers:
            n.input[:] = [dequantized if i == name else i for i in n.input]
        pair = [
            helper.make_node(
                "QuantizeLinear", [name, scale, zero_point], [quantized], f"{name}_QuantizeLinear"
            ),
            helper.make_node(
                "DequantizeLinear", [quantized, scale, zero_point], [dequantized], f"{name}_DequantizeLinear"
            ),
        ]
        for k, node in enumerate(pair):
            g.node.insert(k, node)
        changed.append(name)
    return changed


# ---- audit ----
def _block_scale_problems(scales, inits) -> tuple[list[int], list[str]]:
    """An LPBQ weight's block-scale DequantizeLinear: (the [min, max] of its integer block scales, what
    is wrong). The HTP reads each block scale as a 4-bit integer in 1..LPBQ_BLOCK_SCALE_MAX and no zero
    point, and its per-channel float scale must be positive."""
    import onnx

    arrays = [onnx.numpy_helper.to_array(inits[t]) if t in inits else None for t in scales.input[:3]]
    q, channel, zp = arrays + [None] * (3 - len(arrays))
    found = [int(q.min()), int(q.max())]
    bad = []
    if found[0] < 1 or found[1] > LPBQ_BLOCK_SCALE_MAX:
        bad.append(
            f"block scales span {found[0]}..{found[1]}, the HTP takes 1..{LPBQ_BLOCK_SCALE_MAX} (4 bits)"
        )
    if channel is None or not (np.isfinite(channel).all() and (channel > 0).all()):
        bad.append("per-channel scale of its block scales is not a positive constant")
    if zp is not None and zp.any():
        bad.append("block scales have a nonzero zero point")
    return found, bad


def audit(
    cfg: PipelineConfig,
    qmodel,
    analysis: GraphAnalysis,
    lut_inputs: dict[str, Encoding],
    int8_weights: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Final types in a QDQ graph: KV operands, the PLE paths, float tensors left behind, and the
    LUT-fed inputs (`lut_input_encodings`), each of which must be read with exactly its LUT's encoding."""
    import onnx

    graph = qmodel.graph
    view = QdqGraph(graph)
    inits, producer, tensor_type = view.inits, view.producer, view.stored_type

    nodes = {n.name: n for n in graph.node}
    problems: list[str] = []
    kv_bits = {8: "uint8", 16: "uint16"}[cfg.kv_cache_bits]
    act = []
    for name, _ in analysis.act_matmuls:
        node = nodes.get(name)
        types = [tensor_type(i) for i in node.input] if node else ["missing"]
        act.append({"node": name, "inputs": types})
        if not cfg.soc_info.matmul_16x16 and types[1] != kv_bits:
            problems.append(
                f"{name}: second operand is {types[1]}, {cfg.soc} needs {kv_bits} (no 16x16 matmul)"
            )
    # One encoding per KV group: the cache input, the new entries and what the MatMul reads.
    scale_of = {}
    for n in graph.node:
        if n.op_type == "QuantizeLinear" and n.input[1] in inits:
            zp = inits[n.input[2]] if len(n.input) > 2 and n.input[2] in inits else None
            scale_of[n.input[0]] = (
                float(onnx.numpy_helper.to_array(inits[n.input[1]])),
                int(onnx.numpy_helper.to_array(zp)) if zp is not None else 0,
            )
    kv_encodings = {}
    for (which, layer), tensors in sorted(analysis.kv_groups.items()):
        found = {scale_of[t] for t in tensors if t in scale_of}
        kv_encodings[f"{which}_{layer}"] = sorted(found)
        if len(found) != 1:
            problems.append(f"{which} cache of layer {layer}: {len(found)} encodings {sorted(found)}")
    # Every MatMul weight with the bits and layout its precision (or the PLE policy) gives it.
    weights = []
    for n in graph.node:
        dq = producer.get(n.input[1]) if n.op_type == "MatMul" else None
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        name = _weight_name(dq)
        want = expected_scheme(cfg, name, int8_weights)
        if want is None:
            continue
        found = ONNX_TYPE_NAMES.get(inits[dq.input[0]].data_type, "?")
        block = next((a.i for a in dq.attribute if a.name == "block_size"), 0)
        scales = producer.get(dq.input[1])
        uint8_scales = (
            scales is not None
            and scales.op_type == "DequantizeLinear"
            and scales.input[0] in inits
            and inits[scales.input[0]].data_type == 2
        )
        want_block = lpbq_block(want, inits[dq.input[0]].dims[0]) if want.blockwise else 0
        ok = found == want.onnx_type and block == want_block and uint8_scales == want.blockwise
        entry = {
            "weight": name,
            "role": weight_role(name),
            "scheme": want.name,
            "type": found,
            "block_size": block,
        }
        weights.append(entry)
        if not ok:
            problems.append(
                f"{name}: {found} weights, block size {block}"
                + (", per-block uint8 scales" if uint8_scales else "")
                + f"; {cfg.precision} wants {want.name} ({want.onnx_type}, block size {want_block})"
            )
        elif want.blockwise:
            entry["block_scales"], bad = _block_scale_problems(scales, inits)
            problems += [f"{name}: {p}" for p in bad]
    ple_names = set(analysis.ple_nodes)

    def origin(t: str) -> Any:
        """The node that computed t's value, looking through Q/DQ pairs."""
        p = producer.get(t)
        while p is not None and p.op_type in ("QuantizeLinear", "DequantizeLinear"):
            p = producer.get(p.input[0])
        return p

    ple = []
    for name in analysis.ple_nodes:
        node = nodes.get(name)
        if node is None:
            problems.append(f"PLE node {name} is missing from the quantized graph")
            continue
        for t in node.input:
            if not t or (t in inits and inits[t].data_type == 7):
                continue
            kind = tensor_type(t)
            src = origin(t)
            if t in inits or (producer.get(t) is not None and producer[t].input[0] in inits):
                role = "weight"
            elif src is not None and src.name in ple_names:
                role = "internal"
            else:
                role = "boundary"  # enters the path from the quantized graph or a graph input
            ple.append({"node": name, "tensor": t, "role": role, "type": kind})
            if role == "boundary":
                continue
            if cfg.ple_policy == "float16":
                want = "float32"  # excluded from quantization: float16 on the HTP
            elif role == "weight" and node.op_type == "MatMul":
                want = "int16" if cfg.ple_policy == "int16" else "int8"
            else:
                want = "quantized"  # activations 16-bit; norm scales and constants any fixed-point type
            ok = kind == want or (want == "quantized" and kind not in ("float32", "float16"))
            if not ok:
                problems.append(f"PLE {name}: {role} {t} is {kind}, policy {cfg.ple_policy} wants {want}")
    leftover = []
    for n in graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") or n.name in ple_names:
            continue
        for t in n.input:
            if t and tensor_type(t) == "float32" and not (t in inits and inits[t].data_type != 1):
                leftover.append(f"{n.name}:{t}")
    if leftover:
        problems.append(
            f"{len(leftover)} float inputs outside the PLE policy, e.g. {', '.join(leftover[:3])}"
        )
    lut_fed = {}
    for name, want in sorted(lut_inputs.items()):
        readers = [n for n in graph.node if name in n.input]
        q = readers[0] if len(readers) == 1 and readers[0].op_type == "QuantizeLinear" else None
        got = None
        if q is not None and len(q.input) > 2 and q.input[1] in inits and q.input[2] in inits:
            zp = inits[q.input[2]]
            got = Encoding.from_onnx(
                zp.data_type,
                float(onnx.numpy_helper.to_array(inits[q.input[1]])),
                int(onnx.numpy_helper.to_array(zp)),
            )
        lut_fed[name] = {"lut": want.to_dict(), "input": got.to_dict() if got else "float32"}
        if got != want:
            problems.append(
                f"{name} is read as {got.describe() if got else 'float32'}, its LUT is {want.describe()}: "
                "Genie copies LUT rows only into an input of the LUT's exact encoding"
            )
    return {
        "activation_matmuls": act,
        "weights": weights,
        "kv_encodings": kv_encodings,
        "ple_tensors": ple,
        "float_leftovers": leftover,
        "lut_inputs": lut_fed,
        "problems": problems,
    }


# ---- calibration and quantization, in two steps ----
# onnxruntime's quantize_static holds its own copy of the model while its calibrator holds a second
# and the calibration session a third; with the float chain's sessions feeding it, that is what
# pushed a full-size E2B part past 16 GB. Calibrating first (the calibrator and the chain), writing the
# ranges to onnxruntime's calibration cache, dropping both and only then quantizing from the cache
# keeps one of those at a time. The ranges and the graph are the same as one quantize_static call.

# quantize_static's extra_options names for the calibrator's settings (onnxruntime 1.31).
CALIBRATOR_OPTIONS = {
    "CalibTensorRangeSymmetric": "symmetric",
    "CalibMovingAverage": "moving_average",
    "CalibMovingAverageConstant": "averaging_constant",
    "CalibMaxIntermediateOutputs": "max_intermediate_outputs",
    "CalibPercentile": "percentile",
}


def new_calibrator(src: Path, qcfg, scratch: Path):
    """onnxruntime's calibrator for the graph at src with qcfg's settings (its augmented graph in scratch)."""
    from onnxruntime.quantization.calibrate import create_calibrator

    options = qcfg.extra_options or {}
    calibrator = create_calibrator(
        src,
        qcfg.op_types_to_quantize,
        augmented_model_path=str(scratch / "augmented.onnx"),
        calibrate_method=qcfg.calibrate_method,
        use_external_data_format=qcfg.use_external_data_format,
        providers=qcfg.calibration_providers,
        extra_options={key: options[name] for name, key in CALIBRATOR_OPTIONS.items() if name in options},
    )
    # The calibrator keeps the graph it loaded (weights included: 2.4 GB for an E2B part) after
    # building its augmented copy and session from it, and reads nothing from it afterwards. Clearing
    # fields frees nothing (protobuf's arena lives as long as the message), so drop the message.
    calibrator.model = None
    return calibrator


def calibrate(src: Path, qcfg, ranges_file: Path, scratch: Path) -> None:
    """Run onnxruntime's calibrator over qcfg's data reader and save the ranges to ranges_file (one
    graph on its own; the stage calibrates a whole graph kind at once: calibrate_kind)."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    calibrator = new_calibrator(src, qcfg, scratch)
    reader = qcfg.calibration_data_reader
    stride = (qcfg.extra_options or {}).get("CalibStridedMinMax")
    if stride:
        for start in range(0, len(reader), stride):
            reader.set_range(start_index=start, end_index=start + stride)
            calibrator.collect_data(reader)
    else:
        calibrator.collect_data(reader)
    save_tensors_data(calibrator.compute_data(), ranges_file)


def quantize_with_ranges(src: Path, dest: Path, qcfg, ranges_file: Path) -> None:
    """quantize_static with qcfg's settings and the saved ranges (no calibration run)."""
    from onnxruntime.quantization import quantize_static

    quantize_static(
        str(src),
        str(dest),
        None,
        calibrate_method=qcfg.calibrate_method,
        quant_format=qcfg.quant_format,
        activation_type=qcfg.activation_type,
        weight_type=qcfg.weight_type,
        op_types_to_quantize=qcfg.op_types_to_quantize,
        nodes_to_quantize=qcfg.nodes_to_quantize,
        nodes_to_exclude=qcfg.nodes_to_exclude,
        per_channel=qcfg.per_channel,
        reduce_range=qcfg.reduce_range,
        use_external_data_format=qcfg.use_external_data_format,
        extra_options=qcfg.extra_options,
        calibration_cache_path=ranges_file,
    )


def qnn_config(
    src: Path,
    reader,
    overrides: dict | None = None,
    excluded: list[str] | None = None,
    calibration_providers: list[str] | None = None,
    method: str = "minmax",
    stride: int | None = None,
):
    """onnxruntime's QNN QDQ configuration of one graph (a StaticQuantConfig)."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    return get_qnn_qdq_config(
        str(src),
        reader,
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QInt8,
        init_overrides=overrides,
        # Converts would make Q (the MatMul's first operand) 8-bit like K; 16x8 is what v69 runs.
        add_qtype_converts=False,
        nodes_to_exclude=excluded or None,
        calibration_providers=calibration_providers,
        calibrate_method=CALIBRATION_METHODS[method](),
        stride=stride,
    )


def graph_stride(stride: int | None, calls: int) -> int | None:
    """onnxruntime wants the call count divisible by the stride: the largest divisor up to it."""
    return max(d for d in range(1, stride + 1) if calls % d == 0) if stride else None


@dataclass
class GraphQuantSetup:
    qcfg: Any  # onnxruntime's StaticQuantConfig, its data reader streaming from the float chain
    analysis: GraphAnalysis
    reader: _FeedsReader
    stride: int | None


def graph_quant_config(
    cfg: PipelineConfig,
    runner,
    spec: GraphSpec,
    src: Path,
    ranges: CalibratedRanges,
    luts: dict[str, dict[str, Any]],
    samples: list[list[int]],
    decode_steps: int,
    calibration_providers: list[str] | None = None,
    method: str = "minmax",
    stride: int | None = None,
) -> GraphQuantSetup:
    """One graph's configuration with a reader that runs the float chain for it alone (parts 1..k per
    call): the reference that the stage's shared pass (calibrate_kind) must equal, graph for graph."""
    import onnx

    from stages.calibration import calls, graph_feeds

    model = onnx.load(str(src), load_external_data=False)
    analysis = analyse(model)
    io_names = {t.name for t in (*model.graph.input, *model.graph.output)}
    overrides, excluded = quant_settings(cfg, analysis, ranges, io_names, luts)
    expected = calls(samples, spec.role, runner.prefill_ar, decode_steps)
    reader = _FeedsReader(
        graph_feeds(runner, samples, spec.role, spec.part, decode_steps), expected, f"calibrate {spec.name}"
    )
    strided = graph_stride(stride, expected)
    qcfg = qnn_config(src, reader, overrides, excluded, calibration_providers, method, strided)
    return GraphQuantSetup(qcfg, analysis, reader, strided)


# ---- calibration: one pass of the float chain for every graph of a kind ----
# Calibrating graph by graph ran the float chain once per graph (parts 1..k for part k: 10 part calls
# per token for 4 parts, plus a pass for the KV and boundary ranges). Here each graph's calibrator
# stands in for that graph's session in the chain: its augmented session (the graph plus a reduction
# per calibrated tensor) returns the graph's own outputs, which feed the next part, and the reductions,
# which its calibrator keeps. One pass of the chain (4 part calls per token) calibrates every graph of
# a kind. Each calibrator runs onnxruntime's own collect_data loop on a thread of its own, fed one call
# at a time, so the calls it sees, their order and its arithmetic are those of the graph-by-graph run
# (tests/integration/test_quantize.py: byte-identical graphs).
class _HandOff:
    """A CalibrationDataReader whose calls the chain hands over one at a time."""

    def __init__(self, expected: int):
        import queue

        self.inbox: queue.Queue = queue.Queue(maxsize=1)
        self.expected = expected
        self.count = 0
        self.budget: int | None = None
        self.ended = False

    def __len__(self) -> int:
        return self.expected

    def set_range(self, start_index: int, end_index: int) -> None:
        self.budget = end_index - start_index

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.ended:  # the chain stopped early (a full context): every later range is empty too
            return None
        if self.budget is not None:
            if self.budget == 0:
                return None
            self.budget -= 1
        item = self.inbox.get()
        if item is None:
            self.ended = True
        else:
            self.count += 1
        return item


class ChainCalibrator:
    """onnxruntime's calibrator for one graph, driven from the float chain (`session` is what the
    chain runs for this graph)."""

    def __init__(self, src: Path, qcfg, expected: int, scratch: Path, ranges_file: Path):
        import queue
        import threading

        self.calibrator = new_calibrator(src, qcfg, scratch)
        self.augmented = self.calibrator.infer_session
        self.output_names = [o.name for o in self.augmented.get_outputs()]

        self.reader = _HandOff(expected)
        self.outbox: queue.Queue = queue.Queue()  # outputs of each call, or the error that ended it
        self.calibrator.infer_session = _Tap(self.augmented, self.outbox)  # its collect_data loop runs it
        self.stride = (qcfg.extra_options or {}).get("CalibStridedMinMax")
        self.ranges_file = ranges_file
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        from onnxruntime.quantization.calibrate import save_tensors_data

        try:
            if self.stride:
                for start in range(0, len(self.reader), self.stride):
                    self.reader.set_range(start_index=start, end_index=start + self.stride)
                    self.calibrator.collect_data(self.reader)
            else:
                self.calibrator.collect_data(self.reader)
            save_tensors_data(self.calibrator.compute_data(), self.ranges_file)
        except BaseException as e:
            self.outbox.put(e)

    # -- the chain's side --
    @property
    def session(self) -> _ChainSession:
        return _ChainSession(self)

    def finish(self) -> None:
        """No more calls: the calibrator computes and saves its ranges."""
        if self.thread.is_alive():
            self.reader.inbox.put(None)
            self.thread.join()
        if not self.outbox.empty():
            err = self.outbox.get()
            if isinstance(err, BaseException):
                raise err
        self.augmented = None


class _Tap:
    """The calibrator's session: the augmented session, each call's outputs also handed to the chain."""

    def __init__(self, session, outbox):
        self.session = session
        self.outbox = outbox

    def __getattr__(self, name: str) -> Any:  # get_inputs, get_outputs, ...: the session's own
        return getattr(self.session, name)

    def run(self, names, feeds):
        try:
            out = self.session.run(names, feeds)
        except BaseException as e:
            self.outbox.put(e)
            raise
        self.outbox.put(out)
        return out


class _ChainSession:
    """What the host runner runs for a graph under calibration: hands the call to its calibrator and
    returns the graph's own outputs from the augmented session's."""

    def __init__(self, owner: ChainCalibrator):
        self.owner = owner

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.owner.reader.inbox.put(feeds)
        out = self.owner.outbox.get()
        if isinstance(out, BaseException):
            raise out
        by_name = dict(zip(self.owner.output_names, out, strict=True))
        return [by_name[n] for n in names]


class RangeCollector:
    """The KV and cross-part ranges (CalibratedRanges) from the chain's outputs, as an observer.

    Min and max of every owner layer's new K and V entries (with 0: an empty cache slot holds zeros)
    and of every cross-part tensor. Prefill calls over whole samples suffice: a token's K/V depend only
    on the tokens before it, so decode steps over the same text produce the same entries. Cross-part
    tensors are taken whole (padding rows too): the next part quantizes all of them."""

    def __init__(self):
        self.kv: dict[tuple[str, int], list[float]] = {}
        self.boundary: dict[str, list[float]] = {}

    @staticmethod
    def _widen(store: dict, key: Any, value: np.ndarray) -> None:
        lo, hi = store.get(key, [0.0, 0.0])
        store[key] = [min(lo, float(value.min())), max(hi, float(value.max()))]

    def observe(self, _spec: GraphSpec, _feeds: Any, outputs: dict[str, np.ndarray], n: int) -> None:
        for name, value in outputs.items():
            m = CACHE_TENSOR.match(name)
            if m:
                new = value[..., :n] if "_key_" in name else value[..., :n, :]  # the real tokens only
                self._widen(self.kv, (m.group(1), int(m.group(2))), new)
            elif BOUNDARY_TENSOR.match(name):
                self._widen(self.boundary, name, value)

    def ranges(self) -> CalibratedRanges:
        return CalibratedRanges(
            kv={k: (v[0], v[1]) for k, v in self.kv.items()},
            boundary={k: (v[0], v[1]) for k, v in self.boundary.items()},
        )


def calibrate_kind(
    cfg: PipelineConfig,
    runner,
    role: str,
    samples: list[list[int]],
    decode_steps: int,
    scratch: Path,
    calibration_providers: list[str] | None = None,
    method: str = "minmax",
    stride: int | None = None,
    collector: RangeCollector | None = None,
) -> dict[str, tuple[Path, int, int | None]]:
    """Calibrate every graph of one kind in one pass of the float chain; per graph name: its ranges
    file (onnxruntime's calibration cache), how many calls it saw and its stride. The inputs each graph
    sees are those of `stages.calibration.graph_feeds`: prefill graphs the samples in AR chunks, decode
    graphs real decode steps after a prefill of each sample's beginning (whose caches are kept; the
    prefill graphs are released before the decode graphs load, as a full copy of the weights each)."""
    import onnx
    from tqdm import tqdm

    from stages.calibration import calls, decode_split

    expected = calls(samples, role, runner.prefill_ar, decode_steps)
    states: list[tuple[Any, list[int]]] = []
    if role == "decode":
        for sample in samples:
            head, tail = decode_split(sample, decode_steps)
            runner.reset()
            for i in range(0, len(head), runner.prefill_ar):
                runner.step(head[i : i + runner.prefill_ar], role="prefill")
            states.append((runner.snapshot(), tail))
        runner.release("prefill")
    calibrators: dict[str, ChainCalibrator] = {}
    try:
        for spec, src in tqdm(
            runner.graphs[role], desc=f"load {role} calibrators", unit="graph", leave=False
        ):
            work = scratch / spec.name
            work.mkdir(parents=True)
            copy_graph(src, work)
            # Which tensors get calibrated follows which nodes are quantized (the excluded PLE paths get
            # none); the overrides only replace ranges afterwards, so no ranges are needed yet.
            excluded = excluded_nodes(cfg, analyse(onnx.load(str(src), load_external_data=False)))
            qcfg = qnn_config(
                work / src.name,
                None,
                None,
                excluded,
                calibration_providers,
                method,
                graph_stride(stride, expected),
            )
            calibrators[spec.name] = ChainCalibrator(
                work / src.name, qcfg, expected, work, work / "ranges.json"
            )
            runner.use_session(src, calibrators[spec.name].session)
            # Its session holds what it needs: drop the copy and the augmented graph (a part's weights
            # each), so the scratch space is that of one graph, not of every graph of the kind.
            for f in list(work.iterdir()):
                f.unlink()
        runner.observer = collector.observe if collector else None
        with tqdm(total=expected, desc=f"calibrate {role} graphs", unit="call", leave=False) as progress:
            if role == "prefill":
                runner.prefill_samples(samples, progress)
            else:
                for state, tail in states:
                    runner.restore(state)
                    for tok in tail:
                        if runner.position + 1 > runner.context:
                            break
                        runner.step([tok], role="decode")
                        progress.update()
        for cal in calibrators.values():
            cal.finish()
    finally:
        runner.observer = None
        runner.release(role)
        for cal in calibrators.values():
            if cal.thread.is_alive():
                cal.reader.inbox.put(None)  # a failed pass: let the calibrator threads end
    return {
        name: (cal.ranges_file, cal.reader.count, cal.stride or None) for name, cal in calibrators.items()
    }


# ---- calibration on a twin at a larger AR ----
# The twin (stages.graphs.calibration_kind) is the same module exported at another AR: torch emits the
# same nodes in the same order, only some Reshape outputs are numbered differently (`view_8` here,
# `_unsafe_view` there). Each call's tensors hold the values the shipped graph computes for the same
# tokens, AR rows at once, so MinMax ranges agree up to float rounding (and the samples are cut to whole
# twin calls: no padding rows the shipped graph never sees). One exception: the attention scores
# before the mask (Q.K^T up to the mask's Add) also score each token against the later tokens of its
# chunk, masked afterwards; those ranges come out wider (1-12% on the tiny model), never narrower, so
# nothing is clipped (tests/integration/test_calibration_twin.py). The ranges move over node for node,
# after a check that the two graphs are wired alike.
def twin_tensor_names(twin: Path, graph: Path) -> dict[str, str]:
    """Twin tensor name -> the shipped graph's name for the same tensor, for every graph input and
    node output; QuantizeError when the two graphs are not the same nodes wired the same way."""
    import onnx

    a = onnx.load(str(twin), load_external_data=False).graph
    b = onnx.load(str(graph), load_external_data=False).graph
    names = {t.name: t.name for t in a.input}
    problem = None
    if [t.name for t in a.input] != [t.name for t in b.input]:
        problem = "their inputs differ"
    elif len(a.node) != len(b.node):
        problem = f"{len(a.node)} nodes against {len(b.node)}"
    else:
        for i, (x, y) in enumerate(zip(a.node, b.node, strict=True)):
            if (x.op_type, len(x.input), len(x.output)) != (y.op_type, len(y.input), len(y.output)):
                problem = f"node {i} is {x.op_type} in one and {y.op_type} in the other"
                break
            # Initializers (weights, shape constants) are not in `names`: only wiring is compared.
            if any(names.get(u, v) != v for u, v in zip(x.input, y.input, strict=True)):
                problem = f"node {i} ({x.op_type}) reads other tensors"
                break
            names.update(zip(x.output, y.output, strict=True))
    if problem is None and [names.get(t.name) for t in a.output] != [t.name for t in b.output]:
        problem = "their outputs differ"
    if problem:
        raise QuantizeError(
            f"the calibration twin {twin.name} is not node for node the graph {graph.name} ({problem}); "
            "calibrate on the shipped graphs instead: G4V69_CALIBRATION_AR=0 (re-exports)"
        )
    return names


def twin_ranges(twin: Path, graph: Path, ranges_file: Path, dest: Path) -> Path:
    """The twin's calibration cache (onnxruntime's JSON) with tensors named as in the shipped graph."""
    import json

    names = twin_tensor_names(twin, graph)
    cache = json.loads(ranges_file.read_text())
    cache["data"] = {names[k]: v for k, v in cache["data"].items() if k in names}
    dest.write_text(json.dumps(cache))
    return dest


# ---- the stage ----
@dataclass
class QuantizedGraphs:
    paths: dict[str, Path]
    kv_ranges: dict[str, list[float]]
    boundary_ranges: dict[str, list[float]]
    figures: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    weights: dict[str, Any] = field(default_factory=dict)  # WeightRounder.figures(), with its time


def quantize_graphs(
    cfg: PipelineConfig,
    export_dir: Path,
    out_dir: Path,
    samples: list[list[int]],
    decode_steps: int,
    calibration_providers: list[str] | None = None,
    method: str = "minmax",
    stride: int | None = None,
) -> QuantizedGraphs:
    """Calibrate every graph (one chain pass per graph kind), then quantize, rewrite the weights to the
    precision's scheme and audit each graph. The prefill pass also fixes the KV and cross-part ranges
    that every graph shares, so prefill graphs are quantized before the decode pass runs."""
    import shutil

    import onnx
    from tqdm import tqdm

    from stages.runner import HostRunner

    runner = HostRunner.from_export(export_dir, luts=True)
    # The prefill kind calibrates on its twin when the export made one (calibration_ar).
    twin = (
        HostRunner.from_export(export_dir, luts=True, calibration_twin=True)
        if calibration_kind(cfg)
        else None
    )
    luts = read_report(export_dir)["figures"]["luts"]
    result: QuantizedGraphs | None = None
    progress = tqdm(
        total=sum(len(g) for g in runner.graphs.values()), desc=f"quantize ({cfg.ple_policy})", unit="graph"
    )
    rounder: WeightRounder | None = None
    for role in ("prefill", "decode"):
        if role not in runner.graphs:
            continue
        # Scratch inside this stage's own folder (augmented graphs, ranges, links to the float graphs).
        with tempfile.TemporaryDirectory(prefix=".calibration-", dir=out_dir) as tmp:
            collector = RangeCollector() if role == "prefill" else None
            chain = twin if twin is not None and role == "prefill" else runner
            t0 = time.perf_counter()
            calibrated = calibrate_kind(
                cfg,
                chain,
                role,
                samples,
                decode_steps,
                Path(tmp),
                calibration_providers,
                method,
                stride,
                collector,
            )
            share = (time.perf_counter() - t0) / len(calibrated)  # the pass's time, split evenly
            if rounder is None and _has_4bit_weights(cfg):
                # After the prefill calibration (its sessions released): Hessians, then every 4-bit
                # weight rounded once (decode graphs hold the same weights), then the Hessians go.
                t0 = time.perf_counter()
                hessians = None
                if cfg.weight_rounding != "nearest":
                    watched = {w for _, src in chain.graphs["prefill"] for w in _4bit_weights(cfg, src)}
                    hessians = collect_hessians(
                        chain, samples[:HESSIAN_SAMPLES], watched, Path(tmp) / "hessians"
                    )
                rounder = WeightRounder(cfg, hessians)
                del hessians  # round_all drops them when done
                graphs = [src for _, src in runner.graphs[role]]
                rounder.round_all(graphs, Path(tmp) / "hessians-kept" if rounder.searches else None)
                int8_share = cfg.decoder_scheme.int8_share  # not `share`: the pass's time, used below
                if int8_share:
                    rounder.measure(chain, sensitivity_samples(samples), Path(tmp) / "sensitivity")
                    rounder.int8_weights = rounder.choose_int8(int8_share)
                if rounder.searches:
                    rounder.search_scales(graphs)
                rounding_s = time.perf_counter() - t0
            if collector is not None:
                ranges = collector.ranges()
                result = QuantizedGraphs(
                    paths={},
                    kv_ranges={f"{k}_{layer}": list(v) for (k, layer), v in sorted(ranges.kv.items())},
                    boundary_ranges={k: list(v) for k, v in sorted(ranges.boundary.items())},
                )
                if rounder is not None:
                    result.weights = {**rounder.figures(), "rounding_s": round(rounding_s, 1)}
            for spec, src in runner.graphs[role]:
                t0 = time.perf_counter()
                calibrated_on = spec.name
                if chain is twin:
                    twin_spec, twin_src = twin.graphs["prefill"][spec.part - 1]
                    calibrated_on = twin_spec.name
                    ranges_file, count, graph_stride_used = calibrated[twin_spec.name]
                    ranges_file = twin_ranges(
                        twin_src, src, ranges_file, Path(tmp) / f"{spec.name}.ranges.json"
                    )
                else:
                    ranges_file, count, graph_stride_used = calibrated[spec.name]
                model = onnx.load(str(src), load_external_data=False)
                analysis = analyse(model)
                io_names = {t.name for t in (*model.graph.input, *model.graph.output)}
                del model
                overrides, excluded = quant_settings(cfg, analysis, ranges, io_names, luts)
                linked = copy_graph(src, Path(tmp) / spec.name / "quantize")
                qcfg = qnn_config(
                    linked, None, overrides, excluded, calibration_providers, method, graph_stride_used
                )
                dest = out_dir / qdq_file_name(spec.name)
                quantize_with_ranges(linked, dest, qcfg, ranges_file)
                shutil.rmtree(linked.parent)
                if rounder is not None:
                    rewrite_weights(cfg, src, dest, rounder)
                qmodel = onnx.load(str(dest), load_external_data=False)
                lut_inputs = lut_input_encodings(luts, {i.name for i in qmodel.graph.input})
                if read_lut_inputs_quantized(qmodel, lut_inputs):
                    # Weights stay where they are: an external-data graph keeps its references.
                    onnx.save(qmodel, str(dest))
                checked = audit(
                    cfg, qmodel, analysis, lut_inputs, rounder.int8_weights if rounder else frozenset()
                )
                result.problems += [f"{spec.name}: {p}" for p in checked["problems"]]
                result.paths[spec.name] = dest
                result.figures.append(
                    {
                        "name": spec.name,
                        "qdq_onnx": dest.name,
                        "calibrated_on": calibrated_on,
                        "calibration_calls": count,
                        "calibration_stride": graph_stride_used,
                        "quantize_s": round(share + time.perf_counter() - t0, 3),
                        "kv_layers": sorted(f"{k}_{layer}" for k, layer in analysis.kv_groups),
                        "audit": checked,
                    }
                )
                progress.update()
    progress.close()
    assert result is not None  # every export has prefill graphs
    return result


def _quality(cfg, export_dir: Path, q: QuantizedGraphs, eval_samples, decode_steps) -> dict[str, Any]:
    from stages.runner import HostRunner

    fp = HostRunner.from_export(export_dir, luts=True)
    quantized = HostRunner.from_export(
        export_dir, luts=True, graph_dir=next(iter(q.paths.values())).parent, fold_weights=True
    )
    # Float logits from the twin when prefill is the only kind: the same chain computed AR rows per
    # call (a held-out token is then 1/AR of a float call; the quantized side stays the shipped graphs).
    one_kind = not cfg.separate_prefill_and_decode
    fp_chain = (
        HostRunner.from_export(export_dir, luts=True, calibration_twin=True)
        if calibration_kind(cfg) and one_kind
        else fp
    )
    chains = compare_chains(fp_chain, quantized, eval_samples, decode_steps)
    prefill = {name: p for name, p in q.paths.items() if name.startswith("prefill")}
    # One sample's first SQNR_TOKENS: the per-graph SQNR reruns the float chain up to each graph, which
    # at AR-1 is a part call per token per graph (the whole tiny sample; a quarter of an E2B one).
    return {**chains, "sqnr_db": output_sqnr(fp, prefill, [eval_samples[0][:SQNR_TOKENS]])}


def _guarded(fn, *args):
    """Turn a broken graph file into an error that says which export to redo."""
    from google.protobuf.message import DecodeError
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf

    try:
        return fn(*args)
    except (DecodeError, Fail, InvalidGraph, InvalidProtobuf) as e:
        raise QuantizeError(
            f"an exported graph cannot be read ({e.__class__.__name__}: {str(e)[:200]}); "
            "the exported/ folder is corrupt or from another export: run `make export` again"
        ) from None


def _providers(provider: str) -> list[str]:
    """onnxruntime providers for calibration; ROCm only where an AMD GPU and the ROCm build are present."""
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if provider != "rocm":
        raise QuantizeError(f"--provider {provider!r} is not allowed; allowed values: cpu, rocm")
    import onnxruntime as ort

    if "ROCMExecutionProvider" not in ort.get_available_providers():
        raise QuantizeError(
            "--provider rocm: this onnxruntime has no ROCMExecutionProvider; run in the quant-rocm image "
            "(make quantize QUANT_IMAGE=quant-rocm QUANT_ARGS=--provider=rocm) or use --provider cpu"
        )
    if not Path("/dev/kfd").exists():
        raise QuantizeError(
            "--provider rocm: no AMD GPU here (/dev/kfd is missing; pass --device /dev/kfd "
            "--device /dev/dri to docker); use --provider cpu"
        )
    return ["ROCMExecutionProvider", "CPUExecutionProvider"]


def run_quantize(
    cfg: PipelineConfig,
    workdir: Path,
    checkpoint_dir: Path,
    calibration_files: list[Path] | None = None,
    compare_ple_policies: bool = False,
    provider: str = "cpu",
    method: str = "minmax",
    stride: int | None = None,
    compare_precisions: bool = False,
) -> dict[str, Any]:
    """The whole stage; returns the report. Bad input raises QuantizeError and leaves nothing."""
    import dataclasses
    import shutil
    import tempfile

    from stages.calibration import load_texts, token_samples
    from stages.chat import ChatTokenizer

    calibration_providers = _providers(provider)
    export_dir = output_dir(workdir, "export")
    report = read_report(export_dir)
    if report is None:
        raise QuantizeError(
            f"{export_dir} holds no finished export (no {REPORT_NAME}); run `make export` first"
        )
    missing = [g["onnx"] for g in report["figures"]["graphs"] if not (export_dir / g["onnx"]).is_file()]
    if missing:
        raise QuantizeError(
            f"{export_dir} is incomplete: {', '.join(missing)} missing; run `make export` again"
        )
    check_inputs(workdir, [export_dir, checkpoint_dir], cfg)
    from stages.checkpoint import Checkpoint

    tok = ChatTokenizer(checkpoint_dir)
    bos = Checkpoint(checkpoint_dir).geometry.config.get("bos_token_id", 2)
    # A sample must fit the context the graphs were built for (whole prefill chunks); on a twin, whole
    # twin calls (a padded row would widen ranges with values the shipped graphs never compute).
    twin = calibration_kind(cfg)
    ar = twin.ar if twin else cfg.prefill_ar
    length = min(cfg.calibration_tokens, cfg.max_context - cfg.max_context % ar)
    if twin:
        length -= length % ar
    texts = load_texts(cfg, "calibration", calibration_files)
    samples = token_samples(texts, tok.encode, bos, cfg.calibration_samples, length)
    eval_samples = token_samples(
        load_texts(cfg, "heldout", None), tok.encode, bos, EVAL_SAMPLES, min(length, 512)
    )
    decode_steps = min(DECODE_CALIBRATION_STEPS, length // 2)
    out_dir = output_dir(workdir, "quantize")
    options = {"model": cfg.model, **{k: getattr(cfg, k) for k in stage_fields("quantize")}}
    inputs = [export_dir / REPORT_NAME] + [export_dir / g["onnx"] for g in report["figures"]["graphs"]]
    # QDQ graphs at the weight bits, plus one float graph's calibration copies at a time.
    graph_bytes = [g["bytes"] for g in report["figures"]["graphs"]]
    need = sum(graph_bytes) * cfg.precision_info.weight_bits // 32 + 2 * max(graph_bytes)
    with stage_output("quantize", out_dir, inputs, options, root=workdir, need_bytes=need) as run:

        def quantize_with(policy_cfg: PipelineConfig, out: Path) -> QuantizedGraphs:
            return _guarded(
                quantize_graphs,
                policy_cfg,
                export_dir,
                out,
                samples,
                decode_steps,
                calibration_providers,
                method,
                stride,
            )

        main = quantize_with(cfg, run.dir)
        if main.problems:
            raise QuantizeError("the quantized graphs break the rules: " + "; ".join(main.problems[:5]))
        encodings: dict[str, set] = defaultdict(set)
        for g in main.figures:
            for key, found in g["audit"]["kv_encodings"].items():
                encodings[key] |= {tuple(e) for e in found}
        split = [k for k, v in encodings.items() if len(v) != 1]
        if split:
            raise QuantizeError(f"KV caches {', '.join(split)} differ in encoding between graphs")
        quality = {cfg.ple_policy: _quality(cfg, export_dir, main, eval_samples, decode_steps)}
        # The absolute floor (the preset's, for this precision): below it nothing is kept.
        from stages.quality import below_floor

        below = below_floor(cfg, quality[cfg.ple_policy])
        if below:
            raise QuantizeError(below)
        if compare_ple_policies:
            for policy in (p for p in ("float16", "int16", "int8") if p != cfg.ple_policy):
                with tempfile.TemporaryDirectory(dir=run.dir) as tmp:
                    other = quantize_with(dataclasses.replace(cfg, ple_policy=policy), Path(tmp))
                    quality[policy] = {
                        **_quality(cfg, export_dir, other, eval_samples, decode_steps),
                        "audit_problems": other.problems,
                    }
                    shutil.rmtree(tmp, ignore_errors=True)
        # The other precisions on the same exported graphs (cut for this precision: the cut points
        # move nothing but which part a layer sits in), so the report ranks the weight schemes.
        by_precision = {cfg.precision: quality[cfg.ple_policy]}
        if compare_precisions:
            from stages.precision import PRECISIONS

            for name, prec in PRECISIONS.items():
                if name == cfg.precision or prec.not_built or not prec.runs_on(cfg.soc_info):
                    continue
                other_cfg = dataclasses.replace(cfg, precision=name, int8_percent="auto")
                with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                    other = quantize_with(other_cfg, Path(tmp))
                    by_precision[name] = {
                        **_quality(cfg, export_dir, other, eval_samples, decode_steps),
                        "audit_problems": other.problems,
                        "int8_percent": other_cfg.mixed_percent,
                    }
        run.figures.update(
            {
                "soc": cfg.soc,
                "precision": cfg.precision,
                "weight_scheme": cfg.decoder_scheme.name,
                "lm_head_scheme": cfg.lm_head_scheme.name,
                "weights": main.weights,
                "quality_by_precision": by_precision,
                "kv_cache_bits": cfg.kv_cache_bits,
                "ple_policy": cfg.ple_policy,
                "ple_lut_bits": report["figures"]["luts"].get("per_layer_embedding", {}).get("bits"),
                "calibration": {
                    "dataset": cfg.calibration_dataset,
                    "files": [str(f) for f in calibration_files or []],
                    "samples": len(samples),
                    "tokens_per_sample": length,
                    "decode_steps_per_sample": decode_steps,
                    "tokens_per_call": ar,
                    "on_twin": twin is not None,
                    "method": method,
                    "stride": stride,
                },
                "evaluation": {"samples": len(eval_samples), "tokens_per_sample": len(eval_samples[0])},
                "kv_ranges": main.kv_ranges,
                "boundary_ranges": main.boundary_ranges,
                "graphs": main.figures,
                "quality": quality,
            }
        )
        write_quality_html(run.dir / "quality.html", run.figures)
    return read_report(out_dir)
