"""stages/quant/grid.py: reading the integer grid a quantization-aware-trained weight sits on, from its bf16
values alone."""

import numpy as np
import pytest
import torch

from stages.quant.grid import find_grid


def as_bf16(x: np.ndarray) -> np.ndarray:
    """What a checkpoint stores: the value rounded to bfloat16, read back as float32."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def on_grid(
    out: int, inp: int, group: int, bits: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    half = 1 << (bits - 1)
    q = rng.integers(-half, half, size=(out, inp))
    q[:, 0] = -half  # each group uses its extreme somewhere, as trained grids do
    scale = rng.uniform(0.002, 0.05, size=(out, inp // group)).astype(np.float32)
    w = (q.reshape(out, -1, group) * scale[:, :, None]).reshape(out, inp)
    return as_bf16(w), q, scale


@pytest.mark.parametrize("group, bits", [(32, 4), (64, 4), (128, 2), (None, 4), (None, 2)])
def test_the_grid_is_found_from_the_data_integers_exactly(group, bits):
    inp = 256
    w, q, scale = on_grid(48, inp, group or inp, bits)
    if group:  # the first value of every group at the extreme, so no group hides a coarser level
        q.reshape(48, -1, group)[:, :, 0] = -(1 << (bits - 1))
        w = as_bf16((q.reshape(48, -1, group) * scale[:, :, None]).reshape(48, inp))
    grid = find_grid(w)
    assert grid is not None
    assert (grid.bits, grid.group) == (bits, group or inp)
    assert np.array_equal(grid.q, q)  # every integer, despite bf16 rounding
    assert np.allclose(grid.scale, scale, rtol=2**-8)
    assert grid.max_error < 0.05 and grid.rel_rms_error < 2**-8


def test_a_group_grid_is_not_taken_for_a_coarser_one():
    w, _, _ = on_grid(16, 128, 32, 4)
    assert find_grid(w).group == 32  # per-channel and 64-wide groups would need other scales


@pytest.mark.parametrize("kind", ["normal", "bf16 normal", "int8 grid"])
def test_weights_on_no_low_bit_grid_are_refused(kind):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(1536, 2048)).astype(np.float32) * 0.02
    if kind == "bf16 normal":
        w = as_bf16(w)
    if kind == "int8 grid":  # 8-bit exact, which is not looked for
        s = np.abs(w).max(axis=1, keepdims=True) / 127
        w = np.rint(w / s) * s
    assert find_grid(w) is None


def test_zero_rows_and_a_single_level_are_on_the_grid():
    w, q, _ = on_grid(8, 64, 64, 4)
    w[3] = 0.0
    grid = find_grid(w)
    assert (
        grid is not None
        and (grid.q[3] == 0).all()
        and np.array_equal(np.delete(grid.q, 3, 0), np.delete(q, 3, 0))
    )


# ---- quantize keeps a checkpoint's grid (stages/quantize/weights.py) ----
NAME = "layers.0.mlp.down_proj.weight"


def _rounder(precision: str):
    from stages.core.config import load_config
    from stages.quantize.weights import WeightRounder

    return WeightRounder(load_config("tiny", {"precision": precision}), None)


def test_a_channel_grid_is_kept_bit_exact_in_int4_per_channel():
    w, q, scale = on_grid(64, 128, 128, 4)  # (out, in) as a checkpoint holds it
    rounder = _rounder("w4a16")
    done = rounder.round_weight(NAME, np.ascontiguousarray(w.T))  # quantize's weights are (in, out)
    assert np.array_equal(done.q, q.T) and done.block_scales is None
    assert np.allclose(done.scale, scale[:, 0], rtol=2**-8)
    assert rounder.kept == {NAME} and rounder.grids[NAME]["found"].startswith("int4 per output channel")


def test_a_group_grid_needs_block_scales_and_says_so_under_int4_per_channel():
    w, _, _ = on_grid(64, 128, 32, 4)
    rounder = _rounder("w4a16")
    rounder.round_weight(NAME, np.ascontiguousarray(w.T))
    assert rounder.kept == frozenset()
    assert "w4a16-lpbq" in rounder.grids[NAME]["why_not"]


def test_a_group_grid_becomes_lpbq_at_its_group_size_keeping_every_integer():
    w, q, scale = on_grid(64, 128, 32, 4)
    rounder = _rounder("w4a16-lpbq")
    done = rounder.round_weight(NAME, np.ascontiguousarray(w.T))
    assert np.array_equal(done.q, q.T)
    assert done.block_scales.shape == (128 // 32, 64)  # blocks of the checkpoint's 32, not the scheme's 64
    residual = rounder.grids[NAME]["scale_residual"]
    # 16 levels of block scale under one channel scale: the group scales' relative spread (25x here)
    # costs a few percent; the weight error is that, not a re-rounding of every weight
    assert 0 < residual < 0.06
    err = np.linalg.norm(done.dequantized().T - w) / np.linalg.norm(w)
    assert err == pytest.approx(residual, rel=0.05)


def test_mixed_precision_never_moves_a_kept_grid_to_int8():
    rounder = _rounder("w4a16-mixed")
    on, _, _ = on_grid(64, 128, 128, 4)
    off = np.random.default_rng(3).normal(size=(64, 128)).astype(np.float32)
    rounder.round_weight(NAME, np.ascontiguousarray(on.T))
    rounder.round_weight("layers.1.mlp.down_proj.weight", np.ascontiguousarray(off.T))
    assert rounder.choose_int8(1.0) == {"layers.1.mlp.down_proj.weight"}


def test_q4_0s_negative_scales_are_read_and_kept_with_their_plus_8s_clipped():
    """Q4_0 (llama.cpp, Google's QAT q4_0) sets d = largest-magnitude value / -8: where that value is
    positive the scale is negative and the group's integers, under a positive step, reach +8."""
    from stages.model.tiny_model import q4_0

    rng = np.random.default_rng(5)
    w = as_bf16(q4_0(torch.from_numpy(rng.normal(size=(32, 64)).astype(np.float32)), None).numpy())
    grid = find_grid(w)
    assert grid is not None and grid.per_channel and grid.bits == 4
    negative = grid.scale[:, 0] < 0
    assert 0 < negative.sum() < 32  # both signs occur
    assert np.allclose(grid.dequantized(), w, rtol=2**-7, atol=0)
    rounder = _rounder("w4a16")
    rounder.round_weight(NAME, np.ascontiguousarray(w.T))
    # the values at +8 steps (the largest of each such channel, and any other that rounds there)
    plus_8 = int((grid.q[negative] == -8).sum())
    assert rounder.grids[NAME]["clipped"] == plus_8 and negative.sum() <= plus_8 < 2 * negative.sum()


def test_the_bench_q4_0_weights_are_on_a_grid_find_grid_reads_back():
    """bench-quality's E2B QAT rows time weights made by `q4_0_snapped`: they must be what a QAT
    checkpoint holds (Q4_0's groups of 32, its negative scales, bf16), or the row times nothing."""
    pytest.importorskip("torch")
    from stages.tools.bench import q4_0_snapped

    w = (np.random.default_rng(3).normal(size=(256, 48)) * 0.02).astype(np.float32)
    grid = find_grid(q4_0_snapped(w).T)
    assert grid is not None and (grid.bits, grid.group) == (4, 32)
    assert (grid.scale < 0).any() and (grid.scale > 0).any()
    assert grid.rel_rms_error < 0.01


def test_a_kept_q4_0_grid_moves_only_the_channels_whose_plus_8_was_clipped_and_the_audit_says_so():
    """With a Hessian, the clipped +8s' error is carried by GPTQ, in their own output channels only:
    every other channel keeps the checkpoint's integers exactly (a row of inputs the calibration never
    saw included, which GPTQ would zero). The audit holds the stored integers to the checkpoint's own,
    not to what the rounder wrote."""
    from onnx import numpy_helper

    from stages.model.tiny_model import q4_0
    from stages.quant.gptq import Hessian
    from stages.quantize.audit import _checkpoint_integers
    from stages.quantize.weights import WeightRounder

    rng = np.random.default_rng(5)
    w = as_bf16(q4_0(torch.from_numpy(rng.normal(size=(32, 64)).astype(np.float32)), None).numpy())
    x = rng.normal(size=(256, 64)).astype(np.float32)
    x[:, 3] = 0  # an input the calibration never saw
    rounder = _rounder("w4a16")
    rounder = WeightRounder(rounder.cfg, {NAME: Hessian(x.T @ x, len(x))})
    done = rounder.round_weight(NAME, np.ascontiguousarray(w.T))
    clipped = (done.checkpoint_q > 7).any(axis=0)
    assert 0 < clipped.sum() < 32
    assert np.array_equal(done.q[:, ~clipped], done.checkpoint_q[:, ~clipped])
    assert rounder.grids[NAME]["integers_moved"] == int((done.q != np.clip(done.checkpoint_q, -8, 7)).sum())
    stored = numpy_helper.from_array(done.q.astype(np.int8))
    figures, bad = _checkpoint_integers(stored, done.checkpoint_q)
    assert bad == [] and figures["clipped_channels"] == int(clipped.sum())
    assert figures["equal"] + figures["moved_in_clipped_channels"] == done.q.size
    broken = done.q.copy()
    broken[0, np.flatnonzero(~clipped)[0]] += 1
    _, bad = _checkpoint_integers(numpy_helper.from_array(broken.astype(np.int8)), done.checkpoint_q)
    assert bad == ["1 integers differ from its checkpoint's in channels with nothing clipped"]
