"""The AI Hub compile backend against the qai_hub test double (tests/doubles/qai_hub): success, a
failed job, rate limiting, internal errors, bad tokens, quota, unknown devices, and a kill while
waiting followed by a rerun that submits nothing twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from stages.aihub import MAX_ATTEMPTS, AihubError, compile_aihub
from stages.core.config import load_config
from stages.model.geometry import builtin_geometry
from stages.planning.job import Job
from tests.conftest import DOUBLES, REPO

TOKEN = "test-token"


def _layout(cfg):
    """The context binaries of the config's job on the tiny model, as export lays them out."""
    return list(Job.build(builtin_geometry("tiny"), cfg, specs=False).binaries)


def _prepared(tmp_path: Path, cfg) -> dict[str, Path]:
    """A small ONNX file per graph of the layout, with I/O named as the graph's would be."""
    out = {}
    for b in _layout(cfg):
        for g in b.graphs:
            graph = helper.make_graph(
                [helper.make_node("Relu", ["inputs_embeds"], [f"{g}_out"])],
                g,
                [helper.make_tensor_value_info("inputs_embeds", TensorProto.UINT16, [1, 4])],
                [helper.make_tensor_value_info(f"{g}_out", TensorProto.UINT16, [1, 4])],
            )
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
            out[g] = tmp_path / f"{g}.onnx"
            onnx.save(model, str(out[g]))
    return out


def _run(fake_hub, tmp_path, soc: str = "SM8450"):
    cfg = load_config("tiny", {"soc": soc, "compiler": "aihub"})
    tmp_path.mkdir(parents=True, exist_ok=True)
    prepared = _prepared(tmp_path, cfg)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    figures, qairt = compile_aihub(cfg, _layout(cfg), prepared, out, tmp_path / "ledger.json", fake_hub)
    return cfg, out, figures, json.loads((tmp_path / "ledger.json").read_text())


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("QAI_HUB_API_TOKEN", TOKEN)


def test_success_gives_one_binary_per_graph_on_v69(fake_hub, tmp_path, token):
    fake_hub.scenario(devices=fake_hub_devices(), polls_to_finish=3, valid_tokens=[TOKEN])
    cfg, out, figures, ledger = _run(fake_hub, tmp_path)
    files = [b.file for b in _layout(cfg)]
    assert [f["file"] for f in figures] == files
    for f in files:
        data = (out / f).read_bytes()
        assert b"soc_type=SM8450;arch=69" in data and b"inputs_embeds" in data
    assert len(fake_hub.calls("submit_compile_job")) == 4 and len(fake_hub.calls("upload_model")) == 4
    jobs = ledger["jobs"]
    assert all(j["status"] == "SUCCESS" and j["attempts"] == 1 for j in jobs.values())
    server = json.loads((tmp_path / "hub-server" / "server.json").read_text())
    options = {j["options"] for j in server["jobs"].values()}
    assert options == {"--target_runtime qnn_context_binary --qairt_version 2.51"}
    assert {j["device"] for j in server["jobs"].values()} == {"Samsung Galaxy S22 (Family)"}


def test_weight_sharing_soc_compiles_dlcs_and_links_each_part(fake_hub, tmp_path, token):
    fake_hub.scenario(devices=fake_hub_devices())
    cfg, out, figures, ledger = _run(fake_hub, tmp_path, soc="SM8550")
    assert [f["file"] for f in figures] == ["part1_of_2.bin", "part2_of_2.bin"]
    assert len(fake_hub.calls("submit_link_job")) == 2
    server = json.loads((tmp_path / "hub-server" / "server.json").read_text())
    links = [j for j in server["jobs"].values() if j["kind"] == "link"]
    assert all(len(j["models"]) == 2 for j in links)
    assert b"soc_type=SM8550;arch=73" in (out / "part1_of_2.bin").read_bytes()


def test_a_failed_job_is_shown_and_resubmitted(fake_hub, tmp_path, token, capsys):
    fake_hub.scenario(devices=fake_hub_devices(), fail={"decode_ar1_part2_of_2": ["Op Foo not supported"]})
    _, out, _, ledger = _run(fake_hub, tmp_path)
    assert "decode_ar1_part2_of_2 failed: Op Foo not supported" in capsys.readouterr().err
    assert ledger["jobs"]["decode_ar1_part2_of_2"]["attempts"] == 2
    assert len(fake_hub.calls("upload_model")) == 4  # the resubmission reused the uploaded model
    assert (out / "decode_ar1_part2_of_2.bin").is_file()


