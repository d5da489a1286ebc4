"""Calibration: activation ranges from the float chain on real text, through onnxruntime's calibrators and
quantizer in two steps (calibrate, then quantize from the ranges), one chain pass for every graph of a
kind, and ranges moved over from a twin at a larger AR."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.config import PipelineConfig
from stages.model.contract import (
    PER_LAYER_EMBEDS,
    GraphSpec,
    LutSpec,
    constructed_input_ranges,
)
from stages.model.graphs import copy_graph
from stages.quantize.analysis import (
    BOUNDARY_TENSOR,
    CACHE_TENSOR,
    PLE_WEIGHT_SUFFIXES,
    GraphAnalysis,
    QuantizeError,
    analyse,
)
from stages.quantize.weights import (
    lut_input_encodings,
)

DECODE_CALIBRATION_STEPS = 64


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


# ---- calibration ----
class _FeedsReader:
    """An onnxruntime CalibrationDataReader over a stream of feeds."""

    def __init__(self, feeds: Iterator[dict[str, np.ndarray]], expected: int, desc: str = "calibrate"):
        from stages.core.progress import tqdm

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
    from stages.core.progress import tqdm

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
    luts: dict[str, LutSpec],
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
            kv = {"quant_type": kv_type, "rmin": np.float32(lo), "rmax": np.float32(hi)}
            if t in analysis.weight_matmul_outputs and kv_type != QuantType.QUInt16:
                # The product itself stays 16-bit (its calibrated range); one Convert then gives it
                # the cache's encoding (GraphAnalysis.weight_matmul_outputs says why).
                overrides[t] = [{"quant_type": QuantType.QUInt16, "convert": kv}]
            else:
                overrides[t] = [kv]
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
        # Genie can copy rows into the input tensor without requantizing (a 4-bit LUT: an exact x16).
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
    luts: dict[str, LutSpec],
    samples: list[list[int]],
    decode_steps: int,
    calibration_providers: list[str] | None = None,
    method: str = "minmax",
    stride: int | None = None,
) -> GraphQuantSetup:
    """One graph's configuration with a reader that runs the float chain for it alone (parts 1..k per
    call): the reference that the stage's shared pass (calibrate_kind) must equal, graph for graph."""
    import onnx

    from stages.quant.calibration import calls, graph_feeds

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
    sees are those of `stages.quant.calibration.graph_feeds`: prefill graphs the samples in AR chunks, decode
    graphs real decode steps after a prefill of each sample's beginning (whose caches are kept; the
    prefill graphs are released before the decode graphs load, as a full copy of the weights each)."""
    import onnx

    from stages.core.progress import tqdm
    from stages.quant.calibration import calls, decode_split

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
    loading = tqdm(total=len(runner.graphs[role]), desc=f"load {role} calibrators", unit="graph", leave=False)

    def calibrator(spec, src: Path) -> Any:
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
        calibrators[spec.name] = ChainCalibrator(work / src.name, qcfg, expected, work, work / "ranges.json")
        # Its session holds what it needs: drop the copy and the augmented graph (a part's weights
        # each), so the scratch space is that of one graph, not of every graph of the kind.
        for f in list(work.iterdir()):
            f.unlink()
        loading.update()
        return calibrators[spec.name].session

    try:
        with runner.standing_in(role, calibrator, collector.observe if collector else None):
            loading.close()
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
        loading.close()
        for cal in calibrators.values():
            if cal.thread.is_alive():
                cal.reader.inbox.put(None)  # a failed pass: let the calibrator threads end
    return {
        name: (cal.ranges_file, cal.reader.count, cal.stride or None) for name, cal in calibrators.items()
    }


# ---- calibration on a twin at a larger AR ----
# The twin (stages.model.graphs.calibration_kind) is the same module exported at another AR: torch emits the
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
