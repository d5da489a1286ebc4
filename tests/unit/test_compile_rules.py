"""The compile rules check refuses a context over its SoC's per-context allocation limit before any
compiler runs (synthetic graph: the weight is described, never allocated)."""

from __future__ import annotations

from onnx import TensorProto, helper

from stages.compile import COMPILER_ESTIMATE, binary_allocation, check_rules, io_bytes, weight_bytes
from stages.core.soc import get_soc
from stages.model.graphs import Binary

GIB = 1 << 30


def _graph_with_weight(weight_bytes_: int, data_type: int = TensorProto.INT8):
    """A MatMul whose int8 weight is `weight_bytes_` long; its data lives "elsewhere" (external), so
    the test holds no weight in memory: the rules read sizes from dims, as onnx.load(load_external_data=
    False) leaves them."""
    rows = 1536
    elems = weight_bytes_ * (2 if data_type == TensorProto.INT4 else 1)
    w = TensorProto(name="w", data_type=data_type, dims=[rows, elems // rows])
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value="w.data")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.UINT16, [1, 1, rows])],
        [helper.make_tensor_value_info("y", TensorProto.UINT16, [1, 1, elems // rows])],
        [w],
    )
    return helper.make_model(graph)


def test_a_2_1_gib_context_is_refused_on_v69_but_not_on_v73():
    model = _graph_with_weight(int(2.1 * GIB))
    layout = [Binary("big.bin", 1, ("big",))]
    problems = check_rules(get_soc("SM8450"), layout, {"big": model}, {})
    assert len(problems) == 1
    assert "big.bin: needs an estimated allocation of at least" in problems[0]
    assert "over SM8450's per-context limit of 2097152 KB (v69)" in problems[0]
    assert check_rules(get_soc("SM8550"), layout, {"big": model}, {}) == []


def test_a_1_9_gib_context_passes_on_v69():
    model = _graph_with_weight(int(1.9 * GIB))
    assert check_rules(get_soc("SM8450"), [Binary("ok.bin", 1, ("ok",))], {"ok": model}, {}) == []


def test_4bit_weights_count_half_a_byte_each():
    model = _graph_with_weight(int(1.5 * GIB), TensorProto.INT4)
    assert weight_bytes(model) == int(1.5 * GIB) // 1536 * 1536
    assert io_bytes(model) == 2 * 1536 + 2 * (2 * int(1.5 * GIB) // 1536)
    assert binary_allocation([model]) == weight_bytes(model) + io_bytes(model)


def test_the_compiler_s_own_estimate_is_read_from_its_refusal():
    # The message QNN's context-binary generator gave for Gemma 4 E2B on a Galaxy S22 target
    # (docs/facts.md §2).
    m = COMPILER_ESTIMATE.search(
        "ERROR: graph requires estimated allocation of 5404364 KB, limit is 2097152 KB"
    )
    assert m and (int(m.group(1)), int(m.group(2))) == (
        5404364,
        get_soc("SM8450").limits.context_allocation.bytes // 1024,
    )
