"""The real-weight quality table's machinery (stages/tools/real_quality.py) on a tiny random Gemma 3 built
by transformers: the Hessian hooks, the (in, out) layout, the KV encodings and that the scoring ranks
int8 far above int4. The 270M run itself belongs to the bench tier."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")

from stages.quant.gptq import Hessian  # noqa: E402
from stages.tools import real_quality as rq  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer Gemma 3 text decoder, hidden 64, random weights (a fixed seed)."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=8,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        attn_implementation="sdpa",
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    # Larger weights than the init's std 0.02, so the random model's next-token distributions are not
    # flat and rounding errors show in the KL.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
    return model


def _windows(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[2, *rng.integers(3, VOCAB, length - 1).tolist()] for _ in range(count)]


def test_layout_is_the_stage_matmul(tiny):
    linears = rq.decoder_linears(tiny)
    assert len(linears) == 2 * len(rq.DECODER_LINEARS)
    q = linears["model.layers.0.self_attn.q_proj.weight"]
    w = rq.matmul_weight(q)
    assert w.shape == (64, 2 * 32)  # (in, out): hidden 64 in, 2 heads x 32 out
    x = torch.randn(3, 64)
    with torch.inference_mode():
        np.testing.assert_allclose(x.numpy() @ w, q(x).numpy(), rtol=1e-5, atol=1e-5)
    # Within half an int8 step of the float weight, per output column (the MatMul's axis 1).
    step = np.abs(w).max(axis=0) / 127.0
    assert (np.abs(rq.int8_weight(w) - w) <= step / 2 + 1e-7).all()
    before = q.weight.detach().clone()
    rq.set_matmul_weight(q, w * 2)
    assert torch.equal(q.weight, before * 2)
    rq.set_matmul_weight(q, w)


def test_hessians_from_hooks(tiny):
    samples = _windows(2, 24, seed=1)
    seen: dict[str, list[np.ndarray]] = {}
    handles = [
        m.register_forward_pre_hook(
            lambda _m, a, n=n: seen.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]).numpy().copy())
        )
        for n, m in rq.decoder_linears(tiny).items()
    ]
    try:
        got, seconds = rq.collect_hessians(tiny, samples, (1, 2))
    finally:
        for h in handles:
            h.remove()
    assert set(got) == {1, 2} and seconds[2] >= seconds[1]
    hess = got[2]
    layer = "model.layers.1"
    # q, k and v read one tensor: one Hessian, as HessianCollector shares them; o has its own.
    q, k, v, o = (hess[f"{layer}.self_attn.{p}_proj.weight"] for p in ("q", "k", "v", "o"))
    assert q is k is v and o is not q
    assert hess[f"{layer}.mlp.gate_proj.weight"] is hess[f"{layer}.mlp.up_proj.weight"]
    for name in (f"{layer}.self_attn.q_proj.weight", f"{layer}.mlp.down_proj.weight"):
        x = np.concatenate(seen[name]).astype(np.float64)
        assert hess[name].rows == 48 and got[1][name].rows == 24
        np.testing.assert_allclose(hess[name].matrix, x.T @ x, rtol=1e-4, atol=1e-3)
    assert hess[rq.LM_HEAD_WEIGHT].matrix.shape == (64, 64)


def test_kv_encoding_matches_onnxruntime_rule():
    enc = rq.kv_encoding(-3.0, 5.0, 8)
    assert enc.datatype == "ufixed_point_8" or enc.bits == 8
    assert enc.scale == pytest.approx(8.0 / 255)
    # zero point round(3 / scale) = 96: the offset is its negation.
    assert enc.offset == -96
    x = np.linspace(-3, 5, 101, dtype=np.float32)
    assert np.abs(enc.dequantize(enc.quantize(x)) - x).max() <= enc.scale / 2 + 1e-6
    only_positive = rq.kv_encoding(1.0, 2.0, 16)  # the range is widened to hold 0
    assert only_positive.offset == 0 and only_positive.scale == pytest.approx(2.0 / 65535)


def test_kv_hook_sees_every_layer(tiny):
    ranges = rq.kv_ranges(tiny, _windows(1, 16, seed=2))
    assert sorted(ranges) == [0, 1]
    assert all(r["k"][0] <= 0 <= r["k"][1] for r in ranges.values())


def test_int8_far_better_than_int4_nearest(tiny, tmp_path):
    lab = rq.Lab(tiny, _windows(2, 65, seed=3), _windows(2, 32, seed=4), tmp_path, log=lambda _m: None)
    lab.layout_checks()
    rows = {r.name: r for r in rq.all_rows()}
    float_row = lab.evaluate(rows["float"])
    assert float_row["tokens_scored"] == 128 and float_row["reference_storage_kl"] < 1e-3
    w8 = lab.evaluate(rows["w8a16"])
    w4 = lab.evaluate(rows["w4a16 nearest"])
    assert 0 < w8["kl"] < w4["kl"] / 10
    assert w8["top1"] >= w4["top1"]
    # The decoder's weights are float again after each row.
    for name, linear in lab.linears.items():
        np.testing.assert_array_equal(rq.matmul_weight(linear), lab.float_weights[name])


def test_mixed_keeps_its_share_and_searches_the_rest(tiny, tmp_path):
    lab = rq.Lab(tiny, _windows(1, 33, seed=5), _windows(2, 32, seed=6), tmp_path, log=lambda _m: None)
    lab.collect_hessians((lab.cfg.hessian_samples,))
    rows = {r.name: r for r in rq.all_rows()}
    row = rows["w4a16-mixed 50% gptq-search"]
    weights, info = lab.decoder_weights(row)
    assert 0 < info["int8_share"] <= 0.5 and info["sensitivity_s"] is not None
    rounding = lab.rounding(row)
    assert all(r.kl_int4 is not None for r in rounding.rounder.rounded.values())
    assert rounding.searched  # the weights left at 4 bits were searched, the first pass kept
    for name, (searched, _s) in rounding.searched.items():
        assert rounding.rounder.rounded[name] is not searched
    assert isinstance(next(iter(lab.hessians[lab.cfg.hessian_samples].values())), Hessian)
    assert set(weights) == set(lab.float_weights)


def test_calibration_row_reuses_the_default_choice(tiny, tmp_path):
    lab = rq.Lab(tiny, _windows(1, 33, seed=7), _windows(3, 32, seed=8), tmp_path, log=lambda _m: None)
    lab.collect_hessians((2, lab.cfg.hessian_samples))  # 8 asked, 3 there: all of them
    rows = {r.name: r for r in rq.all_rows()}
    assert lab.hessians[lab.cfg.hessian_samples][rq.LM_HEAD_WEIGHT].rows == 96
    lab.evaluate(rows["float"])
    default = lab.evaluate(rows["w4a16-mixed 75% gptq-search (default)"])
    quarter = lab.evaluate(rows["default, Hessians x1/4"])
    assert default["sensitivity"] == "measured" and quarter["sensitivity"].startswith("measured on the")
    assert quarter["int8_share"] == default["int8_share"]
    assert lab.estimate_s(rows["w4a16 gptq"], 10.0) < lab.estimate_s(rows["w4a16-lpbq gptq"], 10.0)
    record = {
        "date": "2026-12-07",
        "complete": False,
        "model": {"gguf": "tiny.gguf", "sha256": "0" * 64},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "text": {
            "heldout": "h",
            "heldout_text_tokens": 64,
            "heldout_windows": 1,
            "window": "33 tokens",
            "tokens_scored": 32,
            "calibration": "c",
            "calibration_text_tokens": 93,
            "calibration_windows_available": 3,
            "calibration_window": "32",
            "hessian_samples": {"2": 2, "8": 3},
            "kv_range_samples": 3,
            "sensitivity_tokens": 128,
        },
        "checks": lab.layout_checks(),
        "rows": [default, quarter],
        "same_as": {},
        "dropped": [{"row": "x", "why": "over the budget"}],
        "wall_s": 1.0,
        "max_rss_bytes": 1 << 30,
    }
    md = rq.to_markdown(record, "cmd")
    assert "| default, Hessians x1/4 |" in md and "Run in progress" in md and "- x: over the budget." in md
