"""ci/check-runner.sh: the bundle job's disk and memory needs against the runner, before the long work."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages.core.config import load_config
from stages.planning.needs import job_needs

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9


def run_check(tmp_path: Path, free_bytes: int, ram_kb: int, swap_kb: int = 0) -> subprocess.CompletedProcess:
    df = tmp_path / "df"
    df.write_text(
        "#!/bin/sh\n"
        "echo 'Filesystem 1-blocks Used Available Capacity Mounted on'\n"
        f"echo '/dev/root 100 1 {free_bytes} 1% /'\n"
    )
    df.chmod(0o755)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {ram_kb} kB\nMemFree: 1 kB\nSwapTotal: {swap_kb} kB\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("G4V69_")}
    env.update(DF=str(df), MEMINFO=str(meminfo), WORKDIR=str(tmp_path / "work"), PYTHONPATH=str(ROOT))
    # The script runs `python3`: the one running the tests, first on the path.
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return subprocess.run(
        ["bash", str(ROOT / "ci" / "check-runner.sh")], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def needs():
    return job_needs(load_config())


def test_the_default_job_states_its_needs(needs):
    # About 40 GB of disk (the E2B checkpoint, float32 export with calibration twins, quantized
    # graphs, binaries, bundle) and the bench's largest measured peak RSS for E2B geometry.
    assert 35 * GB < needs.disk_bytes < 50 * GB
    assert needs.ram_bytes > 13 * GB and needs.ram_source.endswith(".json")


def test_a_runner_with_room_passes(tmp_path, needs):
    r = run_check(tmp_path, needs.disk_bytes + GB, ram_kb=needs.ram_bytes // 1024 + 1)
    assert r.returncode == 0, r.stderr
    assert "a full run needs about" in r.stdout and "peaks at about" in r.stdout


def test_a_small_disk_fails_before_the_long_work_and_says_by_how_much(tmp_path, needs):
    r = run_check(tmp_path, 14 * GB, ram_kb=64 * 2**20)
    assert r.returncode == 1
    assert "more disk is needed" in r.stderr and "free space" in r.stderr


def test_swap_counts_toward_memory(tmp_path, needs):
    half = needs.ram_bytes // 1024 // 2 + 1
    assert run_check(tmp_path, needs.disk_bytes + GB, ram_kb=half).returncode == 1
    r = run_check(tmp_path, needs.disk_bytes + GB, ram_kb=half, swap_kb=half)
    assert r.returncode == 0, r.stderr


def test_the_workflow_checks_before_it_builds():
    script = (ROOT / "ci" / "build-bundle.sh").read_text()
    assert script.index("ci/check-runner.sh") < script.index("make images")
    workflow = (ROOT / "ci" / "workflow.yml").read_text()
    assert (
        workflow.index("name: free disk")
        < workflow.index("name: add swap")
        < workflow.index("bash ci/build-bundle.sh")
    )
