"""The quantize stage's pass clock: what `figures.passes` records."""

import pytest

from stages.quantize.passes import PassClock, tokens_of


def test_a_pass_is_timed_with_what_it_read_even_when_it_fails():
    clock = PassClock()
    with clock.run("hessians", tokens=tokens_of([[1] * 10, [2] * 6]), unit="call") as timed:
        timed.units = 4
    with pytest.raises(RuntimeError), clock.run("rounding", unit="weight"):
        raise RuntimeError("boom")
    figures = clock.figures()
    assert [f["name"] for f in figures] == ["hessians", "rounding"]
    assert figures[0]["tokens"] == 16 and figures[0]["units"] == 4 and figures[0]["unit"] == "call"
    assert "tokens" not in figures[1] and "units" not in figures[1]  # nothing read, nothing counted
    assert all(f["wall_s"] >= 0 for f in figures)
    assert clock.seconds("hessians") == figures[0]["wall_s"]


def test_the_e2b_cost_of_a_recipe_is_the_measured_time_per_call_times_its_calls():
    from stages.tools.calibration_bench import e2b_costs

    config = {
        "calibration_ar": 128,
        "prefill_ar": 32,
        "calibration_tokens": 2048,
        "max_context": 2048,
        "calibration_samples": 20,
        "hessian_samples": 8,
        "sensitivity_tokens": 128,
    }
    passes = [
        {"name": "ranges_prefill", "wall_s": 64.0, "tokens": 4096, "units": 32, "unit": "call"},
        {"name": "hessians", "wall_s": 48.0, "tokens": 2048, "units": 16, "unit": "call"},
        {"name": "sensitivity", "wall_s": 820.0, "tokens": 128, "units": 205, "unit": "weight"},
    ]
    rows = {(r["field"], r["value"]): r for r in e2b_costs(config, passes)}
    # 2 s a call, 16 AR-128 calls a 2048-token sequence.
    assert rows["calibration_samples", 20]["seconds"] == 20 * 16 * 2.0
    assert rows["calibration_samples", 20]["tokens"] == 20 * 2048
    assert rows["calibration_samples", 20]["preset_value"] == 20
    assert rows["hessian_samples", 4]["seconds"] == 4 * 16 * 3.0
    # 4 s a weight for one call; 512 tokens are 4 calls.
    assert rows["sensitivity_tokens", 512]["seconds"] == 205 * 4 * 4.0


def test_the_bench_table_shows_each_pass_and_its_time_per_unit():
    from stages.tools.bench import passes_markdown

    assert passes_markdown(None) == []
    lines = passes_markdown(
        [{"name": "sensitivity", "wall_s": 600.0, "tokens": 128, "units": 200, "unit": "weight"}]
    )
    assert "| sensitivity | 10.0 min | 128 | 200 weights | 3.00 s/weight |" in lines


def test_the_recipe_table_marks_each_preset_share_and_says_when_e2b_is_unpriced():
    from stages.tools.calibration_bench import recipe_markdown

    tiny = [
        {
            "field": "hessian_samples",
            "value": v,
            "preset_value": 8,
            "pass_tokens": v * 128,
            "top1_agreement": 0.96,
            "kl_divergence": 0.005,
            "pass_s": 1.0,
        }
        for v in (4, 8)
    ]
    md = recipe_markdown(tiny, [], None, "make bench-calibration")
    assert "| hessian_samples | 8 (preset) | 1024 | 0.960 | 0.00500 | 1.0 s |" in md
    assert "| hessian_samples | 4 | 512 |" in md
    assert "no committed bench run timed its quantize passes" in md
    e2b = [{"field": "hessian_samples", "value": 8, "preset_value": 8, "tokens": 16384, "seconds": 660.0}]
    assert "| hessian_samples | 8 (preset) | 16384 | 11.0 min |" in recipe_markdown(tiny, e2b, "x.json", "c")