def test_a_job_that_keeps_failing_stops_with_its_message_and_url(fake_hub, tmp_path, token):
    fake_hub.scenario(devices=fake_hub_devices(), fail={"prefill_ar4_part1_of_2": ["out of memory"] * 9})
    with pytest.raises(
        AihubError,
        match=rf"failed {MAX_ATTEMPTS} times; last message: out of memory; "
        r"see https://workbench.aihub.qualcomm.com/jobs/j\d+/",
    ):
        _run(fake_hub, tmp_path)


def test_rate_limiting_backs_off_then_succeeds(fake_hub, tmp_path, token):
    fake_hub.scenario(devices=fake_hub_devices(), rate_limit={"submit_compile_job": 3, "get_status": 2})
    _, out, _, ledger = _run(fake_hub, tmp_path)
    assert len(fake_hub.calls("submit_compile_job")) == 4 + 3
    assert all(j["attempts"] == 1 for j in ledger["jobs"].values())


def test_internal_errors_retry_a_few_times_then_stop_clearly(fake_hub, tmp_path, token):
    fake_hub.scenario(devices=fake_hub_devices(), internal_error={"get_devices": 2})
    _run(fake_hub, tmp_path)  # two failures are retried
    fake_hub.scenario(devices=fake_hub_devices(), internal_error={"upload_model": 99})
    with pytest.raises(AihubError, match="failed uploading .* 4 times: Internal API failure.*rerun later"):
        _run(fake_hub, tmp_path / "again")


def test_no_network_is_one_clear_line(fake_hub, tmp_path, token):
    """With no connection the real client raises InternalError with a boxed, multi-line message."""
    fake_hub.scenario(devices=fake_hub_devices(), no_network=True)
    with pytest.raises(AihubError) as e:
        _run(fake_hub, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "\u2500" not in msg
    assert "Could not connect to Qualcomm AI Hub" in msg and "check the connection" in msg


def test_no_token_bad_token_quota_and_unknown_device_are_clear(fake_hub, tmp_path, monkeypatch):
    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    with pytest.raises(AihubError, match="needs an AI Hub API token: set QAI_HUB_API_TOKEN"):
        _run(fake_hub, tmp_path)
    assert fake_hub.calls() == []
    monkeypatch.setenv("QAI_HUB_API_TOKEN", "wrong")
    fake_hub.scenario(devices=fake_hub_devices(), valid_tokens=[TOKEN])
    with pytest.raises(AihubError, match="AI Hub rejected the API token"):
        _run(fake_hub, tmp_path)
    monkeypatch.setenv("QAI_HUB_API_TOKEN", TOKEN)
    fake_hub.scenario(devices=fake_hub_devices(), quota_exceeded=True)
    with pytest.raises(AihubError, match="quota is used up"):
        _run(fake_hub, tmp_path)
    fake_hub.scenario(devices=[d for d in fake_hub_devices() if d["soc"] != "SM8450"])
    with pytest.raises(AihubError, match="knows no device named 'Samsung Galaxy S22 \\(Family\\)'"):
        _run(fake_hub, tmp_path)


def test_the_token_never_reaches_the_ledger(fake_hub, tmp_path, token):
    fake_hub.scenario(devices=fake_hub_devices())
    _run(fake_hub, tmp_path)
    assert TOKEN not in (tmp_path / "ledger.json").read_text()


KILLABLE = """
import sys
from pathlib import Path
import qai_hub
from stages.aihub import compile_aihub
from stages.core.config import load_config
from stages.model.geometry import builtin_geometry
from stages.planning.job import Job
tmp = Path(sys.argv[1])
cfg = load_config("tiny", {"compiler": "aihub"})
prepared = {p.stem: p for p in tmp.glob("*.onnx")}
(tmp / "out").mkdir(exist_ok=True)
layout = list(Job.build(builtin_geometry("tiny"), cfg, specs=False).binaries)
compile_aihub(cfg, layout, prepared, tmp / "out", tmp / "ledger.json", qai_hub)
"""


def test_kill_while_waiting_then_rerun_submits_nothing_twice(fake_hub, tmp_path, token):
    fake_hub.scenario(devices=fake_hub_devices(), polls_to_finish=10**6)  # jobs run "forever"
    cfg = load_config("tiny", {"compiler": "aihub"})
    _prepared(tmp_path, cfg)
    env = {**os.environ, "PYTHONPATH": f"{DOUBLES}{os.pathsep}{REPO}", "G4V69_AIHUB_POLL_S": "0.05"}
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, str(tmp_path)], env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while len(fake_hub.calls("get_status")) < 8 and time.time() < deadline:
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    assert len(fake_hub.calls("submit_compile_job")) == 4
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert {j["status"] for j in ledger["jobs"].values()} == {"SUBMITTED"}
    fake_hub.scenario(devices=fake_hub_devices(), polls_to_finish=1)  # now they finish

    def rerun():
        prepared = {p.stem: p for p in tmp_path.glob("*.onnx")}
        return compile_aihub(
            cfg, _layout(cfg), prepared, tmp_path / "out", tmp_path / "ledger.json", fake_hub
        )

    figures, _ = rerun()
    assert len(fake_hub.calls("submit_compile_job")) == 4 and len(fake_hub.calls("upload_model")) == 4
    assert len(figures) == 4 and all((tmp_path / "out" / f["file"]).is_file() for f in figures)
    # A third run finds everything finished and only downloads.
    rerun()
    assert len(fake_hub.calls("submit_compile_job")) == 4


