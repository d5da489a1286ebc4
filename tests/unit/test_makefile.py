"""The Makefile's contract: targets, variables, the runner switch and stage skipping."""

import json
import sys
from pathlib import Path

import pytest
from conftest import run

REQUIRED_TARGETS = [
    "images",
    "wheelhouse",
    "base-image",
    "download",
    "export",
    "quantize",
    "compile",
    "bundle",
    "verify",
    "push",
    "run",
    "demo",
    "test",
    "clean",
    "venv",
    "plan",
    "doctor",
    "help",
]
VENV = Path(sys.prefix)
in_venv = pytest.mark.skipif(
    not (VENV / ".installed").exists(), reason="needs the project venv (`make venv`); run via `make test`"
)


def make(*args: str, **env: str):
    return run(["make", "--no-print-directory", *args], env=env)


def stage_report(stage: str, workdir: str) -> str:
    """The report path Make's rule for `stage` targets (the tiny preset, under workdir)."""
    show = f"show-report: ; @echo $(call stage_report,{stage})"
    return make("-s", "--eval", show, "show-report", "PRESET=tiny", f"WORKDIR={workdir}").stdout.strip()


def make_local(*args: str):
    """make with RUNNER=local in the venv these tests run in; `-o` keeps make from rebuilding that venv
    (a worktree's newer pyproject.toml would otherwise reinstall it from under the running tests)."""
    return make("-o", f"{VENV}/.installed", "RUNNER=local", f"VENV={VENV}", *args)


def test_help_lists_every_target_with_a_line():
    r = make("help")
    assert r.returncode == 0
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ") and line.split()}
    missing = [t for t in REQUIRED_TARGETS if t not in listed]
    assert not missing, f"make help lacks {missing}"
    for var in [
        "MODEL",
        "SOC",
        "PRECISION",
        "MAX_CONTEXT",
        "PREFILL_AR",
        "NUM_SHARDS",
        "COMPILER",
        "RUNNER",
        "WORKDIR",
    ]:
        assert var in r.stdout


def test_variables_become_cli_options():
    r = make(
        "-n",
        "plan",
        "RUNNER=local",
        "SOC=SM8550",
        "NUM_SHARDS=2",
        "MAX_CONTEXT=4096",
        "PREFILL_AR=64",
        "PRECISION=w8a16",
        "COMPILER=aihub",
        "MODEL=tiny",
    )
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    for opt in [
        "--soc 'SM8550'",
        "--num-shards '2'",
        "--max-context '4096'",
        "--prefill-ar '64'",
        "--precision 'w8a16'",
        "--compiler 'aihub'",
        "--model 'tiny'",
        "plan",
    ]:
        assert opt in line


def test_docker_runner_passes_secrets_by_name_only():
    r = make("-n", "plan", "RUNNER=docker", HF_TOKEN="hf_canary_dryrun_42", G4V69_PLE_POLICY="int8")
    assert r.returncode == 0, r.stderr
    assert "-e HF_TOKEN " in r.stdout and "--user" in r.stdout and "--cap-drop ALL" in r.stdout
    assert "-e G4V69_PLE_POLICY" in r.stdout  # config env vars reach the container as well
    assert "hf_canary_dryrun_42" not in r.stdout + r.stderr
    assert "--privileged" not in r.stdout


def test_unknown_runner_is_refused():
    r = make("plan", "RUNNER=podman")
    assert r.returncode != 0 and "allowed values: docker, local" in r.stderr


def test_verify_real_genie_takes_on_off_or_full():
    r = make("plan", "RUNNER=local", "VERIFY_REAL_GENIE=ful")
    assert r.returncode != 0 and "allowed values: on, off, full" in r.stderr
    for value, flags in (("off", ["--no-real-genie"]), ("full", ["--real-genie", "--all-real-genie-cases"])):
        r = make("-n", "-W", "bundle", "verify", "RUNNER=local", "PRESET=tiny", f"VERIFY_REAL_GENIE={value}")
        assert r.returncode == 0, r.stderr
        line = next(x for x in r.stdout.splitlines() if " verify" in x and "g4v69" in x)
        assert all(f in line.split() for f in flags), line


def test_stage_chain_order():
    r = make("-n", "compile", "RUNNER=local", "WORKDIR=/tmp/g4v69-chain-test")
    assert r.returncode == 0, r.stderr
    last_words = [line.split()[-1] for line in r.stdout.splitlines() if line.strip()]
    stages = [w for w in last_words if w in ("download", "export", "quantize", "compile")]
    assert stages == ["download", "export", "quantize", "compile"]


def test_stage_recipes_run_in_the_images_and_folders_of_the_stage_table(tmp_path):
    """The stage table (stages/core/pipeline.py) is the one source of each stage's image and folder; the
    Makefile's recipes must run each stage in that image and look for its report in that folder."""
    import re

    from stages.core.pipeline import PIPELINE, STAGE_NAMES

    r = make("-n", "verify", "RUNNER=docker", "PRESET=tiny", f"WORKDIR={tmp_path}", "-W", "FORCE")
    assert r.returncode == 0, r.stderr
    images = {}
    for line in r.stdout.splitlines():
        m = re.search(r"g4v69-([a-z-]+):\S+ g4v69 .*? (" + "|".join(STAGE_NAMES) + r")\b", line)
        if m:
            images[m.group(2)] = m.group(1)
    assert images == {s.name: s.image for s in PIPELINE}
    for s in PIPELINE:
        report = stage_report(s.name, "/w")
        assert report == f"/w/{s.folder}/" + ("tiny/" if s.per_checkpoint else "") + "report.json"


def test_stage_rules_follow_the_stage_table(tmp_path):
    """A stage's report depends on its upstream stages' reports (and its stamp, or FORCE for a check
    without one), read off the rule Make built from the table, not a hand-written copy."""
    from stages.core.pipeline import PIPELINE

    db = make("-p", "-n", "-q", "help", "PRESET=tiny", f"WORKDIR={tmp_path}").stdout
    for s in PIPELINE:
        report = stage_report(s.name, str(tmp_path))
        rule = next(line for line in db.splitlines() if line.startswith(f"{report}:"))
        prereqs = rule.split(":", 1)[1].split("|")[0].split()
        ups = [p for p in prereqs if p.endswith("report.json")]
        assert sorted(ups) == sorted(stage_report(u, str(tmp_path)) for u in s.upstream), s.name
        assert any(p.endswith("FORCE") for p in prereqs) != s.stamped, s.name


@in_venv
def test_plan_runs_locally_and_matches_the_cli():
    r = make_local("plan")
    assert r.returncode == 0, r.stderr
    assert "SM8450 (v69)" in r.stdout and "Roofline" in r.stdout and "Layout rule" in r.stdout
    j = make_local("g4v69", "ARGS=plan --json")
    assert json.loads(j.stdout)["soc"] == "SM8450"


@in_venv
def test_bad_config_through_make_fails_and_writes_nothing(tmp_path):
    r = make_local("download", f"WORKDIR={tmp_path}", "SOC=SM0000")
    assert r.returncode != 0 and "config field 'soc'" in r.stderr
    assert list(tmp_path.iterdir()) == []
