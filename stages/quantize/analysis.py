"""What a graph holds, read off its nodes: the activation x activation MatMuls, the KV-cache groups that
share one encoding, the per-layer-embedding path and the MatMul weights (`analyse`)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from stages.core.errors import UserFixable
from stages.model.contract import (
    CACHE_PREFIX,
    HIDDEN_PREFIX,
    KVSHARE_PREFIX,
    PER_LAYER_EMBEDS,
    PER_LAYER_INPUTS,
)

# Ops that move or regroup values without changing them: a tensor and its image share an encoding.
ENCODING_PRESERVING = {"Concat", "Slice", "Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze"}
CACHE_TENSOR = re.compile(rf"^(?:{'|'.join(CACHE_PREFIX.values())})_(key|value)_(\d+)_h\d+_(?:in|out)$")
# Tensors that leave one part and enter the next (the kvshare ones are pinned with their cache).
BOUNDARY_TENSOR = re.compile(rf"^(?:{HIDDEN_PREFIX}\d+|{PER_LAYER_EMBEDS})$")
KVSHARE_TENSOR = re.compile(rf"^{KVSHARE_PREFIX}(key|value)_(\d+)$")
PLE_START_WEIGHTS = ("per_layer_model_projection.weight", "per_layer_input_gate.weight")
# Each layer's PLE path ends at its projection MatMul: the RMSNorm after it reads a quantized input.
# Kept float (fp16 on the HTP) that norm's output fed a quantized residual Add, and QAIRT's v69
# graph finalization (optimization mode 3) fails on that fp16 RMSNorm -> Quantize -> Add at AR > 1
# (QNN_COMMON_ERROR_MEM_ALLOC, "could not create op: q::SlicePad_shape_inplace"; found bisecting the
# E2B AR-32 part 1 down to one layer: the same layer with the norm quantized compiles). The residual
# stream stays in uint16 either way.
PLE_END_WEIGHT = "per_layer_projection.weight"
PLE_GRAPH_INPUTS = {PER_LAYER_INPUTS, PER_LAYER_EMBEDS}
# Weights of the PLE paths: the int16 policy gives these 16-bit.
PLE_WEIGHT_SUFFIXES = (
    "per_layer_model_projection.weight",
    "per_layer_projection_norm.weight",
    "per_layer_input_gate.weight",
    "per_layer_projection.weight",
)


class QuantizeError(UserFixable, ValueError):
    pass


# ---- graph analysis ----
@dataclass
class GraphAnalysis:
    act_matmuls: list[tuple[str, str]]  # (node, second input) of MatMuls with no weight input
    kv_groups: dict[tuple[str, int], set[str]]  # (key|value, layer) -> tensors sharing one encoding
    ple_nodes: list[str]
    matmul_weights: list[str]
    # Outputs of activation x weight MatMuls. One that a KV group reaches (Gemma 3's V projection feeds
    # the value cache through a Reshape and a Transpose only) stays 16-bit and is converted to the
    # cache's encoding: the v69 HTP has no such MatMul with an 8-bit output (onnxruntime-qnn 2.7.0
    # refuses its weight's DequantizeLinear; tests/integration/test_gemma3.py).
    weight_matmul_outputs: frozenset[str] = frozenset()


def analyse(model) -> GraphAnalysis:
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[Any]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)

    act_matmuls, weights, weighted_outputs = [], [], set()
    for n in graph.node:
        if n.op_type == "MatMul":
            if n.input[1] in inits:
                weights.append(n.input[1])
                weighted_outputs.add(n.output[0])
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
        if (weight_of[n.name] or "").endswith("." + PLE_END_WEIGHT):
            continue
        for o in n.output:
            todo += consumers.get(o, [])
    order = {n.name: i for i, n in enumerate(graph.node)}
    return GraphAnalysis(
        act_matmuls, kv_groups, sorted(ple, key=order.get), weights, frozenset(weighted_outputs)
    )
