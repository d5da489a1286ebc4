"""Integrity through Make with RUNNER=local on the tiny model: a changed byte anywhere upstream stops
the next stage with one line naming the file and the stage to rerun (and that rerun works); another
preset neither invalidates nor reuses results; `make clean` keeps checkpoints; prompts and WORKDIR
paths reach the stages unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import folder_locked_by_another_process, make

pytestmark = pytest.mark.slow

STAGE_COMMANDS = ("download", "export", "quantize", "compile", "bundle")


def _ran(r) -> set[str]:
    """The stages whose g4v69 command make ran (or, with -n, would run)."""
    return {
        s
        for line in r.stdout.splitlines()
        if "bin/g4v69'" in line
        for s in STAGE_COMMANDS
        if line.split()[-1] == s
    }


def _error(r) -> str:
    lines = [x for x in r.stderr.splitlines() if x.startswith("Error: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def _flip(path, offset=-1):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _no_partials(work):
    return [p for p in work.rglob(".*") if ".partial-" in p.name or ".old-" in p.name]


def test_every_flipped_byte_is_caught_and_the_named_rerun_repairs_it(tmp_path):
    work = tmp_path / "w"
    tiny = ("PRESET=tiny", "RUNNER=local", f"WORKDIR={work}")
    first = make("bundle", *tiny)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    compiled = json.loads((work / "compiled" / "report.json").read_text())
    binary = compiled["figures"]["binaries"][0]["file"]

    # The bundle: a copy, so editing it leaves compiled/ intact; verify names it and `make bundle`.
    _flip(work / "genie_bundle" / binary)
    r = make("verify", *tiny)
    assert r.returncode != 0
    line = _error(r)
    assert f"genie_bundle/{binary} changed after bundle wrote it" in line and "`make bundle` again" in line
    recorded = {f["path"]: f["sha256"] for f in compiled["outputs"]}
    from stages.core.report import sha256_file

    assert sha256_file(work / "compiled" / binary) == recorded[binary]
    assert _ran(make("-n", "verify", *tiny)) == {"bundle"}

    # compiled/: caught by the bundle stage, which Make now reruns.
    _flip(work / "compiled" / binary)
    r = make("bundle", *tiny)
    line = _error(r)
    assert r.returncode != 0 and f"compiled/{binary} changed after compile wrote it" in line
    assert "`make compile` again" in line and _ran(make("-n", "bundle", *tiny)) == {"compile", "bundle"}

    # quantized/: caught by the compile stage.
    qdq = json.loads((work / "quantized" / "report.json").read_text())["figures"]["graphs"][0]["qdq_onnx"]
    _flip(work / "quantized" / qdq, 100)
    r = make("bundle", *tiny)
    line = _error(r)
    assert r.returncode != 0 and f"quantized/{qdq} changed after quantize wrote it" in line
    assert "`make quantize` again" in line

    # The checkpoint: a truncated weights file, then a hidden_size that disagrees with the weights.
    ckpt = work / "checkpoints" / "tiny"
    weights = ckpt / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    r = make("bundle", *tiny)
    line = _error(r)
    assert r.returncode != 0 and f"{weights} has {size // 2} bytes, download wrote {size}" in line
    assert "`make download` again" in line
    # The advised `make download` makes the checkpoint again; export, the next stage to run, then
    # notices a config.json edited after that.
    assert _ran(make("download", *tiny)) == {"download"}
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["hidden_size"] *= 2
    (ckpt / "config.json").write_text(json.dumps(config))
    r = make("bundle", *tiny)
    line = _error(r)
    assert r.returncode != 0 and f"{ckpt / 'config.json'} has " in line and "`make download` again" in line
    assert _ran(r) == {"export"}
    assert "Traceback" not in r.stderr and not _no_partials(work)

    # The advice works: Make redoes the download and everything after it, and the bundle verifies
    # (on a prompt from the tiny model's domain: verify's thresholds judge the model too).
    r = make("verify", *tiny, "PROMPT=Return the first element of a list.")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _ran(r) == set(STAGE_COMMANDS)
    assert sha256_file(work / "genie_bundle" / binary) == sha256_file(work / "compiled" / binary)


def test_presets_prompts_paths_and_clean_through_make(tmp_path):
    work = tmp_path / "work dir"  # a space in WORKDIR
    canary = Path("/tmp/g4v69-canary")  # short: the tiny model's context is 128 byte-level tokens
    canary.unlink(missing_ok=True)
    demo = make("demo", "RUNNER=local", f"WORKDIR={work}")
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert _ran(demo) == set(STAGE_COMMANDS)
    # exported/ holds only what export wrote: quantize's shape-inferred copies stay in its own folder.
    exported = json.loads((work / "exported" / "report.json").read_text())
    on_disk = {str(p.relative_to(work / "exported")) for p in (work / "exported").rglob("*") if p.is_file()}
    assert on_disk == {f["path"] for f in exported["outputs"]} | {"report.json"}

    prompt = f"Costs $5 $$HOME $(shell touch {canary}) \"q\" 's'\nx"
    # Out of the tiny model's domain: this checks the prompt's path, not the model, so no thresholds.
    r = make(
        "verify",
        "PRESET=tiny",
        "RUNNER=local",
        f"WORKDIR={work}",
        f"PROMPT={prompt}",
        "VERIFY_MIN_PREFIX=0",
        "VERIFY_MIN_TOP1=0",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((work / "verify" / "report.json").read_text())["figures"]["prompt"] == prompt
    assert not canary.exists() and _ran(r) == set()
    too_long = make("verify", "PRESET=tiny", "RUNNER=local", f"WORKDIR={work}", "PROMPT=" + "word " * 40)
    # One line, in the real Genie's own words: the prompt is longer than the context.
    assert too_long.returncode == 2 and "Input exceeds the context of the model" in _error(too_long)
    assert "Traceback" not in too_long.stderr

    # The default preset forgotten: its download fails (offline) and must not touch the tiny results.
    forgot = make("verify", "RUNNER=local", f"WORKDIR={work}", env={"HF_HUB_OFFLINE": "1"})
    assert forgot.returncode != 0
    again = make("demo", "RUNNER=local", f"WORKDIR={work}")
    assert again.returncode == 0 and _ran(again) == set(), again.stdout[-3000:]

    # Another export config replaces exported/: the tiny config then redoes export and what follows,
    # and never reuses the other config's graphs.
    other = make("export", "PRESET=tiny", "MAX_CONTEXT=64", "RUNNER=local", f"WORKDIR={work}")
    assert other.returncode == 0, other.stderr[-3000:]
    planned = make("-n", "verify", "PRESET=tiny", "RUNNER=local", f"WORKDIR={work}")
    assert _ran(planned) == {"export", "quantize", "compile", "bundle"}

    # make clean: outputs and stale partial folders go; checkpoints, their stamps and a live run stay.
    stale = work / ".quantized.partial-999999"
    stale.mkdir()
    live = work / ".compiled.partial-1"
    live.mkdir()
    with folder_locked_by_another_process(live):
        clean = make("clean", "PRESET=tiny", f"WORKDIR={work}")
        assert clean.returncode == 0, clean.stderr
        assert not stale.exists() and live.is_dir()
    assert not (work / "exported").exists() and (work / "checkpoints" / "tiny" / "report.json").is_file()
    assert [p.name[:14] for p in (work / ".g4v69").iterdir()] == ["download-tiny-"]
    assert _ran(make("-n", "download", "PRESET=tiny", "RUNNER=local", f"WORKDIR={work}")) == set()
