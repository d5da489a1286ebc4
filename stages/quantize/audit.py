"""The audit of every quantized graph: KV and activation-matmul widths, the PLE policy tensor by tensor,
each weight against its scheme (block-scale ranges included), no float tensor left outside the policy."""

from __future__ import annotations

from typing import Any

import numpy as np

from stages.core.config import PipelineConfig
from stages.core.precision import LPBQ_BLOCK_SCALE_MAX
from stages.model.encoding import ONNX_TYPE_NAMES, Encoding, QdqGraph
from stages.quantize.analysis import (
    GraphAnalysis,
)
from stages.quantize.weights import (
    _weight_name,
    expected_scheme,
    lpbq_block,
    weight_role,
)


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
    kept_grids: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Final types in a QDQ graph: KV operands, the PLE paths, float tensors left behind, and the
    LUT-fed inputs (`lut_input_encodings`), each of which must be read with exactly its LUT's encoding.
    `kept_grids` (weight name -> its RoundedWeight) are weights on their checkpoint's own grid: each
    must hold exactly those integers, in blocks of that grid's group where it has block scales."""
    view = QdqGraph(qmodel.graph)
    problems: list[str] = []
    act = _activation_matmuls(cfg, qmodel.graph, analysis, view, problems)
    kv_encodings = _kv_encodings(qmodel.graph, analysis, view, problems)
    weights = _weights(cfg, qmodel.graph, view, int8_weights, kept_grids or {}, problems)
    ple = _ple_tensors(cfg, qmodel.graph, analysis, view, problems)
    leftover = _float_leftovers(qmodel.graph, analysis, view, problems)
    lut_fed = _lut_inputs(qmodel.graph, lut_inputs, view, problems)
    return {
        "activation_matmuls": act,
        "weights": weights,
        "kv_encodings": kv_encodings,
        "ple_tensors": ple,
        "float_leftovers": leftover,
        "lut_inputs": lut_fed,
        "problems": problems,
    }


def _activation_matmuls(
    cfg, graph, analysis: GraphAnalysis, view, problems: list[str]
) -> list[dict[str, Any]]:
    """The MatMuls of two activations (attention's), each operand's type: without 16x16 matmuls the
    second must be the KV cache's width."""
    tensor_type = view.stored_type
    nodes = {n.name: n for n in graph.node}
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
    return act


def _kv_encodings(graph, analysis: GraphAnalysis, view, problems: list[str]) -> dict[str, list]:
    """One encoding per KV group: the cache input, the new entries and what the MatMul reads."""
    import onnx

    inits = view.inits
    scale_of = {}
    for n in graph.node:
        if n.op_type == "QuantizeLinear" and n.input[1] in inits:
            zp = inits[n.input[2]] if len(n.input) > 2 and n.input[2] in inits else None
            scale_of[n.input[0]] = (
                float(onnx.numpy_helper.to_array(inits[n.input[1]])),
                int(onnx.numpy_helper.to_array(zp)) if zp is not None else 0,
            )
    # A 16-bit MatMul product converted to the cache's encoding (GraphAnalysis.weight_matmul_outputs)
    # is read by the group through onnxruntime's convert, t -> Q -> DQ -> Q' -> DQ': its encoding in
    # the group is Q''s, the Quantize of the first DequantizeLinear's output.
    dequantized = {n.input[0]: n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    quantized = {n.input[0]: n.output[0] for n in graph.node if n.op_type == "QuantizeLinear"}

    def group_encoding(t: str):
        if t in analysis.weight_matmul_outputs:
            converted = dequantized.get(quantized.get(t, ""), "")
            if converted in scale_of:
                return scale_of[converted]
        return scale_of.get(t)

    kv_encodings = {}
    for (which, layer), tensors in sorted(analysis.kv_groups.items()):
        found = {group_encoding(t) for t in tensors} - {None}
        kv_encodings[f"{which}_{layer}"] = sorted(found)
        if len(found) != 1:
            problems.append(f"{which} cache of layer {layer}: {len(found)} encodings {sorted(found)}")
    return kv_encodings


def _weights(
    cfg: PipelineConfig,
    graph,
    view,
    int8_weights: frozenset[str],
    kept_grids: dict[str, Any],
    problems: list[str],
) -> list[dict[str, Any]]:
    """Every MatMul weight with the bits and layout its precision (or the PLE policy) gives it, a
    kept checkpoint grid's integers exactly."""
    inits, producer = view.inits, view.producer
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
        kept = kept_grids.get(name)
        if kept is not None and kept.block_scales is not None:
            want_block = kept.q.shape[0] // kept.block_scales.shape[0]
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
        if ok and kept is not None:
            entry["checkpoint_grid"] = "kept"
            entry["checkpoint_integers"], bad = _checkpoint_integers(inits[dq.input[0]], kept.checkpoint_q)
            problems += [f"{name}: {p}" for p in bad]
    return weights


def _checkpoint_integers(stored_init, checkpoint: np.ndarray) -> tuple[dict[str, int], list[str]]:
    """A kept weight's stored integers against its checkpoint's own (in, out), not against what the
    rounder wrote: equal in every output channel, except one holding a +8 that int4 cannot store (a
    Q4_0 group under a negative scale), whose integers may move (GPTQ carries the clipped step's
    error); those are counted."""
    from onnx import numpy_helper

    stored = numpy_helper.to_array(stored_init).astype(np.int16)
    if stored.shape != checkpoint.shape:
        return {}, [f"stored as {stored.shape}, its checkpoint's integers are {checkpoint.shape}"]
    clipped = (checkpoint > 7).any(axis=0)
    apart = stored != checkpoint
    figures = {
        "equal": int((~apart).sum()),
        "moved_in_clipped_channels": int(apart[:, clipped].sum()),
        "clipped_channels": int(clipped.sum()),
    }
    wrong = int(apart[:, ~clipped].sum())
    bad = [f"{wrong} integers differ from its checkpoint's in channels with nothing clipped"] if wrong else []
    return figures, bad


def _ple_tensors(
    cfg: PipelineConfig, graph, analysis: GraphAnalysis, view, problems: list[str]
) -> list[dict[str, Any]]:
    """Every input of the PLE path's nodes, typed as the PLE policy wants it."""
    inits, producer, tensor_type = view.inits, view.producer, view.stored_type
    nodes = {n.name: n for n in graph.node}
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
    return ple


def _float_leftovers(graph, analysis: GraphAnalysis, view, problems: list[str]) -> list[str]:
    """Float inputs outside the PLE policy: none may be left."""
    inits, tensor_type = view.inits, view.stored_type
    ple_names = set(analysis.ple_nodes)
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
    return leftover


def _lut_inputs(graph, lut_inputs: dict[str, Encoding], view, problems: list[str]) -> dict[str, Any]:
    """Each LUT-fed input read with exactly its LUT's encoding."""
    import onnx

    inits = view.inits
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
    return lut_fed
