"""BASE_IMAGE=auto (docker/base-ref.sh, docker/ensure-base.sh) and docker/host-setup.sh against a fake
`docker` on the path: the fallback `make demo` takes on a host with no registry, and what a host with
nothing installed is told."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OFFICIAL, DEBOOTSTRAP = "python:3.11-slim-bookworm", "g4v69-base:bookworm-test"


def fake_docker(tmp_path: Path, present: list[str], pull_ok: bool, engine: bool = True) -> Path:
    """A `docker` that knows the images in `present`, logs each call, and pulls or fails to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    images = " ".join(f"'{i}'" for i in present)
    (bin_dir / "docker").write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {log}\n'
        'case "$1 $2" in\n'
        f'  "image inspect") for i in {images}; do [ "$i" = "$3" ] && exit 0; done; exit 1;;\n'
        f'  "pull "*) exit {0 if pull_ok else 1};;\n'
        f'  "info "*) exit {0 if engine else 1};;\n'
        "esac\nexit 0\n"
    )
    (bin_dir / "docker").chmod(0o755)
    return bin_dir


def run(script: str, tmp_path: Path, bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # No /usr/sbin on the path: debootstrap (and dockerd) are "not installed".
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run(
        ["bash", str(ROOT / "docker" / script), *args], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "present, chosen",
    [([OFFICIAL, DEBOOTSTRAP], OFFICIAL), ([DEBOOTSTRAP], DEBOOTSTRAP), ([], OFFICIAL)],
)
def test_auto_prefers_the_official_base_then_a_built_one(tmp_path, present, chosen):
    r = run("base-ref.sh", tmp_path, fake_docker(tmp_path, present, pull_ok=False), OFFICIAL, DEBOOTSTRAP)
    assert r.returncode == 0 and r.stdout.strip() == chosen


def test_a_present_base_is_neither_pulled_nor_built(tmp_path):
    r = run(
        "ensure-base.sh", tmp_path, fake_docker(tmp_path, [DEBOOTSTRAP], pull_ok=True), OFFICIAL, DEBOOTSTRAP
    )
    assert r.returncode == 0
    assert "pull" not in (tmp_path / "docker.log").read_text()


def test_the_official_base_is_pulled_where_a_registry_answers(tmp_path):
    r = run("ensure-base.sh", tmp_path, fake_docker(tmp_path, [], pull_ok=True), OFFICIAL, DEBOOTSTRAP)
    assert r.returncode == 0 and f"pull {OFFICIAL}" in (tmp_path / "docker.log").read_text()


def test_without_a_registry_it_builds_the_debootstrap_base_or_says_how(tmp_path):
    """No registry: it goes on to build from Debian packages; here debootstrap is missing, and the
    message names the one command that installs it."""
    r = run("ensure-base.sh", tmp_path, fake_docker(tmp_path, [], pull_ok=False), OFFICIAL, DEBOOTSTRAP)
    assert r.returncode == 1
    assert f"building {DEBOOTSTRAP} from Debian packages" in r.stderr
    assert "debootstrap not found; run `make setup`" in r.stderr


def test_host_setup_installs_exactly_what_is_missing(tmp_path):
    r = run("host-setup.sh", tmp_path, fake_docker(tmp_path, [], pull_ok=False), "tools", "--dry-run")
    # the fake docker is there; dockerd and debootstrap (in /usr/sbin, off this path) are not
    assert r.returncode == 0 and r.stdout.strip() == "would run: apt-get install -y debootstrap docker.io"


def test_host_setup_names_the_one_install_command_without_root(tmp_path):
    if os.getuid() == 0:
        pytest.skip("as root the script installs instead of printing the command")
    bin_dir = fake_docker(tmp_path, [], pull_ok=False)
    # A host with password-less sudo would install for real: this sudo asks for a password.
    (bin_dir / "sudo").write_text("#!/bin/sh\necho 'sudo: a password is required' >&2\nexit 1\n")
    (bin_dir / "sudo").chmod(0o755)
    r = run("host-setup.sh", tmp_path, bin_dir, "tools")
    assert r.returncode == 1 and "  sudo apt-get install -y debootstrap docker.io" in r.stderr


def test_host_setup_leaves_a_running_engine_alone(tmp_path):
    r = run("host-setup.sh", tmp_path, fake_docker(tmp_path, [], pull_ok=False), "engine")
    assert r.returncode == 0 and "docker engine answering" in r.stdout
