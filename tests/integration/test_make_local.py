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
