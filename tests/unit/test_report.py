import hashlib
import json

import pytest

from stages.core.report import read_report, stage_output


def test_success_writes_report_and_swaps_in(tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(b"weights")
    out = tmp_path / "exported"
    with stage_output("export", out, [src], {"num_shards": 4}, root=tmp_path) as run:
        (run.dir / "graph.onnx").write_bytes(b"graph")
        run.figures["graphs"] = 1
        assert not out.exists()  # nothing visible until complete
    report = read_report(out)
    assert report["stage"] == "export"
    assert report["inputs"] == [
        {"path": "in.bin", "bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}
    ]
    assert report["outputs"][0]["path"] == "graph.onnx"
    assert report["options"] == {"num_shards": 4} and report["figures"] == {"graphs": 1}
    assert report["wall_s"] >= 0 and report["peak_rss_bytes"] > 1 << 20
    assert "python" in report["tool_versions"] and "click" in report["tool_versions"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "in.bin"]


def test_failure_leaves_no_partial_output_and_keeps_the_old_one(tmp_path):
    out = tmp_path / "quantized"
    with stage_output("quantize", out, [], {}, root=tmp_path) as run:
        (run.dir / "old.onnx").write_text("v1")
    with pytest.raises(RuntimeError):
        with stage_output("quantize", out, [], {}, root=tmp_path) as run:
            (run.dir / "new.onnx").write_text("half")
            raise RuntimeError("calibration died")
    assert (out / "old.onnx").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantized"]


def test_folder_without_report_is_not_complete(tmp_path):
    (tmp_path / "x").mkdir()
    assert read_report(tmp_path / "x") is None
    assert read_report(tmp_path / "missing") is None


def test_secrets_never_reach_a_report(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_canary_report_987")
    out = tmp_path / "o"
    with stage_output("download", out, [], {"url": "https://x/?token=hf_canary_report_987"}, root=tmp_path):
        pass
    text = (out / "report.json").read_text()
    assert "hf_canary_report_987" not in text and "<redacted>" in text
    json.loads(text)


def _child_peak() -> int:
    from stages.core.report import process_peak_rss_bytes

    return process_peak_rss_bytes()


def test_a_spawned_workers_peak_is_its_own_not_its_parents():
    """Compile workers are spawned (fork + exec); their ru_maxrss starts at the parent's RSS, which
    once made every binary report the stage's 6.7 GiB peak."""
    import sys
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    import numpy as np

    if not sys.platform.startswith("linux"):
        pytest.skip("VmHWM is Linux's")
    ballast = np.ones(400 * 2**20, dtype=np.uint8)  # 400 MiB resident in the parent
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        child = pool.submit(_child_peak).result()
    assert ballast.sum() == ballast.size
    assert child < 300 * 2**20, child
