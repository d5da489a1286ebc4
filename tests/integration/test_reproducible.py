"""Reproducibility on the tiny model: results that do not depend on the machine's thread count or the
work folder, and the bench report read back from a finished run."""

from __future__ import annotations

import shutil

import onnxruntime as ort
import pytest

from stages.compile import run_compile
from stages.core.config import load_config
from stages.core.report import read_report
from stages.quantize import run_quantize
from stages.runtimes.genie.bundle import run_bundle
from stages.runtimes.genie.verify import run_verify
from stages.tools.bench import collect, to_markdown
from tests.conftest import copy_workdir

pytestmark = pytest.mark.slow


def _with_threads(monkeypatch, threads: int) -> None:
    """Every onnxruntime session (the float chain and the calibrator's) uses `threads` threads."""

    class Options(ort.SessionOptions):
        def __init__(self):
            super().__init__()
            self.intra_op_num_threads = threads

    monkeypatch.setattr(ort, "SessionOptions", Options)


def test_quantized_graphs_do_not_depend_on_the_thread_count(quantized_tiny, tmp_path, monkeypatch):
    cfg = load_config("tiny")
    hashes = []
    for threads in (1, 2):
        work = copy_workdir(quantized_tiny, tmp_path / f"t{threads}")
        shutil.rmtree(work / "quantized")
        with monkeypatch.context() as m:
            _with_threads(m, threads)
            report = run_quantize(cfg, work, work / "checkpoints" / "tiny")
        hashes.append({f["path"]: f["sha256"] for f in report["outputs"] if f["path"].endswith(".onnx")})
    assert len(hashes[0]) == 4 and hashes[0] == hashes[1]


def test_bench_report_reads_every_stage_and_graph(quantized_tiny, tmp_path):
    work = copy_workdir(quantized_tiny, tmp_path / "w")
    cfg = load_config("tiny")
    run_compile(cfg, work)
    run_bundle(cfg, work, work / "checkpoints" / "tiny")
    run_verify(
        cfg, work, work / "checkpoints" / "tiny", "Return the first element of a list.", engine="replay"
    )
    result = collect(cfg, work, plan=None)
    assert all(result["stages"][s] for s in ("download", "export", "quantize", "compile", "bundle", "verify"))
    # verify as a bench stage: its calls per engine, and each call replayed on the binaries.
    verified = result["verify"]
    assert verified["engine"] == "replay" and verified["calls"]["engine"] == "cpu"
    assert verified["calls"]["calls"] > 10 and verified["binaries_executed_on_htp"] == 4
    assert {c["replay"] for c in verified["htp_replay_calls"]} >= {
        "first call of its graph kind",
        "window wrap",
    }
    assert set(result["graphs"]) == {
        "prefill_ar4_part1_of_2",
        "decode_ar1_part1_of_2",
        "prefill_ar4_part2_of_2",
        "decode_ar1_part2_of_2",
    }
    assert all(g["compile_s"] is not None and g["binary_bytes"] > 0 for g in result["graphs"].values())
    # The config is what the stages recorded, not what the reporting command was given (issue 15: a
    # bench that calibrated on 1 x 256 tokens was reported with the preset's calibration).
    other = load_config("tiny", {"calibration_samples": 20, "calibration_tokens": 4096})
    told = collect(other, work, plan=None)["config"]
    ran = read_report(work / "quantized")["options"]
    assert (
        (told["calibration_samples"], told["calibration_tokens"])
        == (
            ran["calibration_samples"],
            ran["calibration_tokens"],
        )
        != (20, 4096)
    )
    md = to_markdown(result, "make bench")
    assert "| compile |" in md and "| prefill_ar4_part1_of_2 |" in md and "`make bench`" in md
    assert "| verify |" in md and "replayed through the 4 ctx-bins on the HTP emulation" in md
    assert "| window wrap | 4 |" in md
    assert "The real Genie (libGenie.so, x86 HTP emulation): loaded in" in md
