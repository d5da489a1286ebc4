"""The compile stage with the real onnxruntime-qnn compiler: the trained tiny model's quantized
graphs become v69 (and v73) context binaries; the rules check stops what v69 cannot run."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stages.compile import CompileError, check_rules, compile_local, run_compile
from stages.core.config import load_config
from stages.core.report import IntegrityError
from stages.core.soc import get_soc
from stages.model.contract import HIDDEN_PREFIX, PER_LAYER_EMBEDS
from stages.model.encoding import prepare_io
from stages.model.graphs import Binary
from stages.quantize import run_quantize
from tests.conftest import copy_workdir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sm8450(quantized_tiny, tmp_path_factory):
    work = copy_workdir(quantized_tiny, tmp_path_factory.mktemp("compile") / "w")
    return work, run_compile(load_config("tiny"), work)


def test_tiny_model_compiles_to_v69_binaries(sm8450):
    work, report = sm8450
    fig = report["figures"]
    assert (fig["soc"], fig["soc_model"], fig["dsp_arch"]) == ("SM8450", 36, "v69")
    assert fig["backend"]["name"] == "local" and fig["backend"]["qairt_version"].startswith("2.51.")
    # v69: no weight sharing, so prefill and decode of each part are separate binaries, part 1 first.
    assert [b["file"] for b in fig["binaries"]] == [
        "prefill_ar4_part1_of_2.bin",
        "decode_ar1_part1_of_2.bin",
        "prefill_ar4_part2_of_2.bin",
        "decode_ar1_part2_of_2.bin",
    ]
    for b in fig["binaries"]:
        path = work / "compiled" / b["file"]
        assert path.stat().st_size == b["bytes"] > 100_000
        assert (b["soc_type"], b["arch"], b["weight_shared"]) == ("SM8450", 69, False)
        assert b"soc_type=SM8450;arch=69" in path.read_bytes()
        # Renamed inside the binary so that Genie, which runs a variant's graphs in name order, runs
        # part 1 first.
        name = b["graphs"][0]["qnn_graph_name"]
        assert len(b["graphs"]) == 1 and name.startswith(f"part{b['part']:03d}_of_002_")
        assert name.encode() in path.read_bytes()
        assert b["peak_rss_bytes"] > 0
    assert sorted(p.name for p in (work / "compiled").iterdir()) == sorted(
        [b["file"] for b in fig["binaries"]] + ["report.json"]
    )


def test_binary_io_is_quantized_with_the_pinned_encodings(sm8450):
    work, report = sm8450
    luts = json.loads((work / "exported" / "report.json").read_text())["figures"]["luts"]
    graphs = {g["name"]: g["io"] for b in report["figures"]["binaries"] for g in b["graphs"]}
    for name, io in graphs.items():
        for direction in ("inputs", "outputs"):
            for tensor, enc in io[direction].items():
                if "_key_" in tensor or "_value_" in tensor or tensor == "per_layer_inputs":
                    assert enc["dtype"] == "uint8", (name, tensor)
                elif tensor == PER_LAYER_EMBEDS:
                    assert enc["dtype"] == "float32", (name, tensor)  # the float16 PLE policy
                else:
                    assert enc["dtype"] == "uint16", (name, tensor)
    # Both LUT-fed inputs read the LUT's bytes as they are (the float16 PLE policy's per-layer input
    # too): the same datatype, offset and scale, to the bit, in prefill and decode.
    for tensor, key in (("inputs_embeds", "embedding"), ("per_layer_inputs", "per_layer_embedding")):
        for graph in ("prefill_ar4_part1_of_2", "decode_ar1_part1_of_2"):
            enc = graphs[graph]["inputs"][tensor]
            assert enc["dtype"] == f"uint{luts[key]['bits']}"
            assert (enc["scale"], enc["offset"]) == (luts[key]["scale"], luts[key]["offset"])
            assert np.float32(enc["scale"]) == enc["scale"]  # a float32, as the binary holds it
    # Part 1's hidden-state output is part 2's input, byte for byte, in prefill and decode.
    (hidden,) = [t for t in graphs["prefill_ar4_part1_of_2"]["outputs"] if t.startswith(HIDDEN_PREFIX)]
    encs = [
        {k: v for k, v in graphs[g][d][hidden].items() if k != "shape"}
        for g, d in [
            ("prefill_ar4_part1_of_2", "outputs"),
            ("decode_ar1_part1_of_2", "outputs"),
            ("prefill_ar4_part2_of_2", "inputs"),
            ("decode_ar1_part2_of_2", "inputs"),
        ]
    ]
    assert all(e == encs[0] for e in encs)


def test_v73_soc_gets_one_weight_shared_binary_per_part(quantized_tiny, tmp_path):
    work = copy_workdir(quantized_tiny, tmp_path / "w")
    cfg = load_config("tiny", {"soc": "SM8550"})
    run_quantize(cfg, work, work / "checkpoints" / "tiny")
    fig = run_compile(cfg, work)["figures"]
    assert [b["file"] for b in fig["binaries"]] == ["part1_of_2.bin", "part2_of_2.bin"]
    for b in fig["binaries"]:
        assert (b["soc_type"], b["arch"], b["weight_shared"]) == ("SM8550", 73, True)
        assert [g["name"] for g in b["graphs"]] == [
            f"prefill_ar4_part{b['part']}_of_2",
            f"decode_ar1_part{b['part']}_of_2",
        ]
        kv = [e for g in b["graphs"] for t, e in g["io"]["inputs"].items() if "_key_" in t]
        assert kv and all(e["dtype"] == "uint16" for e in kv)  # v73 keeps 16-bit KV


def test_a_soc_mismatch_between_quantize_and_compile_is_refused(sm8450):
    work, _ = sm8450
    # The generic check every stage makes of its upstream's config fields (stages.core.report.check_inputs).
    with pytest.raises(IntegrityError, match=r"another config: soc='SM8550' \(it ran with 'SM8450'\)"):
        run_compile(load_config("tiny", {"soc": "SM8550"}), work)
    assert (work / "compiled" / "report.json").is_file()  # the earlier output is untouched


# ---- a deliberately bad graph ----
def _qdq_matmul(path, b_bits: int) -> None:
    """Y = A @ B with both operands activations: A uint16, B uint16 or uint8."""
    b_type = np.uint16 if b_bits == 16 else np.uint8
    inits = [
        numpy_helper.from_array(np.array(0.001, np.float32), "a_s"),
        numpy_helper.from_array(np.array(32768, np.uint16), "a_z"),
        numpy_helper.from_array(np.array(0.01, np.float32), "b_s"),
        numpy_helper.from_array(np.array(2 ** (b_bits - 1), b_type), "b_z"),
        numpy_helper.from_array(np.array(0.01, np.float32), "y_s"),
        numpy_helper.from_array(np.array(32768, np.uint16), "y_z"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["A", "a_s", "a_z"], ["A_q"]),
        helper.make_node("DequantizeLinear", ["A_q", "a_s", "a_z"], ["A_dq"]),
        helper.make_node("QuantizeLinear", ["B", "b_s", "b_z"], ["B_q"]),
        helper.make_node("DequantizeLinear", ["B_q", "b_s", "b_z"], ["B_dq"]),
        helper.make_node("MatMul", ["A_dq", "B_dq"], ["Y_f"], name="scores"),
        helper.make_node("QuantizeLinear", ["Y_f", "y_s", "y_z"], ["Y_q"]),
        helper.make_node("DequantizeLinear", ["Y_q", "y_s", "y_z"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention_scores",
        [
            helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 1, 16, 64]),
            helper.make_tensor_value_info("B", TensorProto.FLOAT, [1, 1, 64, 16]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1, 16, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_16x16_activation_matmul_is_rejected_for_v69_and_allowed_for_v73(tmp_path):
    _qdq_matmul(tmp_path / "bad.onnx", 16)
    model = onnx.load(str(tmp_path / "bad.onnx"))
    encodings = {"bad": prepare_io(model)}
    layout = [Binary("bad.bin", 1, ("bad",))]
    problems = check_rules(get_soc("SM8450"), layout, {"bad": model}, encodings)
    assert len(problems) == 1
    assert "MatMul scores multiplies two 16-bit activations (uint16 x uint16)" in problems[0]
    assert "SM8450 (v69)" in problems[0]
    assert check_rules(get_soc("SM8550"), layout, {"bad": model}, encodings) == []
    _qdq_matmul(tmp_path / "good.onnx", 8)
    good = onnx.load(str(tmp_path / "good.onnx"))
    assert check_rules(get_soc("SM8450"), layout, {"bad": good}, {"bad": prepare_io(good)}) == []


def test_without_the_rules_check_the_v69_compiler_silently_converts(tmp_path):
    """What the real compiler does with the bad graph when nothing stops it: it compiles, inserting a
    Convert on the second operand (a precision change nobody asked for). Hence the rules check."""
    _qdq_matmul(tmp_path / "bad.onnx", 16)
    fig = compile_local(36, 69, "bad.bin", [("bad", str(tmp_path / "bad.onnx"))], str(tmp_path), False)
    data = (tmp_path / "bad.bin").read_bytes()
    assert fig["graphs"][0]["name"] == "bad"
    assert b"B_q_convert" in data and b"soc_type=SM8450;arch=69" in data


def test_a_node_the_htp_cannot_take_fails_the_compile_by_name(tmp_path):
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["X"], ["R"], name="fine"),
            helper.make_node("Det", ["R"], ["Y"], name="no_htp_det"),
        ],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "det.onnx"))
    with pytest.raises(CompileError, match=r"det: .*cannot take these nodes: no_htp_det \(Det\)"):
        compile_local(36, 69, "det.bin", [("det", str(tmp_path / "det.onnx"))], str(tmp_path), False)
    assert not (tmp_path / "det.bin").exists()


def _ple_norm_into_residual(path, rows: int, hidden: int, norm_input_quantized: bool) -> None:
    """The end of a Gemma 4 layer's PLE path: a float projection and RMSNorm whose output is quantized
    into the residual Add (the quantize stage's former float16 PLE policy), or the norm reading a
    quantized input (its policy now)."""
    rng = np.random.default_rng(0)
    s, z = (
        numpy_helper.from_array(np.array(0.001, np.float32), "s"),
        numpy_helper.from_array(np.array(32768, np.uint16), "z"),
    )
    weights = [
        numpy_helper.from_array((rng.standard_normal((256, hidden)) * 0.05).astype(np.float32), "W"),
        numpy_helper.from_array(np.ones(hidden, np.float32), "g"),
    ]
    if norm_input_quantized:  # a quantized norm: its input and its weight (as quantize writes them)
        weights += [
            numpy_helper.from_array(np.full(hidden, 255, np.uint8), "gq"),
            numpy_helper.from_array(np.array(1 / 255, np.float32), "gs"),
            numpy_helper.from_array(np.array(0, np.uint8), "gz"),
        ]
        norm_in = [
            helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"]),
            helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["md"]),
            helper.make_node("DequantizeLinear", ["gq", "gs", "gz"], ["gd"]),
            helper.make_node("RMSNormalization", ["md", "gd"], ["n"], axis=-1, epsilon=1e-6),
        ]
    else:
        norm_in = [helper.make_node("RMSNormalization", ["m", "g"], ["n"], axis=-1, epsilon=1e-6)]
    nodes = [
        helper.make_node("MatMul", ["p", "W"], ["m"]),
        *norm_in,
        helper.make_node("QuantizeLinear", ["n", "s", "z"], ["nq"]),
        helper.make_node("DequantizeLinear", ["nq", "s", "z"], ["nd"]),
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("Add", ["xd", "nd"], ["y"]),
        helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "ple_end",
        [
            helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, rows, 256]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, hidden]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, rows, hidden])],
        [s, z, *weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_v69_fails_an_fp16_norm_into_a_quantized_add_at_ar32_and_says_why(tmp_path):
    """QAIRT 2.51's v69 finalization fails on this pattern at 32 rows x 256 (docs/facts.md §4), which is
    why quantize quantizes the norm's input; the error carries the compiler's own log, not only QNN's
    misleading MEM_ALLOC. Should a QAIRT upgrade fix it, this test says the workaround may go."""
    _ple_norm_into_residual(tmp_path / "bad.onnx", 32, 256, norm_input_quantized=False)
    with pytest.raises(
        CompileError, match=r"MEM_ALLOC.*the compiler's log: could not create op: q::SlicePad"
    ):
        compile_local(36, 69, "bad.bin", [("bad", str(tmp_path / "bad.onnx"))], str(tmp_path), False)
    _ple_norm_into_residual(tmp_path / "good.onnx", 32, 256, norm_input_quantized=True)
    compile_local(36, 69, "good.bin", [("good", str(tmp_path / "good.onnx"))], str(tmp_path), False)
    assert (tmp_path / "good.bin").exists()
    _ple_norm_into_residual(tmp_path / "ar1.onnx", 1, 256, norm_input_quantized=False)
    compile_local(36, 69, "ar1.bin", [("ar1", str(tmp_path / "ar1.onnx"))], str(tmp_path), False)


def _binaries(cfg):
    """The context binaries of the config's job on the tiny model, as export lays them out."""
    from stages.model.geometry import builtin_geometry
    from stages.planning.job import Job

    return list(Job.build(builtin_geometry("tiny"), cfg, specs=False).binaries)


def test_layout_follows_the_soc_table():
    v69 = _binaries(load_config("tiny"))
    assert [b.graphs for b in v69][:2] == [("prefill_ar4_part1_of_2",), ("decode_ar1_part1_of_2",)]
    v75 = _binaries(load_config("tiny", {"soc": "SM8650"}))
    assert [(b.file, b.weight_shared) for b in v75] == [("part1_of_2.bin", True), ("part2_of_2.bin", True)]
    tiny = load_config("tiny")
    one_size = _binaries(dataclasses.replace(tiny, decode_ar=tiny.prefill_ar))
    assert [b.file for b in one_size] == ["prefill_ar4_part1_of_2.bin", "prefill_ar4_part2_of_2.bin"]


def test_binaries_are_byte_identical_across_work_folders(sm8450, tmp_path):
    work, report = sm8450
    again = copy_workdir(work, tmp_path / "elsewhere")
    shutil.rmtree(again / "compiled")
    second = run_compile(load_config("tiny"), again)
    assert [b["sha256"] for b in second["figures"]["binaries"]] == [
        b["sha256"] for b in report["figures"]["binaries"]
    ]
