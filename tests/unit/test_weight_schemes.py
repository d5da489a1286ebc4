"""4-bit decoder weights: the int8 weight DequantizeLinear onnxruntime writes is rewritten to the
precision's scheme (stages/core/precision.py), runs on onnxruntime's CPU EP, and keeps what it should."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from stages.core.config import load_config
from stages.core.precision import INT4_LPBQ64, LPBQ_BLOCK_SCALE_MAX
from stages.quant.runner import session_options
from stages.quantize.weights import (
    _pack_int4,
    apply_weight_scheme,
    int4_channel,
    int4_lpbq,
    lpbq_block,
    weight_role,
)

ROWS, COLS = 256, 16


def _weight() -> np.ndarray:
    """Rows in four blocks of very different magnitude: what block scales are for."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(ROWS, COLS)).astype(np.float32)
    return w * np.repeat(np.array([0.01, 0.1, 1.0, 0.05], np.float32), ROWS // 4)[:, None]


def _int8_qdq_model(w: np.ndarray, weight: str = "layers.0.mlp.down_proj.weight") -> onnx.ModelProto:
    """Y = X @ W with W as onnxruntime's quantizer leaves it: int8, symmetric, per output channel."""
    scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    inits = [
        numpy_helper.from_array(q, f"{weight}_quantized"),
        numpy_helper.from_array(scale, f"{weight}_scale"),
        numpy_helper.from_array(np.zeros(COLS, np.int8), f"{weight}_zero_point"),
    ]
    nodes = [
        helper.make_node(
            "DequantizeLinear",
            [f"{weight}_quantized", f"{weight}_scale", f"{weight}_zero_point"],
            ["w_dq"],
            name="w_DequantizeLinear",
            axis=1,
        ),
        helper.make_node("MatMul", ["X", "w_dq"], ["Y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 8, ROWS])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 8, COLS])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = session_options()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


def _config(precision: str):
    """The tiny config at a precision."""
    return load_config("tiny", {"precision": precision})


def test_int4_packing_is_onnx_s_own_layout():
    q = np.array([[-8, 7, 0], [1, -1, 3]], np.int8)
    t = helper.make_tensor("q", TensorProto.INT4, [2, 3], _pack_int4(q), raw=True)
    assert (numpy_helper.to_array(t).astype(np.int8) == q).all()


def test_lpbq_block_scales_are_4bit_integers_times_a_channel_scale():
    w = _weight()
    q, q_scale, channel = int4_lpbq(w, 64)
    assert q.dtype == np.int8 and q.min() >= -8 and q.max() <= 7
    # The HTP reads a block scale as a 4-bit integer: 1..15, however wide the blocks' magnitudes range
    # (here 100x: the quiet blocks sit at the bottom of the range, the loud one near the top).
    assert q_scale.dtype == np.uint8 and q_scale.shape == (ROWS // 64, COLS)
    assert q_scale.min() >= 1 and q_scale.max() <= LPBQ_BLOCK_SCALE_MAX == 15
    assert channel.dtype == np.float32 and (channel > 0).all()
    assert (q_scale[2] >= 12).all() and (q_scale[0] == 1).all()
    recon = (q.reshape(4, 64, COLS) * (q_scale * channel)[:, None, :]).reshape(ROWS, COLS)
    per_channel_q, per_channel_s = int4_channel(w)
    # Block scales follow the quiet blocks that one scale per column (even a clipped one) crushes to zero.
    assert np.abs(recon - w).mean() < 0.6 * np.abs(per_channel_q * per_channel_s - w).mean()


def test_lpbq_block_scales_are_the_least_error_integers():
    """Each block takes the integer scale with the least squared error: never worse than rounding its
    max-abs scale to the nearest integer (what a plain LPBQ conversion does)."""
    rng = np.random.default_rng(7)
    w = (rng.standard_t(3, size=(8, 16, 24)) * rng.uniform(0.01, 1.0, (8, 1, 24))).reshape(128, 24)
    w = w.astype(np.float32)
    q, q_scale, channel = int4_lpbq(w, 16)
    blocks = w.reshape(8, 16, 24)
    nearest = np.clip(np.rint(np.abs(blocks).max(axis=1) / 7 / channel), 1, LPBQ_BLOCK_SCALE_MAX)

    def err(k):
        s = (k * channel)[:, None, :]
        return np.square(np.clip(np.rint(blocks / s), -8, 7) * s - blocks).sum(axis=1)

    assert (err(q_scale.astype(np.float32)) <= err(nearest) * (1 + 1e-6)).all()
    assert err(q_scale.astype(np.float32)).sum() < 0.95 * err(nearest).sum()
    # The values are what the chosen scales give.
    assert (q.reshape(8, 16, 24) == np.clip(np.rint(blocks / (q_scale * channel)[:, None, :]), -8, 7)).all()


def test_int4_lpbq_is_the_same_on_any_number_of_threads():
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(96, 37)) * rng.uniform(0.01, 2.0, 37)).astype(np.float32)
    w[:, 4] = 0.0  # an all-zero column: channel scale 1, block scales at the top of the range
    one = int4_lpbq(w, 16, workers=1)
    for workers in (2, 3, 37, 64):
        other = int4_lpbq(w, 16, workers=workers)
        assert [a.tobytes() for a in other] == [a.tobytes() for a in one]


def test_lpbq_blocks_and_their_price():
    """64-row blocks, or one per column where a column is shorter; one 4-bit scale per block."""
    assert [lpbq_block(INT4_LPBQ64, rows) for rows in (1536, 128, 64, 32)] == [64, 64, 64, 32]
    assert INT4_LPBQ64.stored_bytes(64 * 1536) == 64 * 1536 // 2 + 1536 // 2


@pytest.mark.parametrize(
    "precision, scheme_type, block", [("w4a16-lpbq", TensorProto.INT4, 64), ("w4a16", TensorProto.INT4, 0)]
)
def test_the_rewritten_graph_runs_and_stays_close_to_float(precision, scheme_type, block):
    w = _weight()
    model = _int8_qdq_model(w)
    x = np.random.default_rng(1).normal(size=(1, 8, ROWS)).astype(np.float32)
    assert apply_weight_scheme(_config(precision), model, {"mm": w}) == 1
    onnx.checker.check_model(model)
    inits = {i.name: i for i in model.graph.initializer}
    dq = next(n for n in model.graph.node if n.output == ["w_dq"])
    assert inits[dq.input[0]].data_type == scheme_type
    assert next((a.i for a in dq.attribute if a.name == "block_size"), 0) == block
    if block:  # the block scales come from a UINT8 DequantizeLinear: the pattern the QNN EP fuses
        scales = next(n for n in model.graph.node if n.output[0] == dq.input[1])
        assert scales.op_type == "DequantizeLinear" and inits[scales.input[0]].data_type == TensorProto.UINT8
        assert [a.i for a in scales.attribute if a.name == "axis"] == [1]
        assert [a.i for a in dq.attribute if a.name == "axis"] == [0]
    if block:
        q, q_scale, channel = int4_lpbq(w, block)
        recon = (q.reshape(-1, block, COLS) * (q_scale * channel)[:, None, :]).reshape(ROWS, COLS)
    else:
        q, scale = int4_channel(w)
        recon = q * scale
    y = _run(model, x)
    # onnxruntime dequantizes exactly what the scheme stored, and 4 bits stay near the float weight.
    np.testing.assert_allclose(y, x @ recon, rtol=1e-4, atol=1e-4)
    assert np.linalg.norm(y - x @ w) / np.linalg.norm(x @ w) < 0.15


def test_lm_head_and_w8a16_keep_int8():
    w = _weight()
    head = _int8_qdq_model(w, "lm_head.weight")
    assert weight_role("lm_head.weight") == "lm_head"
    assert apply_weight_scheme(load_config("tiny", {"precision": "w4a16"}), head, {"mm": w}) == 0
    assert apply_weight_scheme(load_config("tiny"), _int8_qdq_model(w), {"mm": w}) == 0


def test_int4_channel_clips_where_that_lowers_the_error():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    w[0, :8] = 12.0  # one outlier in half the columns
    q, scale = int4_channel(w)
    assert q.dtype == np.int8 and q.min() >= -8 and q.max() <= 7
    naive = np.abs(w).max(axis=0) / 7.0
    naive_q = np.clip(np.rint(w / naive), -8, 7)
    err = np.square(q * scale - w).sum(axis=0)
    naive_err = np.square(naive_q * naive - w).sum(axis=0)
    # Never worse than max-abs per column, and clearly better overall on Gaussian columns.
    assert (err <= naive_err + 1e-6).all()
    assert err.sum() < 0.9 * naive_err.sum()
    # A scale never exceeds max-abs (nothing outside the grid's reach is created).
    assert (scale <= naive * (1 + 1e-6)).all()


def test_int4_channel_is_the_same_on_any_number_of_threads():
    """Columns are searched in blocks on threads; the bytes must not depend on how many."""
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(96, 37)) * rng.uniform(0.01, 2.0, 37)).astype(np.float32)
    w[:, 4] = 0.0  # an all-zero column keeps scale 1/7
    one = int4_channel(w, workers=1)
    for workers in (2, 3, 37, 64):
        q, scale = int4_channel(w, workers=workers)
        assert q.tobytes() == one[0].tobytes() and scale.tobytes() == one[1].tobytes()


@pytest.mark.parametrize("limit, folded", [(None, True), (100, False)])
def test_folding_sessions_fold_weights_over_onnxruntimes_default_limit(tmp_path, monkeypatch, limit, folded):
    """E2B's lm_head dequantizes to 1.6 GB, over onnxruntime's default 1 GiB folding limit; the
    folding session raises the limit (checked here through a small limit: the key must be honoured)."""
    import stages.quant.runner as runner

    if limit is not None:
        monkeypatch.setattr(runner, "FOLD_LIMIT_BYTES", limit)
    w = numpy_helper.from_array(np.ones((16, 16), np.int8), "w")
    s = numpy_helper.from_array(np.array(0.5, np.float32), "s")
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["w", "s"], ["wf"]),
            helper.make_node("MatMul", ["x", "wf"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [w, s],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10),
        tmp_path / "g.onnx",
    )
    options = runner.session_options(fold_weights=True)
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(str(tmp_path / "g.onnx"), options, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(
        session.run(None, {"x": np.ones((1, 16), np.float32)})[0], np.full((1, 16), 8.0)
    )
    ops = {n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node}
    assert ("DequantizeLinear" not in ops) == folded, ops


@pytest.mark.parametrize("ple_policy", ["float16", "int16", "int8"])
@pytest.mark.parametrize("lm_head_bits", [8, 4])
def test_plan_and_quantize_store_every_weight_by_the_same_rule(ple_policy: str, lm_head_bits: int) -> None:
    """The planner prices a geometry tensor by its kind, quantize writes and audits a graph weight by its
    name: both must land on one scheme for every weight the graphs hold, at every precision the SoC runs
    (a second copy of the rule is what drifted before)."""
    from stages.core.precision import usable_precisions
    from stages.model.geometry import EMBEDDING, LINEAR, PLE, builtin_geometry
    from stages.planning.job import KIND_ROLES, weight_scheme
    from stages.quantize.weights import LM_HEAD_WEIGHT, expected_scheme

    base = load_config("tiny", {"ple_policy": ple_policy, "lm_head_bits": lm_head_bits})
    tensors = [t for t in builtin_geometry("tiny").all_tensors() if t.kind in (LINEAR, PLE, EMBEDDING)]
    assert {t.kind for t in tensors} == {LINEAR, PLE, EMBEDDING}
    for precision in usable_precisions(base.soc_info):
        cfg = base.with_overrides(precision=precision.name)
        for t in tensors:
            name = LM_HEAD_WEIGHT if t.kind == EMBEDDING else t.name
            assert weight_role(name) == KIND_ROLES[t.kind], name
            priced, written = weight_scheme(t, cfg), expected_scheme(cfg, name)
            assert written == (priced if priced.quantized else None), (precision.name, name)
