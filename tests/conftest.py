from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A small multimodal-style Gemma 4 config.json: sliding + full layers, KV sharing, double-wide MLP, PLE.
TINY_GEMMA4_CONFIG = {
    "model_type": "gemma4",
    "text_config": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "vocab_size": 256,
        "intermediate_size": 128,
        "sliding_window": 8,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
}


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO, timeout: int = 600):
    """Run a command and return the CompletedProcess with text stdout/stderr."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def g4v69(tmp_path):
    """Run the CLI in-process via click's runner, in an empty working folder."""
    from click.testing import CliRunner

    from stages.cli import main

    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None):
        with runner.isolated_filesystem(temp_dir=tmp_path):
            result = runner.invoke(main, list(args), env=env, catch_exceptions=False)
            result.files = sorted(str(p) for p in Path(".").rglob("*"))
        return result

    return invoke


# ---- the container tier: a Docker engine (or a visible skip), the base image, the stage images ----
STAGE_IMAGES = ("export", "quant", "quant-rocm", "compile", "tools")


def make(*args: str, env: dict[str, str] | None = None, timeout: int = 1800):
    return run(["make", "--no-print-directory", *args], env=env, timeout=timeout)


@pytest.fixture(scope="session")
def docker_engine():
    why = None
    if shutil.which("docker") is None:
        why = "no docker client on PATH"
    elif run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=60).returncode != 0:
        why = "no Docker engine answers (start dockerd)"
    if why:
        if os.environ.get("G4V69_REQUIRE_DOCKER") == "1":
            pytest.fail(f"container tier is required (G4V69_REQUIRE_DOCKER=1) but {why}")
        pytest.skip(f"container tier skipped: {why}")


OFFICIAL_BASE = "python:3.11-slim-bookworm"


@pytest.fixture(scope="session")
def base_image(docker_engine) -> str:
    """BASE_IMAGE as given; otherwise the official base if it can be had, else the debootstrap one."""
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    have = run(["docker", "image", "inspect", OFFICIAL_BASE]).returncode == 0
    if not have:
        try:
            have = run(["docker", "pull", OFFICIAL_BASE], timeout=300).returncode == 0
        except subprocess.TimeoutExpired:
            have = False
    os.environ["BASE_IMAGE"] = OFFICIAL_BASE if have else "debootstrap"
    return os.environ["BASE_IMAGE"]


@pytest.fixture(scope="session")
def images(base_image) -> dict[str, str]:
    """Builds missing images (reusing those whose lock-derived tag exists); returns their tags."""
    r = make("images")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tags = {}
    for name in STAGE_IMAGES:
        t = make("-s", "image-tag", f"IMAGE={name}")
        assert t.returncode == 0, t.stderr
        tags[name] = t.stdout.strip()
        assert run(["docker", "image", "inspect", tags[name]]).returncode == 0
    return tags


# ---- the pipeline's own outputs, built once per session for the later stages' tests ----
DOUBLES = REPO / "tests" / "doubles"


@pytest.fixture(scope="session")
def quantized_tiny(tmp_path_factory) -> Path:
    """A WORKDIR with the trained tiny model downloaded, exported and quantized for SM8450.
    Tests copy it (`copy_workdir`) before writing into it."""
    from stages.core.config import load_config
    from stages.download import run_download
    from stages.export import run_export
    from stages.quantize import run_quantize

    work = tmp_path_factory.mktemp("quantized-tiny")
    cfg = load_config("tiny")
    ckpt = work / "checkpoints" / cfg.checkpoint_name
    run_download(cfg.model, cfg.model_revision, ckpt)
    run_export(cfg, work, ckpt)
    run_quantize(cfg, work, ckpt)
    return work


def copy_workdir(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="module")
def bundled(quantized_tiny, tmp_path_factory) -> Path:
    """A copy of `quantized_tiny` compiled and bundled (the tiny preset): genie_bundle/ in it."""
    from stages.compile import run_compile
    from stages.core.config import load_config
    from stages.runtimes.genie.bundle import run_bundle

    work = copy_workdir(quantized_tiny, tmp_path_factory.mktemp("bundled") / "w")
    cfg = load_config("tiny")
    run_compile(cfg, work)
    run_bundle(cfg, work, work / "checkpoints" / "tiny")
    return work


def rewrite_report(work: Path, folder: Path, report: dict) -> None:
    """Write folder/report.json as its stage would have (sealed), and record the new file in every
    later stage's report under `work` that read it, and so on down: a work folder whose stages all
    agree with the edited report, for tests of what a stage does with such a report."""
    from stages.core.report import REPORT_NAME, STAGE_DIRS, read_report, sha256_file, write_report

    write_report(folder, report)
    path = (folder / REPORT_NAME).resolve()
    for stage, name in STAGE_DIRS.items():
        later = read_report(work / name) if stage != "download" else None
        for entry in (later or {}).get("inputs", []):
            if (work / entry["path"]).resolve() == path:
                entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
                rewrite_report(work, work / name, later)
                break


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """The qai_hub test double with a fresh server; `fake_hub.scenario(**settings)` sets its behaviour."""
    import importlib.util
    import json
    import sys

    monkeypatch.setenv("FAKE_QAI_HUB_STATE", str(tmp_path / "hub-server"))
    scenario_file = tmp_path / "hub-scenario.json"
    monkeypatch.setenv("FAKE_QAI_HUB_SCENARIO", str(scenario_file))
    monkeypatch.setenv("G4V69_AIHUB_POLL_S", "0")
    monkeypatch.setenv("G4V69_AIHUB_BACKOFF_S", "0")
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "no-client.ini"))
    spec = importlib.util.spec_from_file_location(
        "fake_qai_hub",
        DOUBLES / "qai_hub" / "__init__.py",
        submodule_search_locations=[str(DOUBLES / "qai_hub")],
    )
    module = importlib.util.module_from_spec(spec)
    for name in [n for n in sys.modules if n == "fake_qai_hub" or n.startswith("fake_qai_hub.")]:
        del sys.modules[name]  # a fresh package each test, its submodules bound as attributes again
    sys.modules["fake_qai_hub"] = module
    spec.loader.exec_module(module)

    def scenario(**settings) -> None:
        scenario_file.write_text(json.dumps(settings))

    def calls(method: str | None = None) -> list:
        path = tmp_path / "hub-server" / "server.json"
        found = json.loads(path.read_text())["calls"] if path.exists() else []
        return [c for c in found if method is None or c[0] == method]

    module.scenario = scenario
    module.calls = calls
    scenario(devices=SOC_DEVICES)
    return module


# What AI Hub answers for the SoC table's devices (names and chipsets as the table has them).
def _soc_devices() -> list[dict]:
    from stages.core.soc import SOCS

    return [
        {"name": s.aihub_device, "attributes": [s.aihub_chipset], "soc": s.name, "arch": s.htp_arch}
        for s in SOCS.values()
    ]


SOC_DEVICES = _soc_devices()


@contextlib.contextmanager
def folder_locked_by_another_process(folder: Path):
    """Hold an exclusive flock on `folder` from a child process, as a live stage holds its partial
    folder, until the block ends."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(folder),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait()
