"""`make` with RUNNER=local: the same stage targets in the project venv, no Docker."""

from __future__ import annotations

import json

import pytest
from conftest import make

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
