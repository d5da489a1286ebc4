"""The calibration twin: AR-1 graphs (the default E2B layout) calibrated through a twin exported at a
larger AR. The twin must compute what the shipped graphs compute, its ranges must land on the shipped
graphs' tensors, and the quantized graphs must match those calibrated call by call on the AR-1 graphs
up to float rounding, in 1/AR as many calls."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from stages.core.config import load_config
from stages.download import run_download
from stages.export import run_export
from stages.quant.runner import HostRunner
from stages.quantize.analysis import QuantizeError
from stages.quantize.calibrate import twin_tensor_names
from stages.quantize.stage import run_quantize

pytestmark = pytest.mark.slow

# The tiny model at AR-1 only (the E2B default's shape), with an AR-8 twin.
AR1 = {"prefill_ar": "1", "decode_ar": "1", "calibration_ar": "8"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("twin")
    run_download("tiny", "main", work / "checkpoints" / "tiny")
    run_export(load_config("tiny", AR1), work, work / "checkpoints" / "tiny")
    return work


@pytest.fixture(scope="module")
def exported_plain(exported, tmp_path_factory) -> Path:
    """The same layout without twins (a quantize refuses a config its export was not made for)."""
    work = tmp_path_factory.mktemp("plain")
    shutil.copytree(exported / "checkpoints", work / "checkpoints", symlinks=True)
    run_export(load_config("tiny", {**AR1, "calibration_ar": "0"}), work, work / "checkpoints" / "tiny")
    return work


def _quantize(exported: Path, tmp: Path, **overrides) -> tuple[Path, dict]:
    work = tmp / "work"
    shutil.copytree(exported, work, symlinks=True)
    report = run_quantize(load_config("tiny", {**AR1, **overrides}), work, work / "checkpoints" / "tiny")
    return work, report


def test_the_twins_leave_the_shipped_graphs_as_they_were(exported, exported_plain):
    for part in (1, 2):
        name = f"prefill_ar1_part{part}_of_2.onnx"
        assert (exported / "exported" / name).read_bytes() == (
            exported_plain / "exported" / name
        ).read_bytes()
    assert not list((exported_plain / "exported").glob("calibration_*"))


def _activation_ranges(path: Path) -> dict[str, tuple[float, float]]:
    """Per quantized activation (the input of each QuantizeLinear): the range its uint16 encoding covers."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits:
            scale, zero = float(inits[n.input[1]]), int(inits[n.input[2]])
            out[n.input[0]] = (-zero * scale, (65535 - zero) * scale)
    return out


def _score_path(path: Path) -> set[str]:
    """Attention scores before the softmax: from each Q.K^T MatMul (two activation inputs) through the
    ops up to the Softmax. An AR-N call also scores each token against the later tokens of its chunk
    (masked afterwards), values an AR-1 call never computes."""
    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {t.name for t in graph.initializer}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    found: set[str] = set()
    for n in graph.node:
        if n.op_type != "MatMul" or any(i in inits for i in n.input):
            continue
        chain, node = [], n
        while node is not None and node.op_type != "Softmax" and len(chain) < 6:
            chain.append(node.output[0])
            nxt = consumers.get(node.output[0], [])
            node = nxt[0] if len(nxt) == 1 else None
        if node is not None and node.op_type == "Softmax":
            found |= set(chain)
    return found


def test_the_export_writes_twins_that_only_calibration_sees(exported):
    report = json.loads((exported / "exported" / "report.json").read_text())
    names = sorted(g["name"] for g in report["figures"]["graphs"])
    assert names == [
        "calibration_ar8_part1_of_2",
        "calibration_ar8_part2_of_2",
        "prefill_ar1_part1_of_2",
        "prefill_ar1_part2_of_2",
    ]
    shipped = HostRunner.from_export(exported / "exported")
    twin = HostRunner.from_export(exported / "exported", calibration_twin=True)
    assert list(shipped.graphs) == ["prefill"] and shipped.prefill_ar == 1
    assert list(twin.graphs) == ["prefill"] and twin.prefill_ar == 8
    # The same chain: 16 tokens as 16 AR-1 calls and as 2 AR-8 calls give the same logits.
    ids = list(range(2, 18))
    np.testing.assert_allclose(twin.prefill(ids), shipped.prefill(ids), rtol=1e-4, atol=1e-4)


def test_twin_tensors_map_node_for_node_and_a_foreign_graph_is_refused(exported):
    d = exported / "exported"
    names = twin_tensor_names(d / "calibration_ar8_part1_of_2.onnx", d / "prefill_ar1_part1_of_2.onnx")
    graph = onnx.load(str(d / "prefill_ar1_part1_of_2.onnx"), load_external_data=False).graph
    assert sorted(names.values()) == sorted(
        {*(t.name for t in graph.input), *(o for n in graph.node for o in n.output)}
    )
    with pytest.raises(QuantizeError, match="not node for node"):
        twin_tensor_names(d / "calibration_ar8_part1_of_2.onnx", d / "prefill_ar1_part2_of_2.onnx")


def test_twin_calibration_matches_call_by_call_calibration(exported, exported_plain, tmp_path):
    on_twin, twin_report = _quantize(exported, tmp_path / "twin")
    # The same AR-1 graphs, calibrated on themselves.
    direct, direct_report = _quantize(exported_plain, tmp_path / "direct", calibration_ar="0")
    cal = twin_report["figures"]["calibration"]
    assert cal["on_twin"] and cal["tokens_per_call"] == 8
    assert not direct_report["figures"]["calibration"]["on_twin"]
    for t, d in zip(twin_report["figures"]["graphs"], direct_report["figures"]["graphs"], strict=True):
        assert t["calibrated_on"] == t["name"].replace("prefill_ar1", "calibration_ar8")
        assert t["calibration_calls"] * 8 == d["calibration_calls"]
        assert t["audit"]["problems"] == []
        got = _activation_ranges(on_twin / "quantized" / t["qdq_onnx"])
        want = _activation_ranges(direct / "quantized" / d["qdq_onnx"])
        scores = _score_path(direct / "exported" / f"{d['name']}.onnx")
        assert got.keys() == want.keys() and scores
        step = 1e-4  # relative: a few uint16 steps of rounding
        for name, (lo, hi) in want.items():
            g_lo, g_hi = got[name]
            width = hi - lo
            # Never narrower: nothing the shipped graph computes is clipped by a twin range.
            assert g_lo <= lo + step * width and g_hi >= hi - step * width, name
            if name in scores:  # wider by the in-chunk future scores, and not by much
                assert g_hi - g_lo <= 1.25 * width, name
            else:  # the same values: the same range up to rounding
                assert g_hi - g_lo == pytest.approx(width, rel=step), name
    tq, dq = (r["figures"]["quality"]["float16"] for r in (twin_report, direct_report))
    assert tq["tokens"] == dq["tokens"]
    assert tq["top1_agreement"] == pytest.approx(dq["top1_agreement"], abs=0.01)
    assert tq["kl_divergence"] == pytest.approx(dq["kl_divergence"], rel=0.05, abs=1e-3)
    assert tq["perplexity_fp"] == pytest.approx(dq["perplexity_fp"], rel=1e-3)
