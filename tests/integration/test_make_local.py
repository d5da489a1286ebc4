"""`make` with RUNNER=local: the same stage targets in the project venv, no Docker."""

from __future__ import annotations

import json

import pytest
from conftest import DOUBLES, SOC_DEVICES, make

pytestmark = pytest.mark.slow

# The default preset's layout (one graph kind per part) at the tiny model's sliding window: the
# default's AR-32 is wider than tiny's 8-slot window, which Genie cannot take (Runtime.layout_problems).
TINY_WINDOW_AR = {"G4V69_PREFILL_AR": "4", "G4V69_DECODE_AR": "4"}
TINY_DEFAULT_LAYOUT = {**TINY_WINDOW_AR, "G4V69_CALIBRATION_DATASET": "files"}


def test_make_export_tiny_with_the_local_runner(tmp_path):
    r = make("export", "PRESET=tiny", "RUNNER=local", f"WORKDIR={tmp_path}", "NUM_SHARDS=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(json.loads((tmp_path / "exported" / "report.json").read_text())["figures"]["graphs"]) == 2


def test_make_quantize_tiny_with_the_local_runner(tmp_path):
    # The default preset calibrates on WikiText-2, which this machine cannot download: a clear error.
    offline = make("quantize", "MODEL=tiny", "RUNNER=local", f"WORKDIR={tmp_path}", env=TINY_WINDOW_AR)
    assert offline.returncode != 0 and "G4V69_CALIBRATION_DATASET=files" in offline.stderr
    assert not (tmp_path / "quantized").exists()
    r = make(
        "quantize",
        "MODEL=tiny",
        "RUNNER=local",
        f"WORKDIR={tmp_path}",
        env=TINY_DEFAULT_LAYOUT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "quantized" / "report.json").read_text())
    # default preset geometry: 4 parts x one graph kind
    assert len(report["figures"]["graphs"]) == 4

    # The default geometry (context 2048, one graph kind, 4 parts, w4a16) compiles for v69: 4 binaries.
    c = make(
        "compile",
        "MODEL=tiny",
        "RUNNER=local",
        f"WORKDIR={tmp_path}",
        env=TINY_DEFAULT_LAYOUT,
    )
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    compiled = json.loads((tmp_path / "compiled" / "report.json").read_text())["figures"]
    assert len(compiled["binaries"]) == 4 and {b["arch"] for b in compiled["binaries"]} == {69}


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


# Lines libraries printed in every demo before stages/core/quiet.py (torchao via transformers in verify,
# onnxruntime's quantizer, libQnnHtp in the compile workers).
LIBRARY_NOISE = ("Failed to load", "register_constant()", "LIBNATIVE", "pre-processing before quantization")


def test_make_demo_with_the_local_runner(tmp_path):
    r = make("demo", "RUNNER=local", f"WORKDIR={tmp_path}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [n for n in LIBRARY_NOISE if n in r.stdout + r.stderr] == [], r.stdout + r.stderr[-3000:]
    fig = json.loads((tmp_path / "verify" / "report.json").read_text())["figures"]
    assert fig["matching_prefix_tokens"] >= 16 and fig["bundle"] == "tiny-sm8450-w8a16-ctx128"
    assert (tmp_path / "genie_bundle" / "genie_config.json").is_file()


def test_make_push_and_run_with_the_adb_double(tmp_path):
    """The demo bundle onto a fake phone and a prompt through a fake genie-t2t-run: the real device
    code and Make targets, with adb and the QAIRT SDK replaced by test doubles."""
    from tests.unit.test_device import make_sdk, phone

    assert make("bundle", "PRESET=tiny", "RUNNER=local", f"WORKDIR={tmp_path}").returncode == 0
    scenario = tmp_path / "adb.json"
    scenario.write_text(
        json.dumps({"devices": [phone(ro_soc_model="SM8450")], "genie": {"answer": "It is 42."}})
    )
    env = {
        "G4V69_ADB": str(DOUBLES / "adb"),
        "FAKE_ADB_STATE": str(tmp_path / "adb-state"),
        "FAKE_ADB_SCENARIO": str(scenario),
        "QNN_SDK_ROOT": str(make_sdk(tmp_path)),
        "ADB_SERIAL": "",
    }
    pushed = make("push", "PRESET=tiny", "RUNNER=local", f"WORKDIR={tmp_path}", env=env)
    assert pushed.returncode == 0, pushed.stdout[-2000:] + pushed.stderr[-2000:]
    assert "/data/local/tmp/tiny-sm8450-w8a16-ctx128" in pushed.stdout and "files pushed" in pushed.stdout
    again = make("push", "PRESET=tiny", "RUNNER=local", f"WORKDIR={tmp_path}", env=env)
    assert " 0 files pushed" in again.stdout, again.stdout
    ran = make("run", "PRESET=tiny", "RUNNER=local", f"WORKDIR={tmp_path}", "PROMPT=What's 6 x 7?", env=env)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "It is 42." in ran.stdout and "decode" in ran.stdout and "tokens/s" in ran.stdout
    runs = [
        json.loads(x)
        for x in next((tmp_path / "adb-state").rglob("genie_runs.jsonl")).read_text().splitlines()
    ]
    prompt = runs[-1]["prompt"]
    assert "What's 6 x 7?" in prompt and "<|turn>" in prompt and not prompt.startswith("<bos>")
