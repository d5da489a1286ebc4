"""`make` with RUNNER=local: the same stage targets in the project venv, no Docker."""

from __future__ import annotations

import json

import pytest
from conftest import DOUBLES, SOC_DEVICES, make

pytestmark = pytest.mark.slow


def test_make_export_tiny_with_the_local_runner(tmp_path):
    r = make("export", "PRESET=tiny", "RUNNER=local", f"WORKDIR={tmp_path}", "NUM_SHARDS=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(json.loads((tmp_path / "exported" / "report.json").read_text())["figures"]["graphs"]) == 2


def test_make_quantize_tiny_with_the_local_runner(tmp_path):
    # The default preset calibrates on WikiText-2, which this machine cannot download: a clear error.
    offline = make("quantize", "MODEL=tiny", "RUNNER=local", f"WORKDIR={tmp_path}")
    assert offline.returncode != 0 and "G4V69_CALIBRATION_DATASET=files" in offline.stderr
    assert not (tmp_path / "quantized").exists()
    r = make(
        "quantize",
        "MODEL=tiny",
        "RUNNER=local",
        f"WORKDIR={tmp_path}",
        env={"G4V69_CALIBRATION_DATASET": "files"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "quantized" / "report.json").read_text())
    assert len(report["figures"]["graphs"]) == 8  # default preset geometry: 4 parts x 2 graphs

    # The default geometry (context 2048, AR-128, 4 parts) compiles for v69: 8 binaries.
    c = make(
        "compile",
        "MODEL=tiny",
        "RUNNER=local",
        f"WORKDIR={tmp_path}",
        env={"G4V69_CALIBRATION_DATASET": "files"},
    )
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    compiled = json.loads((tmp_path / "compiled" / "report.json").read_text())["figures"]
    assert len(compiled["binaries"]) == 8 and {b["arch"] for b in compiled["binaries"]} == {69}


def test_make_compile_with_aihub_against_the_double(tmp_path):
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"devices": SOC_DEVICES, "polls_to_finish": 2, "valid_tokens": ["t0k"]}))
    env = {
        "PYTHONPATH": str(DOUBLES),
        "FAKE_QAI_HUB_STATE": str(tmp_path / "server"),
        "FAKE_QAI_HUB_SCENARIO": str(scenario),
        "G4V69_AIHUB_POLL_S": "0",
        "QAIHUB_CLIENT_INI": str(tmp_path / "none.ini"),
    }
    args = ("compile", "PRESET=tiny", "COMPILER=aihub", "RUNNER=local", f"WORKDIR={tmp_path}")
    no_token = make(*args, env={**env, "QAI_HUB_API_TOKEN": ""})
    assert no_token.returncode != 0 and "needs an AI Hub API token" in no_token.stderr
    assert not (tmp_path / "compiled").exists()
    r = make(*args, env={**env, "QAI_HUB_API_TOKEN": "t0k"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "compiled" / "report.json").read_text())
    assert report["figures"]["backend"]["name"] == "aihub"
    assert len(json.loads((tmp_path / "compiled" / "aihub_jobs.json").read_text())["jobs"]) == 4
    assert "t0k" not in (tmp_path / "compiled" / "report.json").read_text()
