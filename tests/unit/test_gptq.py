"""GPTQ rounding and the mixed precision's choice: output error against round-to-nearest, determinism,
the degenerate cases, and which weights a share keeps at int8."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stages.core.config import ConfigError, load_config
from stages.core.precision import INT8_CHANNEL
from stages.planning.fitting import FULL_HESSIAN_MAX_WIDTH, hessian_shape
from stages.quant.gptq import DAMPENING, Hessian, gptq, output_error
from stages.quantize.weights import RoundedWeight, WeightRounder, expected_scheme, int4_channel


def _layer(rows: int = 96, cols: int = 24, tokens: int = 2048, seed: int = 0):
    """A weight and inputs with correlated features (what GPTQ exploits; iid inputs give it nothing)."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(rows, rows)) / np.sqrt(rows) + np.eye(rows)
    x = (rng.normal(size=(tokens, rows)) @ mix * rng.uniform(0.2, 3.0, rows)).astype(np.float32)
    w = (rng.normal(size=(rows, cols)) * 0.05).astype(np.float32)
    h = Hessian(np.zeros((rows, rows), np.float32))
    h.add(x[: tokens // 2])
    h.add(x[tokens // 2 :])
    return w, x, h


def _relative_output_error(w, q, scale, x) -> float:
    return float(np.sum((x @ (q * scale) - x @ w) ** 2) / np.sum((x @ w) ** 2))


def test_gptq_lowers_the_output_error_of_int4_per_channel_well_below_rounding_to_nearest():
    w, x, h = _layer()
    q_rtn, scale = int4_channel(w)
    q_gptq, scale_gptq = int4_channel(w, hessian=h)
    assert np.array_equal(scale, scale_gptq)  # GPTQ keeps the clipping search's scales
    assert q_gptq.dtype == np.int8 and q_gptq.min() >= -8 and q_gptq.max() <= 7
    rtn, ours = _relative_output_error(w, q_rtn, scale, x), _relative_output_error(w, q_gptq, scale, x)
    assert ours < 0.75 * rtn
    # output_error is that same measure, from the Hessian alone.
    assert output_error(w, q_gptq * scale, h) == pytest.approx(ours, rel=1e-3)
    assert h.rows == x.shape[0]


def test_gptq_is_deterministic_and_follows_block_scales():
    w, _, h = _layer(rows=128, cols=8)
    block_scale = (np.abs(w.reshape(2, 64, 8)).max(axis=1) / 7).astype(np.float32)  # 2 blocks of 64
    a, b = gptq(w, h, block_scale), gptq(w.copy(), h, block_scale.copy())
    assert np.array_equal(a, b)
    deq = a * np.repeat(block_scale, 64, axis=0)
    assert output_error(w, deq, h) < output_error(
        w, np.clip(np.rint(w / np.repeat(block_scale, 64, 0)), -8, 7) * np.repeat(block_scale, 64, 0), h
    )


def test_a_diagonal_hessian_rounds_to_nearest_and_dead_inputs_are_zero():
    w, x, h = _layer(rows=32, cols=4)
    diag = Hessian(np.zeros(32, np.float32))
    diag.add(x)
    assert diag.diagonal_only and np.allclose(diag.diag, h.diag, rtol=1e-4)
    scale = (np.abs(w).max(axis=0) / 7).astype(np.float32)[None]
    assert np.array_equal(gptq(w, diag, scale), np.clip(np.rint(w / scale), -8, 7))
    x[:, 5] = 0.0  # an input that never fires: its row cannot matter, GPTQ zeroes it
    dead = Hessian(np.zeros((32, 32), np.float32))
    dead.add(x)
    assert np.all(gptq(w, dead, scale)[5] == 0)
    assert FULL_HESSIAN_MAX_WIDTH >= 6144  # E2B's non-shared MLP width keeps its full Hessian
    assert hessian_shape(6144) == (6144, 6144) and hessian_shape(12288) == (12288,)


def _rounder(share_percent: str) -> WeightRounder:
    cfg = load_config("tiny", {"precision": "w4a16-mixed", "int8_percent": share_percent})
    rounder = WeightRounder(cfg, None)
    # nsr_int4 - nsr_int8 per parameter: v 4e-5, o 2e-5, q 1e-5, down 1e-6.
    for name, params, nsr4 in (
        ("layers.0.self_attn.v_proj.weight", 100, 0.004),
        ("layers.0.self_attn.o_proj.weight", 100, 0.002),
        ("layers.0.self_attn.q_proj.weight", 200, 0.002),
        ("layers.0.mlp.down_proj.weight", 600, 0.0006),
        ("lm_head.weight", 1000, 0.5),  # not a decoder weight: never counted or chosen
    ):
        rounder.rounded[name] = RoundedWeight(np.zeros(1), np.ones(1), None, params, nsr4, 0.0)
    return rounder


def test_the_mixed_share_keeps_the_most_error_per_byte_at_int8_within_its_parameter_budget():
    rounder = _rounder("40")
    chosen = rounder.choose_int8(rounder.cfg.decoder_scheme.int8_share)
    # 40 % of 1000 decoder parameters: v (100) and o (100) and q (200) fit; down (600) does not.
    assert chosen == {
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.self_attn.q_proj.weight",
    }
    assert rounder.choose_int8(0.15) == {"layers.0.self_attn.v_proj.weight"}
    assert rounder.choose_int8(0.0) == frozenset()
    rounder.int8_weights = chosen
    assert rounder.figures()["int8_share"] == 0.4
    # The audit and the rewrite expect int8 for the chosen ones, int4 for the rest.
    assert expected_scheme(rounder.cfg, "layers.0.self_attn.v_proj.weight", chosen) == INT8_CHANNEL
    assert expected_scheme(rounder.cfg, "layers.0.mlp.down_proj.weight", chosen).bits == 4


def test_measured_costs_outrank_the_local_error_and_kl_is_kl():
    from stages.quant.sensitivity import mean_kl, sensitivity_samples

    rounder = _rounder("20")
    # Measured end to end, the q projection costs the most per parameter (its local error is low).
    for name, kl in (("v_proj", 0.0001), ("o_proj", 0.0001), ("q_proj", 0.004), ("down_proj", 0.003)):
        full = next(n for n in rounder.rounded if name in n)
        rounder.rounded[full].kl_int4 = kl
    assert rounder.choose_int8(0.2) == {"layers.0.self_attn.q_proj.weight"}
    assert rounder.figures()["sensitivity"] == "measured"
    logits = np.array([[2.0, 0.5, -1.0], [0.0, 0.0, 3.0]])
    assert mean_kl(logits, logits) == 0.0 and mean_kl(logits, logits + 5.0) == pytest.approx(0.0)
    p, q = np.exp(logits[0]) / np.exp(logits[0]).sum(), np.array([1 / 3] * 3)
    assert mean_kl(logits[:1], np.zeros((1, 3))) == pytest.approx(float(np.sum(p * np.log(p / q))))
    assert sensitivity_samples([[1] * 100, [2] * 100, [3] * 100], 150) == [[1] * 100, [2] * 50]


def test_the_int8_share_is_priced_and_refused_where_it_means_nothing():
    mixed = load_config(overrides={"precision": "w4a16-mixed", "int8_percent": "50"})
    assert mixed.decoder_scheme.int8_share == 0.5
    numel = 1536 * 6144
    assert mixed.decoder_scheme.stored_bytes(numel) == numel // 2 + numel // 4
    assert load_config().mixed_percent == 75  # auto: the precision's own share
    with pytest.raises(ConfigError, match="int8_percent.*needs a mixed precision"):
        load_config(overrides={"precision": "w8a16", "int8_percent": "50"})
    with pytest.raises(ConfigError, match="int8_percent.*allowed values: auto, 0..100"):
        load_config(overrides={"int8_percent": "150"})
    assert load_config(overrides={"precision": "w8a16"}).decoder_scheme == INT8_CHANNEL  # auto -> 0
    four = load_config(overrides={"lm_head_bits": 4})
    assert four.lm_head_scheme.bits == 4
    with pytest.raises(ConfigError, match="lm_head_bits"):
        load_config(overrides={"lm_head_bits": 4, "soc": "SM8350", "precision": "w8a16"})
    assert dataclasses.replace(mixed, int8_percent="auto").mixed_percent == 75


def test_the_scale_search_lowers_every_columns_output_error_and_is_one_gptq_rounding():
    from stages.quant.gptq import column_errors

    w, x, h = _layer(rows=128, cols=32, seed=1)
    q_plain, s_plain = int4_channel(w, hessian=h)
    q, scale = int4_channel(w, hessian=h, search=True)
    again = int4_channel(w.copy(), hessian=h, search=True)
    assert np.array_equal(q, again[0]) and np.array_equal(scale, again[1])  # deterministic
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == s_plain.shape
    # The search's measure: the output error under the Hessian GPTQ minimizes (dampened).
    damped = Hessian(h.matrix + np.float32(DAMPENING * np.mean(h.diag)) * np.eye(128, dtype=np.float32), 1)
    plain_err, err = column_errors(w, q_plain * s_plain, damped), column_errors(w, q * scale, damped)
    assert np.all(err <= plain_err * (1 + 1e-5))  # the weight-error ratio is a candidate: no column worse
    assert err.sum() < 0.9 * plain_err.sum()
    assert not np.array_equal(scale, s_plain)
    # GPTQ rounds columns independently: the columns' choices are GPTQ under the chosen scales.
    assert np.array_equal(q, gptq(w, h, scale[None, :]))
    # What the search minimizes is the output error on the inputs themselves.
    assert _relative_output_error(w, q, scale, x) < _relative_output_error(w, q_plain, s_plain, x)


def test_hessians_kept_on_disk_stay_shared_and_equal(tmp_path):
    from stages.quantize.weights import _on_disk

    _, x, h = _layer(rows=16, cols=2)
    diag = Hessian(np.zeros(16, np.float32))
    diag.add(x)
    kept = _on_disk({"q": h, "k": h, "down": diag}, tmp_path)
    assert kept["q"] is kept["k"] and len(list(tmp_path.iterdir())) == 2
    assert np.array_equal(kept["q"].matrix, h.matrix) and kept["q"].rows == h.rows
    assert kept["down"].diagonal_only and np.array_equal(kept["down"].matrix, diag.matrix)


def test_weight_rounding_names_the_scale_search_and_the_presets_use_it():
    assert load_config().weight_rounding == "gptq-search"
    assert load_config("tiny").weight_rounding == "gptq-search"
    with pytest.raises(ConfigError, match="weight_rounding.*gptq-search, gptq, nearest"):
        load_config(overrides={"weight_rounding": "search"})
