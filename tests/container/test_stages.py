"""Container tier: the stages as users run them, `make <stage>` in the stage images, on the tiny model."""

from __future__ import annotations

import json

import pytest
from conftest import make

pytestmark = [pytest.mark.container, pytest.mark.slow]


def _report(path):
    return json.loads(path.read_text())


def test_make_export_tiny_in_the_export_image_then_nothing_to_redo(images, tmp_path):
    r = make("export", "PRESET=tiny", f"WORKDIR={tmp_path}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    download = _report(tmp_path / "checkpoints" / "tiny" / "report.json")
    export = _report(tmp_path / "exported" / "report.json")
    assert download["figures"]["source"] == "builtin"
    assert len(export["figures"]["graphs"]) == 4  # tiny preset: 2 parts x (prefill, decode)
    assert export["tool_versions"]["onnxruntime"] and export["tool_versions"]["torch"].startswith("2.13")
    # Files the container wrote belong to the caller, not to root-in-a-container.
    assert (tmp_path / "exported" / "report.json").stat().st_uid == (tmp_path.stat().st_uid)

    again = make("export", "PRESET=tiny", f"WORKDIR={tmp_path}")
    assert again.returncode == 0 and " export" not in again.stdout, again.stdout
    gen = make(
        "g4v69",
        "IMAGE=export",
        f"WORKDIR={tmp_path}",
        f"ARGS=--preset tiny --workdir {tmp_path} generate --prompt Hi --max-new-tokens 4 --json",
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert json.loads(gen.stdout)["generated_tokens"] >= 1


def test_make_quantize_tiny_in_the_quant_image(images, tmp_path):
    r = make("quantize", "PRESET=tiny", f"WORKDIR={tmp_path}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = _report(tmp_path / "quantized" / "report.json")
    assert "torch" not in report["tool_versions"]  # the quant image has no torch: numpy-only runner
    q = report["figures"]["quality"]["float16"]
    assert q["top1_agreement"] >= 0.95
    assert all(g["audit"]["problems"] == [] for g in report["figures"]["graphs"])


def test_make_compile_tiny_in_the_compile_image(images, tmp_path):
    r = make("compile", "PRESET=tiny", f"WORKDIR={tmp_path}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    fig = _report(tmp_path / "compiled" / "report.json")["figures"]
    assert [b["arch"] for b in fig["binaries"]] == [69] * 4
    assert all((tmp_path / "compiled" / b["file"]).stat().st_size > 100_000 for b in fig["binaries"])
    # AI Hub without a token fails before anything is sent, and leaves the local binaries alone.
    hub = make(
        "compile", "PRESET=tiny", "COMPILER=aihub", f"WORKDIR={tmp_path}", env={"QAI_HUB_API_TOKEN": ""}
    )
    assert hub.returncode != 0 and "needs an AI Hub API token" in hub.stderr
    assert _report(tmp_path / "compiled" / "report.json")["figures"]["backend"]["name"] == "local"


def test_make_demo_in_containers_then_bundle_twice_is_identical(images, tmp_path):
    """The README's first command, on a clean WORKDIR: every stage in its image, a verified bundle."""
    r = make("demo", f"WORKDIR={tmp_path / 'a'}", timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "greedy tokens match transformers for" in r.stdout and "bundle: " in r.stdout
    verify = _report(tmp_path / "a" / "verify" / "report.json")["figures"]
    assert verify["matching_prefix_tokens"] >= 16
    # A second clean run gives the same bundle, byte for byte.
    again = make("demo", f"WORKDIR={tmp_path / 'b'}", timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    first, second = (tmp_path / d / "genie_bundle" / "manifest.json" for d in ("a", "b"))
    assert first.read_bytes() == second.read_bytes()
    # So are the exported graphs and LUTs, the quantized graphs (and quality report) and the binaries.
    for stage in ("exported", "quantized", "compiled"):
        a, b = (_report(tmp_path / d / stage / "report.json")["outputs"] for d in ("a", "b"))
        assert a == b and len(a) >= 4, stage
    # The venv (RUNNER=local) makes the same bundle files; its manifest differs only in the tool
    # versions it records (the venv's own, not the images').
    local = make("demo", "RUNNER=local", f"WORKDIR={tmp_path / 'c'}", timeout=1800)
    assert local.returncode == 0, local.stderr[-3000:]
    image_manifest, local_manifest = (
        json.loads((tmp_path / d / "genie_bundle" / "manifest.json").read_text()) for d in ("a", "c")
    )
    assert image_manifest["files"] == local_manifest["files"] and len(local_manifest["files"]) >= 8
    for manifest in (image_manifest, local_manifest):
        manifest.pop("tool_versions")
    assert image_manifest == local_manifest
