"""Reports read back typed: what a stage hands on, and the one-line error when it is not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.core.report import stage_output
from stages.planning.results import CompileResult, ExportResult, StageReport, read_result, require_result


class Missing(ValueError):
    pass


def test_a_written_report_reads_back_typed(tmp_path: Path) -> None:
    out = tmp_path / "compiled"
    with stage_output("compile", out, [], {"soc": "SM8450"}, root=tmp_path) as run:
        (run.dir / "a.bin").write_bytes(b"x")
        run.figures.update(
            binaries=[{"file": "a.bin", "bytes": 1, "graphs": [], "weight_shared": False}],
            backend={"name": "local", "qairt_version": "2.51.0"},
            soc="SM8450",
            dsp_arch="v69",
        )
    compiled = read_result(tmp_path, "compile", CompileResult)
    assert compiled is not None and compiled.folder == out
    assert [b.file for b in compiled.binaries] == ["a.bin"] and compiled.dsp_arch == "v69"
    assert compiled.backend.qairt_version == "2.51.0" and compiled.binaries[0].graphs == ()
    assert compiled.report.options == {"soc": "SM8450"} and compiled.report.wall_s >= 0
    assert [o["path"] for o in compiled.report.outputs] == ["a.bin"]


def test_a_missing_or_broken_report_names_the_stage_to_run(tmp_path: Path) -> None:
    assert read_result(tmp_path, "export", ExportResult) is None
    with pytest.raises(Missing, match=r"holds no finished export stage .*run `make export` first"):
        require_result(tmp_path, "export", ExportResult, Missing)
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "report.json").write_text("{not json")
    assert StageReport.read(tmp_path / "exported") is None
    (tmp_path / "exported" / "report.json").write_text(json.dumps({"figures": {}}))  # no stage: not a report
    assert StageReport.read(tmp_path / "exported") is None
