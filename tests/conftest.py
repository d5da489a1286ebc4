from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
