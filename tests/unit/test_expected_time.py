"""stages/planning/needs.py expected_stages: how long each stage should take here, from the
committed bench runs."""

import json

import pytest

from stages.core.config import load_config
from stages.planning.needs import BENCH_RESULTS, expected_stages, render_expected, scaled_wall


def test_only_the_share_that_kept_every_core_busy_scales_with_the_cores():
    # 60 s wall, 90 s CPU on 2 cores: 30 s serial, 30 s on both cores
    assert scaled_wall(60, 90, 2, 2) == pytest.approx(60)
    assert scaled_wall(60, 90, 2, 8) == pytest.approx(30 + 30 * 2 / 8)
    assert scaled_wall(60, 90, 2, 1) == pytest.approx(30 + 60)
    assert scaled_wall(60, 40, 2, 8) == pytest.approx(60)  # waiting on I/O: nothing to spread
    assert scaled_wall(60, 60, 1, 8) == pytest.approx(60)  # one bench core says nothing of more


def _bench(path, date, params, config, stages, cpus=2):
    path.write_text(
        json.dumps(
            {
                "date": date,
                "machine": {"cpus": cpus},
                "plan": {"params": {"total": params}},
                "config": config,
                "stages": stages,
            }
        )
    )


def test_the_bench_run_closest_to_the_config_is_the_witness(tmp_path):
    cfg = load_config()
    same = {"precision": cfg.precision, "calibration_samples": cfg.calibration_samples}
    stage = {"quantize": {"wall_s": 600, "cpu_s": 900, "peak_rss_bytes": 2**30}}
    _bench(tmp_path / "a.json", "2026-12-01", 5, same, stage)
    _bench(tmp_path / "b.json", "2026-12-05", 5, {**same, "calibration_samples": 1}, stage)
    _bench(tmp_path / "c.json", "2026-12-06", 7, same, stage)  # another geometry
    got = expected_stages(cfg, 5, 8, tmp_path)
    assert got.source == "a.json" and got.differences == []
    assert got.stages[0].stage == "quantize" and got.stages[0].wall_s == pytest.approx(300 + 300 / 4)
    # the newer run, had it matched as well, would be taken; a cut calibration is said, not hidden
    cut = expected_stages(load_config(overrides={"calibration_samples": 1}), 5, 8, tmp_path)
    assert cut.source == "b.json"
    assert expected_stages(cfg, 9, 8, tmp_path) is None
    lines = render_expected(
        expected_stages(load_config(overrides={"calibration_samples": 3}), 5, 2, tmp_path), "m"
    )
    assert "calibration_samples: 1 -> 3" in lines[-1] and "10 min in all" in lines[0]


def test_the_committed_e2b_runs_price_the_default_job():
    from stages.model.geometry import e2b_geometry
    from stages.planning.fitting import plan_config

    cfg = load_config()
    got = expected_stages(cfg, plan_config(e2b_geometry(), cfg).params["total"], 2, BENCH_RESULTS)
    assert got is not None and [e.stage for e in got.stages][:3] == ["download", "export", "quantize"]
    assert all(e.wall_s > 0 for e in got.stages if e.stage != "bundle")
