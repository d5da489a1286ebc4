"""w4a16 end to end on the trained tiny model: 4-bit decoder weights in the QDQ graphs (audited), the
precisions ranked by measured quality as the precision table says, and v69 binaries from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.compile import run_compile
from stages.config import load_config
from stages.download import run_download
from stages.export import run_export
from stages.precision import PRECISIONS
from stages.quantize import run_quantize
from stages.runtimes.genie.bundle import run_bundle
from stages.runtimes.genie.verify import run_verify, transformers_floor

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("w4a16")
    cfg = load_config("tiny", {"precision": "w4a16"})
    ckpt = work / "checkpoints" / "tiny"
    run_download("tiny", "main", ckpt)
    run_export(cfg, work, ckpt)
    return work, run_quantize(cfg, work, ckpt, compare_precisions=True)


def test_decoder_weights_are_int4_per_channel_and_the_lm_head_int8(w4a16):
    _, report = w4a16
    for graph in report["figures"]["graphs"]:
        audit = graph["audit"]
        assert audit["problems"] == []
        decoder = [w for w in audit["weights"] if w["role"] == "decoder"]
        assert decoder and all(w["type"] == "int4" and w["scheme"] == "int4-channel" for w in decoder)
        assert all(w["block_size"] == 0 for w in decoder)
        heads = [w for w in audit["weights"] if w["role"] == "lm_head"]
        assert all(w["type"] == "int8" and w["block_size"] == 0 for w in heads)
    assert (
        sum(w["role"] == "lm_head" for g in report["figures"]["graphs"] for w in g["audit"]["weights"]) == 2
    )


def test_the_precision_table_ranks_as_measured(w4a16):
    _, report = w4a16
    quality = report["figures"]["quality_by_precision"]
    assert set(quality) == {"w8a16", "w4a16"}
    assert all(not q.get("audit_problems") for q in quality.values())
    by_kl = sorted(quality, key=lambda name: quality[name]["kl_divergence"])
    assert by_kl == sorted(quality, key=lambda name: PRECISIONS[name].quality_rank)
    # 4 bits cost quality on this 64-wide model; the report says how much.
    assert quality["w8a16"]["top1_agreement"] > quality["w4a16"]["top1_agreement"] > 0.75


def test_4bit_graphs_compile_for_v69_in_one_partition(w4a16):
    work, _ = w4a16
    report = run_compile(load_config("tiny", {"precision": "w4a16"}), work)
    for b in report["figures"]["binaries"]:
        assert b["soc_type"] == "SM8450" and b["arch"] == 69
        assert b["estimated_allocation_bytes"] > b["weight_bytes"]


def _emulated_vs_cpu(precision: str, tmp_path: Path) -> float:
    """Mean |difference| in output LSB between onnxruntime's CPU QDQ reference and QNN's x86 HTP
    emulation (soc 36 / v69) of one uint16 MatMul whose weight takes the precision's scheme."""
    import dataclasses

    import numpy as np
    import onnx
    import onnxruntime as ort
    import onnxruntime_qnn
    from onnx import TensorProto, helper, numpy_helper

    from stages.quantize import apply_weight_scheme

    rows, cols = 256, 16
    rng = np.random.default_rng(0)
    w = rng.normal(size=(rows, cols)).astype(np.float32) * np.repeat([0.01, 0.1, 1.0, 0.05], 64)[:, None]
    w = w.astype(np.float32)
    scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    name = "layers.0.mlp.down_proj.weight"
    inits = [
        numpy_helper.from_array(np.clip(np.rint(w / scale), -127, 127).astype(np.int8), f"{name}_quantized"),
        numpy_helper.from_array(scale, f"{name}_scale"),
        numpy_helper.from_array(np.zeros(cols, np.int8), f"{name}_zero_point"),
        numpy_helper.from_array(np.float32(4 / 65535), "sx"),
        numpy_helper.from_array(np.uint16(32768), "zx"),
        numpy_helper.from_array(np.float32(4 * np.abs(w).sum(axis=0).max() / 65535), "sy"),
        numpy_helper.from_array(np.uint16(32768), "zy"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["Xq", "sx", "zx"], ["X"], name="xdq"),
        helper.make_node(
            "DequantizeLinear", [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"], ["W"], axis=1
        ),
        helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm"),
        helper.make_node("QuantizeLinear", ["Y", "sy", "zy"], ["Yq"], name="yq"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("Xq", TensorProto.UINT16, [1, 8, rows])],
        [helper.make_tensor_value_info("Yq", TensorProto.UINT16, [1, 8, cols])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    cfg = dataclasses.replace(load_config("tiny"), precision=precision)  # refused ones too
    apply_weight_scheme(cfg, model, {"mm": w})
    path = tmp_path / f"{precision}.onnx"
    onnx.save(model, str(path))
    x = rng.integers(0, 65535, size=(1, 8, rows)).astype(np.uint16)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"Xq": x})[0]
    ep = onnxruntime_qnn.get_ep_name()
    if ep not in {d.ep_name for d in ort.get_ep_devices()}:
        ort.register_execution_provider_library(ep, onnxruntime_qnn.get_library_path())
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    options = {"backend_path": onnxruntime_qnn.get_qnn_htp_path(), "soc_model": "36", "htp_arch": "69"}
    so.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == ep], options)
    got = ort.InferenceSession(str(path), so).run(None, {"Xq": x})[0]
    return float(np.abs(ref.astype(np.int64) - got.astype(np.int64)).mean())


def test_v69_emulation_agrees_with_int4_per_channel_and_not_with_lpbq(tmp_path):
    """Why w4a16 is int4 per channel and w4a16-lpbq is refused: in QNN's HTP emulation the per-channel
    int4 MatMul is as close to its QDQ graph as int8 is; the LPBQ one is not (onnxruntime-qnn 2.7.0)."""
    int8 = _emulated_vs_cpu("w8a16", tmp_path)
    int4 = _emulated_vs_cpu("w4a16", tmp_path)
    lpbq = _emulated_vs_cpu("w4a16-lpbq", tmp_path)
    assert int8 < 20 and int4 < 20
    assert lpbq > 100  # when this fails, LPBQ agrees: lift the refusal in stages/precision.py


def test_the_w4a16_bundle_verifies_on_the_htp_emulation(w4a16):
    """`make demo PRECISION=w4a16`'s verify: the binaries agree with the graphs they were compiled from
    at the fixed threshold, and with transformers above the preset's 4-bit floor less the margin (and
    as well as 4-bit quantization measured)."""
    work, quantized = w4a16
    cfg = load_config("tiny", {"precision": "w4a16"})
    if not (work / "compiled" / "report.json").is_file():
        run_compile(cfg, work)
    run_bundle(cfg, work, work / "checkpoints" / "tiny")
    prompt = "Return the first element of a list."
    fig = run_verify(cfg, work, work / "checkpoints" / "tiny", prompt)["figures"]
    measured = quantized["figures"]["quality"]["float16"]["top1_agreement"]
    # The floor is the preset's, whatever quantize measured: min_top1_agreement_w4 0.75 less 0.05.
    assert fig["thresholds"]["min_top1_agreement_with_transformers"] == 0.7 == transformers_floor(cfg)
    assert fig["thresholds"]["with_transformers_from"] == "min_top1_agreement_w4 0.75 less 0.05"
    assert fig["thresholds"]["min_top1_agreement_with_own_graphs"] == 0.9
    assert fig["bundle_vs_host_runner_logits"]["top1_agreement"] >= 0.9
    assert fig["heldout"]["top1_agreement"] >= measured - 0.05
    assert fig["matching_prefix_tokens"] >= 8