def fake_hub_devices() -> list[dict]:
    from tests.conftest import SOC_DEVICES

    return SOC_DEVICES


# ---- the double against the real package ----
_DESCRIBE = r"""
import importlib, inspect, json, sys
out = {}
for mod in ("qai_hub", "qai_hub.client", "qai_hub.hub", "qai_hub.public_rest_api"):
    m = importlib.import_module(mod)
    names = {}
    for n in sorted(n for n in dir(m) if not n.startswith("_")):
        v = getattr(m, n)
        d = {"module": getattr(v, "__module__", None), "kind": type(v).__name__}
        if inspect.isclass(v) and issubclass(v, BaseException):
            d["bases"] = [b.__name__ for b in v.__mro__[1:-2]]
        names[n] = d
    rate_limited = hasattr(m, "RateLimitedError")
    out[mod] = {"names": names, "all": getattr(m, "__all__", None), "RateLimitedError": rate_limited}
m = importlib.import_module("qai_hub.client")
sigs = {}
for cls in ("Client", "Job", "CompileJob", "LinkJob"):
    for n, f in inspect.getmembers(getattr(m, cls), inspect.isfunction):
        if not n.startswith("_"):
            sigs[f"{cls}.{n}"] = list(inspect.signature(f).parameters)
out["signatures"] = sigs
out["file"] = importlib.import_module("qai_hub").__file__
out["version"] = str(importlib.import_module("qai_hub").__version__)
print(json.dumps(out))
"""


def _describe(pythonpath: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env["FAKE_QAI_HUB_STATE"] = env.get("TMPDIR", "/tmp") + "/g4v69-describe-hub"
    r = subprocess.run([sys.executable, "-c", _DESCRIBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def test_the_double_has_the_real_packages_layout_and_names():
    """Every public name of the double exists in the installed qai-hub 0.56.0, in the same module,
    with the same exception hierarchy and method parameters; RateLimitedError lives in qai_hub.client
    only, in both. Catches a double that drifts from the package the compile image really has."""
    pytest.importorskip("qai_hub")
    real = _describe(None)
    fake = _describe(str(DOUBLES))
    assert "tests/doubles" in fake["file"] and "site-packages" in real["file"]
    assert fake["version"] == real["version"]
    for mod in ("qai_hub", "qai_hub.client", "qai_hub.hub", "qai_hub.public_rest_api"):
        for name, d in fake[mod]["names"].items():
            if d["kind"] == "module" or (d["module"] or "qai_hub").split(".")[0] != "qai_hub":
                continue  # the double's own imports (json, dataclass, ...)
            assert name in real[mod]["names"], f"{mod}.{name} is not in the real package"
            want = real[mod]["names"][name]
            assert d["module"] == want["module"], f"{mod}.{name}: defined in {d['module']}, really {want}"
            assert d.get("bases") == want.get("bases"), f"{mod}.{name}: exception bases differ"
        assert fake[mod]["RateLimitedError"] == real[mod]["RateLimitedError"], mod
        if fake[mod]["all"] is not None:
            assert set(fake[mod]["all"]) <= set(real[mod]["all"] or []), (
                f"{mod}.__all__ has names the real lacks"
            )
    assert real["qai_hub"]["RateLimitedError"] is False and real["qai_hub.client"]["RateLimitedError"] is True
    for name, params in fake["signatures"].items():
        assert name in real["signatures"], f"{name} is not in the real package"
        assert params == real["signatures"][name], f"{name}: {params} != {real['signatures'][name]}"
    # What the compile stage itself touches exists in both.
    for mod, name in [
        ("qai_hub", n) for n in ("Client", "ClientConfig", "Device", "Error", "UserError", "InternalError")
    ]:
        assert name in real[mod]["names"] and name in fake[mod]["names"], name
